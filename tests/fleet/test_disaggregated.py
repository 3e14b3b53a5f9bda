"""Disaggregated deployments in the fleet: a prefill pool and a decode pool, validated, placed
phase by phase, launched with vLLM's --kv-transfer-config and published with their phase."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from registry.actions import do_create_deployment, do_update_deployment
from registry.models import Deployment, ModelVersion
from serving.actions.reconcile import (
    KV_CONNECTOR_LINKS,
    desired_replica_specs,
    do_reconcile,
    launch_budget,
)
from serving.actions.routing_table import build_routing_table
from serving.agent.launch import LaunchSettings, build_launch_command
from serving.agent.specs import SpecError, parse_replica_spec, with_port
from serving.engine.link import load_link_specs
from serving.enginesim.config import parse_args
from serving.models import GpuPool, Node, Replica

from .conftest import (
    MakeDeployment,
    MakePool,
    Register,
    RegisteredNode,
    replica_report,
    send_heartbeat,
)

pytestmark = pytest.mark.django_db


def _disaggregate(deployment: Deployment, decode_pool: GpuPool, decode: int = 1) -> Deployment:
    return do_update_deployment(
        deployment,
        decode_pool=decode_pool,
        kv_connector="nixl",
        decode_replicas_min=0,
        decode_replicas_max=8,
        decode_replicas_desired=decode,
    )


@pytest.fixture
def nodes(make_pool: MakePool, register: Register) -> list[RegisteredNode]:
    """Prefill on an H100 node, decode on an H200 node: two classes, as the design allows."""
    _, prefill_secret = make_pool("h100-prefill", "H100-SXM-80GB")
    _, decode_secret = make_pool("h200-decode", "H200-SXM-141GB")
    return [
        register(prefill_secret, "h100-1", gpus=4, name="H100-SXM-80GB", memory_mb=81559),
        register(decode_secret, "h200-1", gpus=4, name="H200-SXM-141GB", memory_mb=143771),
    ]


@pytest.fixture
def pools(nodes: list[RegisteredNode]) -> tuple[GpuPool, GpuPool]:
    return GpuPool.objects.get(name="h100-prefill"), GpuPool.objects.get(name="h200-decode")


def _live(deployment: Deployment, phase: str) -> list[Replica]:
    return list(deployment.replicas.filter(phase=phase, state__in=Replica.DESIRED_STATES))


def test_each_phase_is_placed_on_its_own_pool_with_its_own_count(
    pools: tuple[GpuPool, GpuPool], make_deployment: MakeDeployment
) -> None:
    prefill_pool, decode_pool = pools
    deployment = _disaggregate(make_deployment(prefill_pool, replicas=1), decode_pool, decode=3)
    report = do_reconcile()
    prefill, decode = _live(deployment, "prefill"), _live(deployment, "decode")
    assert {r.node.pool_id for r in prefill} == {prefill_pool.pk} and len(prefill) == 1
    assert {r.node.pool_id for r in decode} == {decode_pool.pk} and len(decode) == 3
    assert _live(deployment, "colocated") == []
    assert report.placed == 4
    assert do_reconcile().placed == 0  # level-triggered: nothing more the second time


def test_a_colocated_deployment_made_disaggregated_drains_its_colocated_replicas(
    pools: tuple[GpuPool, GpuPool], make_deployment: MakeDeployment
) -> None:
    prefill_pool, decode_pool = pools
    deployment = make_deployment(prefill_pool, replicas=2)
    do_reconcile()
    assert len(_live(deployment, "colocated")) == 2
    _disaggregate(deployment, decode_pool)
    do_reconcile()
    assert _live(deployment, "colocated") == []
    draining = deployment.replicas.filter(state=Replica.State.DRAINING, phase="colocated")
    assert draining.count() == 2
    assert (len(_live(deployment, "prefill")), len(_live(deployment, "decode"))) == (2, 1)


def test_the_agent_is_told_each_phases_connector_and_launches_vllm_with_it(
    pools: tuple[GpuPool, GpuPool], make_deployment: MakeDeployment
) -> None:
    prefill_pool, decode_pool = pools
    deployment = _disaggregate(make_deployment(prefill_pool), decode_pool)
    do_reconcile()
    by_phase = {}
    for node in Node.objects.all():
        for raw in desired_replica_specs(node):
            phase = Replica.objects.get(pk=raw["replica_id"]).phase
            by_phase[phase] = raw
    assert by_phase["prefill"]["kv_transfer"] == {"connector": "NixlConnector", "role": "kv_both"}
    assert by_phase["decode"]["kv_transfer"] == {"connector": "NixlConnector", "role": "kv_both"}
    spec = with_port(parse_replica_spec(by_phase["decode"]), 18001)
    argv, _ = build_launch_command(spec, LaunchSettings(simulated=False))
    flag = argv.index("--kv-transfer-config")
    assert argv[flag + 1] == '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    assert deployment.replicas.count() == 2
    # Neither phase runs decodes beside prompt chunks: both keep vLLM's own step budget.
    assert by_phase["prefill"]["max_num_batched_tokens"] is None
    assert "--max-num-batched-tokens" not in argv


def test_shared_storage_makes_a_producer_and_a_consumer_on_the_agents_directory(
    make_pool: MakePool, register: Register, make_deployment: MakeDeployment
) -> None:
    pool, secret = make_pool("cpu", "CPU-X86-2C", "local")
    register(secret, "cpu-1", gpus=2, name="CPU", memory_mb=8192)
    deployment = make_deployment(pool, model="llama-3.2-1b")
    # Colocated on a class the engine model does not know (a CPU): vLLM's own budget.
    assert launch_budget(deployment, deployment.effective_engine_args(), "bf16") is None
    do_update_deployment(deployment, decode_pool=pool, kv_connector="shared_storage")
    do_reconcile()
    (node,) = Node.objects.all()
    roles = {}
    for raw in desired_replica_specs(node):
        spec = with_port(parse_replica_spec(raw), 18001)
        argv, _ = build_launch_command(
            spec,
            LaunchSettings(
                simulated=False, device="cpu", cpu_slots=((0,), (1,)), kv_shared_dir="/mnt/kv"
            ),
        )
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        roles[config["kv_role"]] = config
        assert "--max-num-batched-tokens" not in argv  # a disaggregated phase: vLLM's own
    assert set(roles) == {"kv_producer", "kv_consumer"}
    for config in roles.values():
        assert config["kv_connector"] == "ExampleConnector"
        assert config["kv_connector_extra_config"] == {"shared_storage_path": "/mnt/kv"}


def test_the_engine_simulator_takes_the_same_flag(
    pools: tuple[GpuPool, GpuPool], make_deployment: MakeDeployment
) -> None:
    prefill_pool, decode_pool = pools
    _disaggregate(make_deployment(prefill_pool), decode_pool)
    do_reconcile()
    raw = desired_replica_specs(Node.objects.get(hostname="h200-1"))[0]
    spec = with_port(parse_replica_spec(raw), 18001)
    argv, _ = build_launch_command(spec, LaunchSettings(simulated=True))
    config = parse_args(argv[3:])
    assert config is not None
    assert "--kv-transfer-config" in argv
    with pytest.raises(SystemExit):
        parse_args([*argv[3:], "--kv-transfer-config", '{"kv_role": "kv_both"}'])


@pytest.mark.parametrize(
    ("kv_transfer", "message"),
    [
        ({"connector": "LMCacheConnector", "role": "kv_both"}, "is not one of"),
        ({"connector": "NixlConnector", "role": "kv_producer"}, "kv_transfer.role"),
        ("nixl", "must be an object"),
    ],
)
def test_the_agent_refuses_a_kv_transfer_it_cannot_launch(kv_transfer: Any, message: str) -> None:
    raw = {"replica_id": "1", "model": "m", "gpu_indices": [0], "kv_transfer": kv_transfer}
    with pytest.raises(SpecError, match=message):
        parse_replica_spec(raw)


def test_the_routing_table_says_which_phase_each_replica_serves(
    nodes: list[RegisteredNode], pools: tuple[GpuPool, GpuPool], make_deployment: MakeDeployment
) -> None:
    prefill_pool, decode_pool = pools
    deployment = _disaggregate(make_deployment(prefill_pool), decode_pool)
    do_reconcile()
    for node in nodes:
        (replica,) = Replica.objects.filter(node_id=node["node_id"])
        answer = send_heartbeat(
            node, replicas=[replica_report(replica.replica_id, "Ready", port=18001)]
        )
        assert answer.status_code == 200, answer.content
    (route,) = build_routing_table()["models"].values()
    (row,) = route["deployments"]
    assert row["decode_pool"] == decode_pool.name
    phases = {r["phase"]: r["pool"] for r in row["replicas"]}
    assert phases == {"prefill": prefill_pool.name, "decode": decode_pool.name}
    assert deployment.pk == row["deployment_id"]
    # Each phase's end of the hand-over, as the gateway's router predicts the transfer on it.
    links = {r["kv_link"] for r in row["replicas"]}
    assert links == {KV_CONNECTOR_LINKS[deployment.kv_connector]}
    assert links <= set(load_link_specs())


# --- what the registry refuses -------------------------------------------------------------


def _fields(pool: GpuPool, version: ModelVersion, **extra: Any) -> dict[str, Any]:
    return {
        "model_version": version,
        "pool": pool,
        "engine_args": {"max_model_len": 4096},
        **extra,
    }


@pytest.fixture
def version(make_deployment: MakeDeployment, pools: tuple[GpuPool, GpuPool]) -> ModelVersion:
    return make_deployment(pools[0]).model_version


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ({"kv_connector": "nixl"}, "kv_connector", "choose its decode pool too"),
        ({"decode_pool": "decode"}, "kv_connector", "needs a KV connector"),
        (
            {"decode_pool": "decode", "kv_connector": "nixl", "decode_replicas_desired": 5},
            "decode_replicas_desired",
            "Decode replicas must satisfy",
        ),
        ({"decode_pool": "decode", "kv_connector": "rdma"}, "kv_connector", "not a valid choice"),
    ],
)
def test_an_incomplete_disaggregation_is_refused_and_nothing_is_created(
    pools: tuple[GpuPool, GpuPool],
    version: ModelVersion,
    extra: dict[str, Any],
    field: str,
    message: str,
) -> None:
    if extra.get("decode_pool") == "decode":
        extra = {**extra, "decode_pool": pools[1]}
    before = Deployment.objects.count()
    with pytest.raises(ValidationError) as refused:
        do_create_deployment(**_fields(pools[0], version, **extra))
    assert message in " ".join(refused.value.message_dict[field])
    assert Deployment.objects.count() == before


def test_nixl_on_a_cpu_pool_is_refused_naming_the_pool(
    make_pool: MakePool, pools: tuple[GpuPool, GpuPool], version: ModelVersion
) -> None:
    cpu, _ = make_pool("cpu-pool", "CPU-X86-2C", "local")
    with pytest.raises(ValidationError) as refused:
        do_create_deployment(**_fields(pools[0], version, decode_pool=cpu, kv_connector="nixl"))
    assert (
        "cpu-pool runs on CPUs: use shared storage" in refused.value.message_dict["kv_connector"][0]
    )


def test_a_decode_pool_the_model_does_not_fit_is_refused_naming_it(
    make_pool: MakePool, pools: tuple[GpuPool, GpuPool], make_deployment: MakeDeployment
) -> None:
    small, _ = make_pool("l4-decode", "L4-24GB")
    big = make_deployment(pools[0], model="llama-3.1-70b", quantization="bf16", tensor_parallel=4)
    with pytest.raises(ValidationError) as refused:
        do_update_deployment(big, decode_pool=small, kv_connector="nixl")
    (message,) = refused.value.message_dict["placement"]
    assert message.startswith("Decode pool l4-decode:")
    assert Deployment.objects.get(pk=big.pk).decode_pool_id is None
