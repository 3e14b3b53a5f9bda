"""Placement that knows the fleet: free GPUs per node (ready, active nodes; GPUs no live
replica holds), one replica's GPUs on one node, each GPU's own memory. A deployment that fits
the GPU class but has no room now is created pending capacity, with the reason and since when,
which every reconcile keeps up to date."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from registry.actions import do_create_deployment, do_note_canary_placement
from registry.models import Deployment, Model, ModelVersion
from serving.actions.reconcile import do_reconcile
from serving.engine.placement import NodeGpus, check_capacity
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.models import Gpu, GpuPool, Node, Replica
from tests.registry.conftest import approved_version, client_for

H100_MB = 81920


def add_node(pool: GpuPool, hostname: str, gpus: int, **fields: Any) -> Node:
    node = Node.objects.create(
        pool=pool, hostname=hostname, agent_url=f"http://{hostname}:9100", **fields
    )
    for index in range(gpus):
        Gpu.objects.create(
            node=node, index=index, uuid=f"{hostname}-{index}", name="H100", memory_mb=H100_MB
        )
    return node


def console(staff: Any) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def check_form(version: ModelVersion, pool: GpuPool, tp: int, replicas: int = 1) -> dict[str, Any]:
    return {
        "model_version": version.pk,
        "pool": pool.pk,
        "tensor_parallel": tp,
        "max_model_len": 8192,
        "replicas_min": 1,
        "replicas_desired": replicas,
        "replicas_max": max(replicas, 2),
        "slo_tier": "standard",
    }


@pytest.fixture
def h100(pools: dict[str, GpuPool]) -> GpuPool:
    return pools["h100"]


@pytest.fixture
def llama_70b_v1(llama_70b: Model) -> ModelVersion:
    return approved_version(llama_70b, "v1", "bf16")


# --- the pure rule, no database -------------------------------------------------------------


def _capacity(nodes: list[NodeGpus], tp: int, wanted: int = 1) -> Any:
    return check_capacity(
        "h100-us-east",
        nodes,
        load_gpu_specs()["H100-SXM-80GB"],
        load_model_specs()["llama-3.1-70b"],
        "bf16",
        tp,
        wanted,
    )


def test_a_replica_needs_all_its_gpus_on_one_node() -> None:
    two_halves = [NodeGpus("n1", (H100_MB,) * 2), NodeGpus("n2", (H100_MB,) * 2)]
    result = _capacity(two_halves, 4)
    assert not result.ok
    assert (
        result.message == "pool h100-us-east: no node has 4 free GPUs; largest free is 2 on node n1"
    )


def test_replicas_are_counted_node_by_node() -> None:
    nodes = [NodeGpus("n1", (H100_MB,) * 6), NodeGpus("n2", (H100_MB,) * 3)]
    assert _capacity(nodes, 4, wanted=1).ok
    result = _capacity(nodes, 4, wanted=2)
    assert (result.ok, result.placeable) == (False, 1)
    assert "room for 1 of 2 replicas of 4 GPUs on one node" in result.message


def test_gpus_too_small_for_the_model_are_not_room() -> None:
    small = [NodeGpus("n1", (16384,) * 4)]  # 16 GiB each: 70B bf16 at TP 4 needs ~35 GB
    result = _capacity(small, 4)
    assert not result.ok
    assert "too small for the model at TP 4" in result.message


def test_a_pool_without_schedulable_nodes_has_no_room() -> None:
    assert _capacity([], 1).message == "pool h100-us-east: no ready, schedulable node"


# --- the console's check and the create, against the fleet's rows ---------------------------


def test_70b_at_tp4_on_a_one_gpu_pool_is_pending_capacity_with_the_reason(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 1)
    reply = console(staff).post("/console/deployments/check/", check_form(llama_70b_v1, h100, 4))
    page = reply.content.decode()
    assert "Pending capacity" in page
    assert "pool h100-us-east: no node has 4 free GPUs; largest free is 1 on node n1" in page
    assert ">Fits<" not in page
    assert not Deployment.objects.exists()


def test_it_fits_when_a_node_has_4_free_gpus(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 1)
    add_node(h100, "n2", 4)
    reply = console(staff).post("/console/deployments/check/", check_form(llama_70b_v1, h100, 4))
    page = reply.content.decode()
    assert ">Fits<" in page and "Pending capacity" not in page
    assert "room for 1 replica now (largest free is 4 on node n2)" in page


def test_gpus_held_by_live_replicas_are_not_free(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion, llama_8b: Model
) -> None:
    node = add_node(h100, "n1", 4)
    other = Deployment.objects.create(
        name="other", model_version=approved_version(llama_8b, "v1", "bf16"), pool=h100
    )
    Replica.objects.create(deployment=other, node=node, gpu_indices=[0], state="ready")
    Replica.objects.create(deployment=other, node=node, gpu_indices=[1], state="draining")
    Replica.objects.create(deployment=other, node=node, gpu_indices=[2], state="stopped")
    page = (
        console(staff)
        .post("/console/deployments/check/", check_form(llama_70b_v1, h100, 4))
        .content.decode()
    )
    # GPU 0 serves, GPU 1's process is still draining; a stopped replica frees GPU 2.
    assert "no node has 4 free GPUs; largest free is 2 on node n1" in page


@pytest.mark.parametrize(
    "fields",
    [{"scheduling": "draining"}, {"scheduling": "cordoned"}, {"health": "not_ready"}],
    ids=["draining", "cordoned", "not-ready"],
)
def test_nodes_that_take_no_new_replica_are_not_counted(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion, fields: dict[str, str]
) -> None:
    add_node(h100, "n1", 8, **fields)
    add_node(h100, "n2", 1)
    page = (
        console(staff)
        .post("/console/deployments/check/", check_form(llama_70b_v1, h100, 4))
        .content.decode()
    )
    assert "no node has 4 free GPUs; largest free is 1 on node n2" in page


def test_a_model_too_big_for_the_gpu_class_is_still_refused(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 8)
    page = (
        console(staff)
        .post("/console/deployments/check/", check_form(llama_70b_v1, h100, 1))
        .content.decode()
    )
    assert "Does not fit" in page and "Pending capacity" not in page


def test_the_console_creates_it_pending_capacity_and_says_why(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 1)
    reply = console(staff).post(
        "/console/deployments/create/",
        {**check_form(llama_70b_v1, h100, 4), "name": "big"},
        follow=True,
    )
    deployment = Deployment.objects.get(name="big")
    assert deployment.pending_capacity
    assert deployment.placement_failure == (
        "pool h100-us-east: no node has 4 free GPUs; largest free is 1 on node n1"
    )
    assert deployment.placement_failure_since is not None
    page = reply.content.decode()
    assert "created, pending capacity: pool h100-us-east: no node has 4 free GPUs" in page
    row = page[page.index('id="deployment-') :]
    assert "pending capacity" in row and "since " in row


def test_the_api_creates_it_pending_capacity_and_says_why(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 1)
    reply = client_for(staff).post(
        "/api/v1/deployments/",
        {"model_version": llama_70b_v1.pk, "pool": h100.name, "tensor_parallel": 4},
        format="json",
    )
    assert reply.status_code == 201, reply.json()
    body = reply.json()
    assert body["pending_capacity"] is True
    assert "no node has 4 free GPUs; largest free is 1 on node n1" in body["placement_failure"]
    assert body["placement_failure_since"] is not None


def test_a_deployment_with_room_is_not_pending(
    staff: Any, h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 4)
    created = do_create_deployment(model_version=llama_70b_v1, pool=h100, tensor_parallel=4)
    assert (created.pending_capacity, created.placement_failure) == (False, "")


def test_a_disaggregated_deployment_places_decode_on_what_prefill_left(
    h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 4)
    created = do_create_deployment(
        model_version=llama_70b_v1,
        pool=h100,
        decode_pool=h100,
        kv_connector="nixl",
        tensor_parallel=4,
    )
    assert created.pending_capacity
    assert created.placement_failure.startswith("decode phase, pool h100-us-east: no node has 4")


# --- what reconcile reports, kept on every deployment ---------------------------------------


def test_reconcile_records_why_a_deployment_waits_and_since_when(
    h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 1)
    deployment = do_create_deployment(model_version=llama_70b_v1, pool=h100, tensor_parallel=4)
    Deployment.objects.filter(pk=deployment.pk).update(
        placement_failure="", placement_failure_since=None
    )
    do_reconcile()
    deployment.refresh_from_db()
    assert deployment.pending_capacity
    assert deployment.placement_failure == (
        "pool h100-us-east: no node has 4 free GPUs; largest free is 1 on node n1"
    )
    since = deployment.placement_failure_since
    assert since is not None

    do_reconcile()  # still no room: the since stays
    deployment.refresh_from_db()
    assert deployment.placement_failure_since == since

    add_node(h100, "n2", 4)
    do_reconcile()
    deployment.refresh_from_db()
    assert (deployment.placement_failure, deployment.placement_failure_since) == ("", None)
    assert deployment.replicas.filter(state="pending").count() == 1


def test_a_changed_reason_keeps_the_since(h100: GpuPool, llama_70b_v1: ModelVersion) -> None:
    deployment = Deployment.objects.create(
        name="d", model_version=llama_70b_v1, pool=h100, tensor_parallel=4
    )
    do_note_canary_placement({deployment.pk: "reconcile's words"})
    deployment.refresh_from_db()
    assert deployment.placement_failure == "pool h100-us-east: no ready, schedulable node"
    since = deployment.placement_failure_since
    add_node(h100, "n1", 2)
    do_note_canary_placement({deployment.pk: "reconcile's words"})
    deployment.refresh_from_db()
    assert (deployment.placement_failure, deployment.placement_failure_since) == (
        "pool h100-us-east: no node has 4 free GPUs; largest free is 2 on node n1",
        since,
    )
    do_note_canary_placement({})
    deployment.refresh_from_db()
    assert (deployment.placement_failure, deployment.placement_failure_since) == ("", None)


def test_a_scaled_up_deployment_waits_for_the_replicas_it_lacks(
    h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 4)
    deployment = do_create_deployment(
        model_version=llama_70b_v1, pool=h100, tensor_parallel=4, replicas_max=2
    )
    do_reconcile()
    assert deployment.replicas.count() == 1
    Deployment.objects.filter(pk=deployment.pk).update(replicas_desired=2)
    do_reconcile()
    deployment.refresh_from_db()
    # Its first replica holds n1's four GPUs: the second has nowhere to go.
    assert deployment.placement_failure == (
        "pool h100-us-east: no node has 4 free GPUs; largest free is 0 on node n1"
    )


def test_when_the_check_sees_room_the_reconciles_words_are_kept(
    h100: GpuPool, llama_70b_v1: ModelVersion
) -> None:
    add_node(h100, "n1", 4)
    deployment = do_create_deployment(model_version=llama_70b_v1, pool=h100, tensor_parallel=4)
    do_note_canary_placement({deployment.pk: "the node went away meanwhile"})
    deployment.refresh_from_db()
    assert deployment.placement_failure == "the node went away meanwhile"
