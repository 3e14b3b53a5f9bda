"""The agents' API: registration with a join token, heartbeats with the node token."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from django.test import Client

from serving import telemetry
from serving.actions.reconcile import do_reconcile
from serving.agent.launch import LaunchSettings, build_launch_command
from serving.agent.specs import parse_replica_spec
from serving.enginesim import parse_args as parse_simulator_args
from serving.models import Gpu, Node, Replica, ReplicaEvent, TelemetrySample

from .conftest import MakeDeployment, MakePool, Register, replica_report, send_heartbeat

SIMULATED = LaunchSettings(simulated=True, python="/venv/bin/python", host="127.0.0.1")

pytestmark = pytest.mark.django_db


def test_registration_yields_a_node_token_that_authenticates_heartbeats(
    make_pool: MakePool, register: Register
) -> None:
    _, secret = make_pool()
    node = register(secret, "gpu-1", gpus=2)
    assert node["heartbeat_interval_s"] == 2
    assert send_heartbeat(node).status_code == 200
    assert Gpu.objects.filter(node_id=node["node_id"]).count() == 2


def test_the_node_token_is_stored_only_as_a_hash(make_pool: MakePool, register: Register) -> None:
    _, secret = make_pool()
    node = register(secret, "gpu-1")
    row = Node.objects.get(pk=node["node_id"])
    assert node["node_token"] not in (row.token_hash, row.token_nonce)
    assert len(row.token_hash) == 64


def test_an_unknown_join_token_is_refused(make_pool: MakePool) -> None:
    make_pool()
    response = Client().post(
        "/api/agent/v1/register",
        {"join_token": "jt_wrong", "hostname": "h", "agent_url": "http://h:1", "gpus": []},
        content_type="application/json",
    )
    assert response.status_code == 401


def test_a_heartbeat_with_a_wrong_token_is_refused(make_pool: MakePool, register: Register) -> None:
    _, secret = make_pool()
    node = register(secret, "gpu-1")
    assert send_heartbeat(node | {"node_token": "nt_forged"}).status_code == 401


def post_registration(secret: str, hostname: str, **extra: Any) -> Any:
    return Client().post(
        "/api/agent/v1/register",
        {
            "join_token": secret,
            "hostname": hostname,
            "agent_url": "http://attacker:9100",
            "gpus": [],
            **extra,
        },
        content_type="application/json",
    )


def test_the_join_token_alone_cannot_take_over_a_registered_node(
    make_pool: MakePool, register: Register
) -> None:
    _, secret = make_pool()
    first = register(secret, "gpu-1")
    refused = post_registration(secret, "gpu-1")
    assert refused.status_code == 409
    assert "already registered" in refused.json()["error"]
    assert send_heartbeat(first).status_code == 200  # the real node's token still works
    assert Node.objects.get(pk=first["node_id"]).agent_url == "http://gpu-1.local:9100"
    wrong = post_registration(secret, "gpu-1", node_token="nt_" + "0" * 64)
    assert wrong.status_code == 409


def test_a_node_re_registers_with_its_own_token_and_the_old_token_is_revoked(
    make_pool: MakePool, register: Register
) -> None:
    _, secret = make_pool()
    first = register(secret, "gpu-1")
    again = post_registration(secret, "gpu-1", node_token=first["node_token"])
    assert again.status_code == 200 and again.json()["node_id"] == first["node_id"]
    assert send_heartbeat(first).status_code == 401
    assert send_heartbeat({**first, "node_token": again.json()["node_token"]}).status_code == 200


def test_after_staff_release_the_join_token_registers_the_node_again(
    make_pool: MakePool, register: Register
) -> None:
    from serving.actions.nodes import do_release_node

    _, secret = make_pool()
    first = register(secret, "gpu-1")
    do_release_node(Node.objects.get(pk=first["node_id"]))
    assert send_heartbeat(first).status_code == 401  # the released token is revoked
    again = post_registration(secret, "gpu-1")
    assert again.status_code == 200 and again.json()["node_id"] == first["node_id"]


def test_the_heartbeat_answers_with_the_nodes_desired_replicas(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=2)
    make_deployment(pool, replicas=2)
    do_reconcile()
    desired = send_heartbeat(node).json()["desired_replicas"]
    assert sorted(tuple(spec["gpu_indices"]) for spec in desired) == [(0,), (1,)]
    assert {spec["served_model_name"] for spec in desired} == {"llama-3.1-8b"}
    assert desired[0]["sim"]["gpu_class"] == "L4-24GB"
    assert desired[0]["sim"]["extra_args"] == []  # simulated answers run to max_tokens


def test_a_report_of_a_replica_id_that_is_not_ascii_digits_is_passed_over(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    """int() read a fullwidth "２" as replica 2, whose report was then looked up under "2":
    a KeyError, a 500, and the whole heartbeat lost."""
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=1)
    deployment = make_deployment(pool, replicas=1)
    do_reconcile()
    (replica,) = deployment.replicas.all()
    before = replica.state
    odd = "".join(chr(ord("０") + int(d)) for d in str(replica.pk))
    reply = send_heartbeat(
        node,
        replicas=[replica_report(odd, "Failed")],
        events=[{"replica_id": odd, "kind": "crashed", "message": "x", "at": 1_700_000_000.0}],
    )
    assert reply.status_code == 200, reply.content
    replica.refresh_from_db()
    assert replica.state == before
    assert not replica.events.filter(kind="crashed").exists()


def test_with_stop_at_eos_set_simulated_replicas_are_told_to_stop_at_eos(
    make_pool: MakePool,
    make_deployment: MakeDeployment,
    register: Register,
    settings: Any,
) -> None:
    settings.SERVING_SIM_STOP_AT_EOS = True  # what `make run` sets for the demo
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=1)
    make_deployment(pool, replicas=1)
    do_reconcile()
    [desired] = send_heartbeat(node).json()["desired_replicas"]
    assert desired["sim"]["extra_args"] == ["--sim-stop-at-eos"]
    argv, _ = build_launch_command(parse_replica_spec({**desired, "port": 8001}), SIMULATED)
    assert parse_simulator_args(argv[3:]).stop_at_eos


def test_reported_states_are_recorded_with_an_event(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=1)
    make_deployment(pool)
    do_reconcile()
    replica = Replica.objects.get()
    send_heartbeat(node, replicas=[replica_report(replica.replica_id, "Ready", port=18123)])
    replica.refresh_from_db()
    assert (replica.state, replica.port) == (Replica.State.READY, 18123)
    assert replica.events.filter(kind="state_ready").exists()


def test_replayed_events_are_recorded_once(
    make_pool: MakePool, make_deployment: MakeDeployment, register: Register
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=1)
    make_deployment(pool)
    do_reconcile()
    replica = Replica.objects.get()
    crash = {
        "replica_id": replica.replica_id,
        "kind": "crashed",
        "message": "exit 1",
        "at": 1_700_000_100.5,
    }
    send_heartbeat(node, events=[crash])
    send_heartbeat(node, events=[crash])
    assert ReplicaEvent.objects.filter(replica=replica, kind="crashed").count() == 1


def _telemetry(running: int, waiting: int, kv: float) -> dict[str, Any]:
    return {
        "num_requests_running": running,
        "num_requests_waiting": waiting,
        "kv_cache_usage_perc": kv,
        "prompt_tokens_total": 100,
        "generation_tokens_total": 50,
        "running_lora_adapters": ["sql-lora"],
        "scraped_at": 1_700_000_200.0,
    }


def test_telemetry_lands_in_redis_for_the_gateway(
    make_pool: MakePool,
    make_deployment: MakeDeployment,
    register: Register,
    redis_client: redis.Redis,
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=1)
    make_deployment(pool)
    do_reconcile()
    replica = Replica.objects.get()
    report = replica_report(replica.replica_id, telemetry=_telemetry(3, 2, 0.41))
    send_heartbeat(node, replicas=[report])
    compact = telemetry.read_routing_telemetry(redis_client)[replica.replica_id]
    assert compact == {
        "running": 3,
        "waiting": 2,
        "kv": 0.41,
        "loras": ["sql-lora"],
        "scraped_at": 1_700_000_200.0,
    }
    assert redis_client.ttl(telemetry.replica_key(replica.replica_id)) > 0


def test_history_is_sampled_once_per_interval_however_many_heartbeats(
    make_pool: MakePool,
    make_deployment: MakeDeployment,
    register: Register,
    redis_client: redis.Redis,
) -> None:
    pool, secret = make_pool()
    node = register(secret, "gpu-1", gpus=1)
    make_deployment(pool)
    do_reconcile()
    replica = Replica.objects.get()
    for running in (1, 2, 3):
        send_heartbeat(
            node,
            replicas=[replica_report(replica.replica_id, telemetry=_telemetry(running, 0, 0.1))],
        )
    samples = TelemetrySample.objects.filter(replica=replica)
    assert [s.running for s in samples] == [1]
