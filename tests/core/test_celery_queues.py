"""Celery's queues by latency class: every task lands on a queue some worker serves, and the
usage ingest never shares a queue with rollups and invoices."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from config.celery import app

ROOT = Path(__file__).resolve().parents[2]
PLATFORM_TASKS = ("platform.", "tenants.", "registry.", "serving.", "metering.")


def queue_of(task_name: str) -> str:
    route = app.amqp.router.route({}, task_name)
    return str(route["queue"].name)


def platform_task_names() -> list[str]:
    app.loader.import_default_modules()
    return sorted(name for name in app.tasks if name.startswith(PLATFORM_TASKS))


def kubernetes_worker_queues() -> set[str]:
    queues: set[str] = set()
    for doc in yaml.safe_load_all((ROOT / "platform/kubernetes/celery.yaml").read_text()):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for arg in container.get("command", []):
                if arg.startswith("--queues="):
                    queues.update(arg.removeprefix("--queues=").split(","))
    return queues


def make_run_worker_queues() -> set[str]:
    """The queues of the workers `make run` starts, read off scripts/run.py's worker table."""
    source = (ROOT / "scripts/run.py").read_text()
    return set(re.findall(r'\("worker[a-z-]*", "([a-z]+)", \d+\)', source))


def test_every_task_is_registered_and_every_beat_entry_names_one() -> None:
    names = platform_task_names()
    assert "metering.ingest" in names and "serving.publish_routing_table" in names
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert scheduled <= set(names), scheduled - set(names)


@pytest.mark.parametrize(
    ("task", "queue"),
    [
        ("metering.ingest", "realtime"),
        ("serving.publish_routing_table", "realtime"),
        ("serving.reconcile", "realtime"),
        ("registry.rollout_tick", "realtime"),
        ("metering.rollup_recent_hours", "batch"),
        ("metering.refresh_invoices", "batch"),
        ("metering.check_budgets", "batch"),
    ],
)
def test_tasks_go_to_their_latency_class(task: str, queue: str) -> None:
    assert queue_of(task) == queue


def test_every_queue_a_task_uses_is_served_in_make_run_and_on_kubernetes() -> None:
    used = {queue_of(name) for name in platform_task_names()}
    assert used == {"realtime", "batch"}
    assert used <= make_run_worker_queues(), make_run_worker_queues()
    assert used <= kubernetes_worker_queues(), kubernetes_worker_queues()
