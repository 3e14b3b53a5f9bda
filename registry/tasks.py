"""Celery tasks of the registry: the rollout controller (which also stops the drained
deployments) and the visibility republish."""

from __future__ import annotations

from config.celery import task
from registry.actions import do_finish_drained_deployments, publish_visibility
from registry.controller import run_rollout_tick


@task(name="registry.rollout_tick", ignore_result=True)
def rollout_tick() -> None:
    run_rollout_tick()
    # A promoted rollout's baseline, a rolled-back canary and a retired deployment drain;
    # once their last replica stopped they are stopped, on the same two-second beat.
    do_finish_drained_deployments()


@task(name="registry.publish_visibility", ignore_result=True)
def publish_visibility_task() -> None:
    # Repairs a publish lost to a Redis blip at commit time.
    publish_visibility()
