"""Console pages of the fleet: the live overview, pools/nodes/replicas, replica events."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from django.contrib import messages
from django.db import OperationalError
from django.db.models import Prefetch
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from config.health import check_redis
from config.views import staff_required
from serving.actions import nodes
from serving.console.queries import (
    GPU_STATES,
    empty_history,
    fleet_history,
    fleet_snapshot,
    fleet_snapshot_without_telemetry,
    unavailable_snapshot,
)
from serving.models import GpuPool, Node, Replica

log = logging.getLogger(__name__)

# The banner base.html shows (as `figures_unavailable`) when a page's live figures are missing.
REDIS_AWAY = "Live figures unavailable: Redis is unreachable."
POSTGRES_AWAY = "Live figures unavailable: PostgreSQL is not answering."

NODE_ACTIONS: dict[str, tuple[Callable[[Node], Node], str]] = {
    "cordon": (nodes.do_cordon_node, "cordoned: no new replicas there"),
    "uncordon": (nodes.do_uncordon_node, "uncordoned: replicas may be placed there"),
    "drain": (nodes.do_drain_node, "draining: its replicas move elsewhere"),
    "force-drain": (
        nodes.do_force_drain_node,
        "drain forced: its replicas stop, their deployments run with fewer until room appears",
    ),
    "cancel-drain": (nodes.do_cancel_drain_node, "drain cancelled: the node is Ready again"),
    "release": (nodes.do_release_node, "released for re-registration"),
}


def overview_figures() -> tuple[dict[str, Any], dict[str, list[Any]], str | None]:
    """The snapshot, the chart's history and the banner: with Redis away the PostgreSQL half
    of the snapshot; with PostgreSQL not answering (a timeout) no figures at all."""
    try:
        return fleet_snapshot(rate=False), fleet_history(), None
    except redis.RedisError as error:
        log.warning("console overview without Redis: %s", error)
    except OperationalError as error:
        log.warning("console overview without PostgreSQL: %s", error)
        return unavailable_snapshot(), empty_history(), POSTGRES_AWAY
    try:
        return fleet_snapshot_without_telemetry(), empty_history(), REDIS_AWAY
    except OperationalError as error:
        log.warning("console overview without PostgreSQL: %s", error)
        return unavailable_snapshot(), empty_history(), POSTGRES_AWAY


@staff_required
def overview(request: HttpRequest) -> HttpResponse:
    snapshot, history, unavailable = overview_figures()
    context = {
        "snapshot": snapshot,
        "history": history,
        "gpu_states": GPU_STATES,
        "figures_unavailable": unavailable,
    }
    return render(request, "console/overview.html", context)


@staff_required
def fleet(request: HttpRequest) -> HttpResponse:
    blocked = Replica.objects.filter(drain_blocked_since__isnull=False).select_related("deployment")
    pools = GpuPool.objects.select_related("gpu_class").prefetch_related(
        "nodes__gpus",
        Prefetch(
            "nodes__replicas",
            queryset=blocked.order_by("drain_blocked_since", "pk"),
            to_attr="blocked_replicas",
        ),
    )
    replicas = (
        Replica.objects.exclude(state=Replica.State.STOPPED)
        .select_related("node__pool", "deployment")
        .order_by("node__pool__name", "node__hostname", "pk")
    )
    # Engine and GPU telemetry lives in Redis and each heartbeat writes it there: without Redis
    # what this page shows of node health may be going stale.
    context = {
        "pools": pools,
        "replicas": replicas,
        "figures_unavailable": REDIS_AWAY if check_redis() else None,
    }
    return render(request, "console/fleet.html", context)


@staff_required
@require_POST
def node_action(request: HttpRequest, node_id: int, action: str) -> HttpResponse:
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        raise Http404("No such node.")
    if action not in NODE_ACTIONS:
        known = ", ".join(NODE_ACTIONS)
        messages.error(request, f"Not done: {action!r} is not a node action ({known}).")
        return redirect("console-fleet")
    change, done = NODE_ACTIONS[action]
    try:
        change(node)
    except nodes.NodeActionRefused as refused:
        messages.error(request, f"Not done: {refused}")
        return redirect("console-fleet")
    messages.success(request, f"{node.hostname} {done}.")
    return redirect("console-fleet")


@staff_required
def replica_detail(request: HttpRequest, replica_id: int) -> HttpResponse:
    replica = (
        Replica.objects.select_related("node__pool", "deployment").filter(pk=replica_id).first()
    )
    if replica is None:
        raise Http404("No such replica.")
    events = replica.events.order_by("-at")[:200]
    return render(request, "console/replica.html", {"replica": replica, "events": events})
