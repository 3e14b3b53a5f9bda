"""Node drains that finish or explain: a replica with nowhere to go says why and what would
unblock it; past the drain's deadline the console asks to force or cancel; a node whose
replicas are all gone is drained. Bad input is refused with a message and changes nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from pytest_django import Settings

from registry.models import Deployment
from serving.actions.nodes import (
    NodeActionRefused,
    do_cancel_drain_node,
    do_drain_node,
    do_force_drain_node,
)
from serving.actions.reconcile import do_reconcile
from serving.models import Node, Replica

from .conftest import (
    MakeDeployment,
    MakePool,
    Register,
    RegisteredNode,
    replica_report,
    send_heartbeat,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    return client


def _node(registered: RegisteredNode) -> Node:
    return Node.objects.get(pk=registered["node_id"])


def _serving(
    deployment: Deployment, registered: RegisteredNode, replicas_min: int = 1
) -> list[Replica]:
    """Place the deployment's replicas and have the agent report them Ready."""
    Deployment.objects.filter(pk=deployment.pk).update(replicas_min=replicas_min)
    do_reconcile()
    placed = list(deployment.replicas.filter(node_id=registered["node_id"]).order_by("pk"))
    reports = [replica_report(r.replica_id, "Ready", port=18001 + i) for i, r in enumerate(placed)]
    send_heartbeat(registered, replicas=reports)
    return placed


