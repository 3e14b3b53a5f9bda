"""Celery tasks of the registry: the rollout controller and the visibility republish."""

from __future__ import annotations

from config.celery import task
from registry.actions import publish_visibility
from registry.controller import run_rollout_tick


@task(name="registry.rollout_tick", ignore_result=True)
def rollout_tick() -> None:
    run_rollout_tick()


@task(name="registry.publish_visibility", ignore_result=True)
def publish_visibility_task() -> None:
    # Repairs a publish lost to a Redis blip at commit time.
    publish_visibility()
