"""Reconcile, node health, cordon and drain, called directly (no worker needed)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from registry.models import Deployment
from serving.actions.nodes import do_cordon_node, do_drain_node, do_mark_lost_nodes
from serving.actions.reconcile import do_reconcile
from serving.models import Node, Replica

from .conftest import MakeDeployment, MakePool, Register, replica_report, send_heartbeat

pytestmark = pytest.mark.django_db


def _live(deployment: Deployment) -> list[Replica]:
    return list(deployment.replicas.filter(state__in=Replica.DESIRED_STATES))


def test_a_tensor_parallel_replica_gets_as_many_gpus_as_its_degree(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool("h100", "H100-SXM-80GB")
    register(secret, "h100-1", gpus=4, name="H100-SXM-80GB", memory_mb=81559)
    deployment = make_deployment(
        pool, model="llama-3.1-70b", quantization="fp8", tensor_parallel=2, replicas=2
    )
    do_reconcile()
    assert sorted(r.gpu_indices for r in _live(deployment)) == [[0, 1], [2, 3]]


def test_reconcile_twice_places_nothing_more(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    register(secret, "gpu-1", gpus=4)
    deployment = make_deployment(pool, replicas=2)
    do_reconcile()
    second = do_reconcile()
    assert (len(_live(deployment)), second.placed) == (2, 0)


def test_replicas_spread_over_nodes_before_packing_one(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    register(secret, "gpu-1", gpus=2)
    register(secret, "gpu-2", gpus=2)
    deployment = make_deployment(pool, replicas=2)
    do_reconcile()
    assert len({r.node_id for r in _live(deployment)}) == 2


def test_a_model_too_big_for_the_nodes_gpus_is_not_placed(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    register(secret, "gpu-1", gpus=1)
    deployment = make_deployment(pool, model="llama-3.1-70b", quantization="bf16")
    report = do_reconcile()
    assert (_live(deployment), report.unplaceable) == ([], 1)


def test_a_cordoned_node_gets_no_new_replicas(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=2)
    do_cordon_node(Node.objects.get(pk=node["node_id"]))
    deployment = make_deployment(pool)
    do_reconcile()
    assert _live(deployment) == []


def test_scaling_down_drains_the_replicas_not_yet_serving_first(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=2)
    deployment = make_deployment(pool, replicas=2)
    do_reconcile()
    serving, starting = _live(deployment)
    send_heartbeat(
        node,
        replicas=[
            replica_report(serving.replica_id, "Ready"),
            replica_report(starting.replica_id, "Starting"),
        ],
    )
    deployment.replicas_desired = 1
    deployment.save()
    do_reconcile()
    starting.refresh_from_db()
    assert [r.pk for r in _live(deployment)] == [serving.pk]
    assert starting.state == Replica.State.DRAINING


def test_a_draining_replica_stops_when_the_agent_no_longer_reports_it(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=1)
    deployment = make_deployment(pool)
    do_reconcile()
    deployment.replicas_desired = 0
    deployment.save()
    do_reconcile()
    send_heartbeat(node, replicas=[])
    assert deployment.replicas.get().state == Replica.State.STOPPED


def test_a_silent_node_is_not_ready_and_its_replicas_are_placed_elsewhere(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    lost = register(secret, "gpu-1", gpus=1)
    deployment = make_deployment(pool)
    do_reconcile()
    register(secret, "gpu-2", gpus=1)
    Node.objects.filter(pk=lost["node_id"]).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=9)
    )
    assert do_mark_lost_nodes() == [lost["node_id"]]
    do_reconcile()
    (moved,) = _live(deployment)
    assert moved.node.hostname == "gpu-2"
    assert deployment.replicas.filter(node_id=lost["node_id"], state=Replica.State.STOPPED).exists()


def test_a_node_that_heartbeats_in_time_stays_ready(
    make_pool: MakePool, register: Register
) -> None:
    _, secret = make_pool()
    node = register(secret, "gpu-1")
    Node.objects.filter(pk=node["node_id"]).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=5)
    )
    assert do_mark_lost_nodes() == []


def test_draining_a_node_moves_its_replicas_once_replacements_serve(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    old = register(secret, "gpu-1", gpus=1)
    deployment = make_deployment(pool)
    do_reconcile()
    new = register(secret, "gpu-2", gpus=1)
    do_drain_node(Node.objects.get(pk=old["node_id"]))
    do_reconcile()
    replacement = deployment.replicas.get(node_id=new["node_id"])
    original = deployment.replicas.get(node_id=old["node_id"])
    assert original.state != Replica.State.DRAINING  # still serving until the replacement is up
    send_heartbeat(new, replicas=[replica_report(replacement.replica_id, "Ready")])
    do_reconcile()
    send_heartbeat(old, replicas=[])
    original.refresh_from_db()
    assert original.state == Replica.State.STOPPED
    assert not Replica.objects.filter(
        node_id=old["node_id"], state__in=Replica.HOLDING_STATES
    ).exists()
