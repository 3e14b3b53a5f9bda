"""Control loops of the fleet, as Celery tasks: level-triggered, idempotent, no results."""

from __future__ import annotations

from celery import shared_task

from serving import actions, routing_table


@shared_task(name="serving.reconcile", ignore_result=True)
def reconcile() -> None:
    actions.do_reconcile()


@shared_task(name="serving.node_health", ignore_result=True)
def node_health() -> None:
    actions.do_mark_lost_nodes()


@shared_task(name="serving.publish_routing_table", ignore_result=True)
def publish_routing_table() -> None:
    routing_table.publish_routing_table()
