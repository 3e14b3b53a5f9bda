"""The Celery application: configured from Django settings under the CELERY_ namespace.

Each app may declare its periodic loops in `<app>/schedule.py` as a plain `BEAT_SCHEDULE`
dict (task name -> schedule); they are merged here so beat runs every control loop.
"""

from __future__ import annotations

import importlib
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

PLATFORM_APPS = ("tenants", "registry", "serving", "metering")

app = Celery("config")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The project's own tasks (config/tasks.py); each app's tasks.py is found by autodiscovery.
app.conf.imports = ("config.tasks",)
app.autodiscover_tasks()


def collect_beat_schedule() -> dict[str, dict[str, object]]:
    schedule: dict[str, dict[str, object]] = {}
    for name in PLATFORM_APPS:
        try:
            module = importlib.import_module(f"{name}.schedule")
        except ModuleNotFoundError as error:
            if error.name != f"{name}.schedule":
                raise
            continue
        schedule.update(module.BEAT_SCHEDULE)
    return schedule


app.conf.beat_schedule = {**(app.conf.beat_schedule or {}), **collect_beat_schedule()}
