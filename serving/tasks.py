"""Control loops of the fleet, as Celery tasks: level-triggered, idempotent, no results.

Beat's table is `serving/schedule.py`; the queue each runs on is `CELERY_TASK_ROUTES` in
`config/settings.py`.
"""

from __future__ import annotations

from config.celery import task
from config.redis import redis_client
from serving.actions import nodes, routing_table
from serving.actions import reconcile as reconciler
from serving.actions.autoscale import do_autoscale
from serving.console.live import publish_fleet_snapshot


@task(name="serving.reconcile", ignore_result=True)
def reconcile() -> None:
    reconciler.do_reconcile()


@task(name="serving.node_health", ignore_result=True)
def node_health() -> None:
    nodes.do_mark_lost_nodes()


@task(name="serving.publish_routing_table", ignore_result=True)
def publish_routing_table() -> None:
    routing_table.publish_routing_table()


@task(name="serving.autoscale", ignore_result=True)
def autoscale() -> None:
    do_autoscale(redis_client())


@task(name="serving.broadcast_fleet", ignore_result=True)
def broadcast_fleet() -> None:
    """Beat runs this every 2 s; a missed run only delays the next picture by 2 s."""
    publish_fleet_snapshot()