@pytest.fixture
def blocked(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> tuple[Node, Replica]:
    """The only node of pool l4-eu drains while its replica is the deployment's minimum."""
    pool, secret = make_pool()
    only = register(secret, "gpu-1", gpus=1)
    (replica,) = _serving(make_deployment(pool), only)
    do_drain_node(_node(only))
    do_reconcile()
    replica.refresh_from_db()
    return _node(only), replica


def test_the_only_node_of_a_pool_drains_blocked_with_the_reason_and_what_unblocks_it(
    blocked: tuple[Node, Replica],
) -> None:
    node, replica = blocked
    name = replica.deployment.name
    assert (node.status, replica.state) == ("Draining", Replica.State.READY)
    assert replica.drain_blocked_reason == (
        "gpu-1 is the only node of pool l4-eu; stopping it would leave deployment "
        f"{name} 0 Ready replicas, under its replicas_min of 1"
    )
    assert replica.drain_unblock == [
        "add a node to pool l4-eu with at least 1 free GPU",
        f"lower replicas_min of deployment {name} to 0",
        f"force the drain: the replica stops and deployment {name} runs at 0 of 1 replica",
    ]
    assert replica.drain_blocked_since is not None


def test_a_blocked_drain_keeps_the_time_it_was_first_blocked(
    blocked: tuple[Node, Replica],
) -> None:
    _, replica = blocked
    since = replica.drain_blocked_since
    do_reconcile()
    replica.refresh_from_db()
    assert replica.drain_blocked_since == since


def test_a_drain_blocked_by_the_tensor_parallel_degree_names_the_gpus_it_needs(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    big = register(secret, "gpu-1", gpus=2)
    register(secret, "gpu-2", gpus=1)
    (replica,) = _serving(make_deployment(pool, tensor_parallel=2), big)
    do_drain_node(_node(big))
    do_reconcile()
    replica.refresh_from_db()
    assert replica.drain_blocked_reason.startswith(
        "no other Ready node of pool l4-eu has 2 free GPUs for its TP 2 (1 free on 1 node)"
    )
    assert replica.drain_unblock[0] == "add a node to pool l4-eu with at least 2 free GPUs"


def test_a_drain_whose_other_nodes_are_cordoned_says_so(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register, staff: Client
) -> None:
    pool, secret = make_pool()
    first = register(secret, "gpu-1", gpus=1)
    other = register(secret, "gpu-2", gpus=1)
    staff.post(f"/api/v1/nodes/{other['node_id']}/cordon/")
    (replica,) = _serving(make_deployment(pool), first)
    do_drain_node(_node(first))
    do_reconcile()
    replica.refresh_from_db()
    assert replica.drain_blocked_reason.startswith(
        "no other node of pool l4-eu is Ready and schedulable (1 cordoned, draining or NotReady)"
    )


def test_without_a_minimum_to_keep_a_replica_with_nowhere_to_go_leaves(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    only = register(secret, "gpu-1", gpus=1)
    (replica,) = _serving(make_deployment(pool), only, replicas_min=0)
    do_drain_node(_node(only))
    do_reconcile()
    replica.refresh_from_db()
    assert (replica.state, replica.drain_blocked_reason) == (Replica.State.DRAINING, "")


def test_a_second_node_with_room_takes_the_replica_and_the_drain_finishes(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    old = register(secret, "gpu-1", gpus=1)
    deployment = make_deployment(pool)
    (original,) = _serving(deployment, old)
    new = register(secret, "gpu-2", gpus=1)
    do_drain_node(_node(old))
    do_reconcile()
    replacement = deployment.replicas.get(node_id=new["node_id"])
    original.refresh_from_db()
    # Still serving, and saying what it waits for, until the replacement is Ready.
    assert original.state == Replica.State.READY
    assert original.drain_blocked_reason.startswith("waiting for its replacement to become Ready")
    assert original.drain_unblock[0] == (
        f"wait for replica {replacement.pk} on gpu-2 (pending) to become Ready"
    )
    send_heartbeat(new, replicas=[replica_report(replacement.replica_id, "Ready")])
    do_reconcile()
    original.refresh_from_db()
    assert (original.state, original.drain_blocked_reason) == (Replica.State.DRAINING, "")
    assert _node(old).status == "Draining"  # its process is still stopping
    send_heartbeat(old, replicas=[])
    report = do_reconcile()
    node = _node(old)
    assert (report.drains_finished, node.status, node.scheduling) == (1, "Drained", "drained")
    assert node.drain_finished_at is not None


def test_a_drained_node_gets_no_replicas_until_uncordoned(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register, staff: Client
) -> None:
    pool, secret = make_pool()
    only = register(secret, "gpu-1", gpus=1)
    do_drain_node(_node(only))
    do_reconcile()
    make_deployment(pool)
    do_reconcile()
    assert not Replica.objects.filter(node_id=only["node_id"]).exists()
    page = staff.get("/console/fleet/").content.decode()
    assert "Drained" in page and "no replicas left on it" in page
    staff.post(f"/console/fleet/nodes/{only['node_id']}/uncordon/")
    do_reconcile()
    assert Replica.objects.filter(node_id=only["node_id"]).count() == 1


@pytest.mark.usefixtures("blocked")
def test_before_its_deadline_a_blocked_drain_shows_its_reason_but_asks_nothing(
    staff: Client,
) -> None:
    page = staff.get("/console/fleet/").content.decode()
    assert "gpu-1 is the only node of pool l4-eu" in page
    assert "the console asks to force or cancel it in" in page
    assert "Force drain" not in page and "Cancel drain" in page


def test_past_the_deadline_the_console_asks_to_force_or_cancel(
    blocked: tuple[Node, Replica], staff: Client, settings: Settings
) -> None:
    node, replica = blocked
    Node.objects.filter(pk=node.pk).update(
        drain_started_at=timezone.now() - timedelta(seconds=settings.NODE_DRAIN_DEADLINE_S + 1)
    )
    page = staff.get("/console/fleet/").content.decode()
    since = timezone.localtime(replica.drain_blocked_since).strftime("%Y-%m-%d %H:%M:%S")
    assert f"Drain blocked since {since}: gpu-1 is the only node of pool l4-eu" in page
    assert "Force drain" in page and "Cancel drain" in page
    assert "add a node to pool l4-eu with at least 1 free GPU" in page


def test_the_deadline_comes_from_the_setting_or_the_drain_itself(
    make_pool: MakePool, register: Register, settings: Settings
) -> None:
    _, secret = make_pool()
    node = _node(register(secret, "gpu-1", gpus=1))
    settings.NODE_DRAIN_DEADLINE_S = 60
    drained = do_drain_node(node)
    assert drained.drain_started_at is not None
    assert drained.drain_deadline_at == drained.drain_started_at + timedelta(seconds=60)
    do_cancel_drain_node(drained)
    own = do_drain_node(node, deadline_s=0)
    assert (own.drain_deadline_at, own.drain_overdue) == (own.drain_started_at, True)


def test_force_stops_the_replicas_and_the_node_ends_drained(
    blocked: tuple[Node, Replica], staff: Client
) -> None:
    node, replica = blocked
    Node.objects.filter(pk=node.pk).update(drain_started_at=timezone.now() - timedelta(hours=1))
    reply = staff.post(f"/console/fleet/nodes/{node.pk}/force-drain/", follow=True)
    assert "gpu-1 drain forced" in reply.content.decode()
    replica.refresh_from_db()
    assert replica.state == Replica.State.DRAINING
    do_reconcile()
    assert _node_obj(node).status == "Draining"
    Replica.objects.filter(pk=replica.pk).update(
        draining_since=timezone.now() - timedelta(minutes=5)
    )
    do_reconcile()  # the agent never confirmed: the replica is written off
    replica.refresh_from_db()
    assert replica.state == Replica.State.STOPPED
    assert _node_obj(node).status == "Drained"
    assert not replica.deployment.replicas.filter(state__in=Replica.DESIRED_STATES).exists()


def _node_obj(node: Node) -> Node:
    return Node.objects.get(pk=node.pk)


def test_a_forced_drain_ends_when_the_agent_confirms_the_stop(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    only = register(secret, "gpu-1", gpus=1)
    (replica,) = _serving(make_deployment(pool), only)
    do_drain_node(_node(only))
    do_reconcile()
    do_force_drain_node(_node(only))
    send_heartbeat(only, replicas=[])
    do_reconcile()
    replica.refresh_from_db()
    assert (replica.state, _node(only).status) == (Replica.State.STOPPED, "Drained")


def test_cancel_makes_the_node_ready_and_leaves_its_replicas_alone(
    blocked: tuple[Node, Replica], staff: Client
) -> None:
    node, replica = blocked
    reply = staff.post(f"/console/fleet/nodes/{node.pk}/cancel-drain/", follow=True)
    assert "gpu-1 drain cancelled" in reply.content.decode()
    after = Replica.objects.get(pk=replica.pk)
    assert _node_obj(node).status == "Ready"
    assert (after.state, after.node_id, after.gpu_indices) == (
        Replica.State.READY,
        node.pk,
        replica.gpu_indices,
    )
    assert (after.drain_blocked_reason, after.drain_blocked_since) == ("", None)
    do_reconcile()
    assert Replica.objects.get(pk=replica.pk).state == Replica.State.READY


def test_staff_force_and_cancel_through_the_api(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register, staff: Client
) -> None:
    pool, secret = make_pool()
    only = register(secret, "gpu-1", gpus=1)
    (replica,) = _serving(make_deployment(pool), only)
    answer = staff.post(
        f"/api/v1/nodes/{only['node_id']}/drain/",
        {"deadline_s": 0},
        content_type="application/json",
    ).json()
    assert (answer["status"], answer["drain_overdue"]) == ("Draining", True)
    do_reconcile()
    listed = staff.get(f"/api/v1/replicas/{replica.pk}/").json()
    assert listed["drain_blocked_reason"].startswith("gpu-1 is the only node of pool l4-eu")
    assert staff.post(f"/api/v1/nodes/{only['node_id']}/cancel-drain/").json()["status"] == "Ready"
    staff.post(f"/api/v1/nodes/{only['node_id']}/drain/")
    forced = staff.post(f"/api/v1/nodes/{only['node_id']}/force-drain/")
    assert forced.status_code == 200
    assert Replica.objects.get(pk=replica.pk).state == Replica.State.DRAINING


# --- bad input ----------------------------------------------------------------------------


def _unchanged(node: Node, replica: Replica) -> tuple[str, str, object]:
    fresh, again = _node_obj(node), Replica.objects.get(pk=replica.pk)
    return fresh.scheduling, again.state, fresh.drain_started_at


def test_an_unknown_console_action_is_refused_with_a_message(
    blocked: tuple[Node, Replica], staff: Client
) -> None:
    node, replica = blocked
    before = _unchanged(node, replica)
    reply = staff.post(f"/console/fleet/nodes/{node.pk}/explode/", follow=True)
    assert reply.status_code == 200
    assert "Not done: &#x27;explode&#x27; is not a node action" in reply.content.decode()
    assert _unchanged(node, replica) == before


def test_an_unknown_node_is_a_404(staff: Client, db: None) -> None:
    assert staff.post("/console/fleet/nodes/999999/drain/").status_code == 404
    assert staff.post("/api/v1/nodes/999999/force-drain/").status_code == 404


def test_draining_a_drained_node_is_refused_and_changes_nothing(
    make_pool: MakePool, register: Register, staff: Client
) -> None:
    _, secret = make_pool()
    node = _node(register(secret, "gpu-1", gpus=1))
    do_drain_node(node)
    do_reconcile()
    finished = _node_obj(node).drain_finished_at
    reply = staff.post(f"/console/fleet/nodes/{node.pk}/drain/", follow=True)
    assert "Not done: gpu-1 is already drained: uncordon it to use it." in reply.content.decode()
    api = staff.post(f"/api/v1/nodes/{node.pk}/drain/")
    assert (api.status_code, api.json()) == (
        400,
        {"detail": "gpu-1 is already drained: uncordon it to use it."},
    )
    assert (_node_obj(node).scheduling, _node_obj(node).drain_finished_at) == ("drained", finished)


def test_draining_a_draining_node_keeps_its_deadline(blocked: tuple[Node, Replica]) -> None:
    node, replica = blocked
    before = _unchanged(node, replica)
    with pytest.raises(NodeActionRefused, match="already draining"):
        do_drain_node(node)
    assert _unchanged(node, replica) == before


def test_force_or_cancel_on_a_node_that_is_not_draining_is_refused(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register, staff: Client
) -> None:
    pool, secret = make_pool()
    only = register(secret, "gpu-1", gpus=1)
    (replica,) = _serving(make_deployment(pool), only)
    node = _node(only)
    for action in ("force-drain", "cancel-drain"):
        reply = staff.post(f"/console/fleet/nodes/{node.pk}/{action}/", follow=True)
        assert "Not done: gpu-1 is not draining" in reply.content.decode()
        api = staff.post(f"/api/v1/nodes/{node.pk}/{action}/")
        assert api.status_code == 400
        assert api.json()["detail"].startswith("gpu-1 is not draining")
    assert (_node_obj(node).status, Replica.objects.get(pk=replica.pk).state) == (
        "Ready",
        Replica.State.READY,
    )


def test_a_negative_drain_deadline_is_a_400(
    make_pool: MakePool, register: Register, staff: Client
) -> None:
    _, secret = make_pool()
    node = _node(register(secret, "gpu-1", gpus=1))
    reply = staff.post(
        f"/api/v1/nodes/{node.pk}/drain/", {"deadline_s": -5}, content_type="application/json"
    )
    assert reply.status_code == 400 and "deadline_s" in reply.json()
    assert _node_obj(node).scheduling == "active"
