"""Console pages of the fleet: the live overview, pools/nodes/replicas, replica events."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from config.views import staff_required
from serving.actions import nodes
from serving.console.queries import GPU_STATES, fleet_history, fleet_snapshot
from serving.models import GpuPool, Node, Replica

NODE_ACTIONS = {
    "cordon": nodes.do_cordon_node,
    "uncordon": nodes.do_uncordon_node,
    "drain": nodes.do_drain_node,
    "release": nodes.do_release_node,
}


@staff_required
def overview(request: HttpRequest) -> HttpResponse:
    context = {
        "snapshot": fleet_snapshot(rate=False),
        "history": fleet_history(),
        "gpu_states": GPU_STATES,
    }
    return render(request, "console/overview.html", context)


@staff_required
def fleet(request: HttpRequest) -> HttpResponse:
    pools = GpuPool.objects.select_related("gpu_class").prefetch_related("nodes__gpus")
    replicas = (
        Replica.objects.exclude(state=Replica.State.STOPPED)
        .select_related("node__pool", "deployment")
        .order_by("node__pool__name", "node__hostname", "pk")
    )
    return render(request, "console/fleet.html", {"pools": pools, "replicas": replicas})


@staff_required
@require_POST
def node_action(request: HttpRequest, node_id: int, action: str) -> HttpResponse:
    node = Node.objects.filter(pk=node_id).first()
    if node is None or action not in NODE_ACTIONS:
        raise Http404("No such node or action.")
    NODE_ACTIONS[action](node)
    messages.info(request, f"{node.hostname}: {action} requested.")
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
