"""The Celery application: configured from Django settings under the CELERY_ namespace.

Each app may declare its periodic loops in `<app>/schedule.py` as a plain `BEAT_SCHEDULE`
dict (task name -> schedule); they are merged here so beat runs every control loop.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar, cast

from celery import Celery, shared_task

if TYPE_CHECKING:
    from celery.result import AsyncResult, EagerResult

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

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Task(Protocol[P, R_co]):
    """What the project uses of a Celery task, typed (Celery ships no type hints): its name;
    calling it, or `apply`, runs the body in this process; `apply_async` sends it to a worker."""

    name: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def apply_async(
        self,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        **options: object,
    ) -> AsyncResult: ...

    def apply(
        self,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        **options: object,
    ) -> EagerResult: ...


def task(name: str, **options: object) -> Callable[[Callable[P, R]], Task[P, R]]:
    """`celery.shared_task(name=name, **options)`, with a type: the task keeps its function's
    signature for mypy, where the untyped decorator would leave it untyped."""
    return cast("Callable[[Callable[P, R]], Task[P, R]]", shared_task(name=name, **options))
