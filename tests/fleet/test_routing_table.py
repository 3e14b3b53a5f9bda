"""The routing table: READY replicas only, versioned, published only on change."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis

from registry.models import Deployment
from serving.actions.reconcile import do_reconcile
from serving.actions.routing_table import publish_routing_table, read_routing_table
from serving.models import Replica
from serving.redis_contracts import ROUTING_UPDATES_CHANNEL

from .conftest import MakeDeployment, MakePool, Register, replica_report, send_heartbeat

pytestmark = pytest.mark.django_db

# The deployment, its replica reported Ready and the one still Starting.
Fleet = tuple[Deployment, Replica, Replica]


@pytest.fixture
def fleet(make_pool: MakePool, make_deployment: MakeDeployment, register: Register) -> Fleet:
    pool, secret = make_pool("l4-eu", "L4-24GB", "eu-west")
    node = register(secret, "gpu-1", gpus=2)
    deployment = make_deployment(pool, replicas=2, weight=90)
    do_reconcile()
    ready, starting = deployment.replicas.order_by("pk")
    send_heartbeat(
        node,
        replicas=[
            replica_report(ready.replica_id, "Ready", port=18001),
            replica_report(starting.replica_id, "Starting", port=18002),
        ],
    )
    return deployment, ready, starting


def _table(client: redis.Redis) -> dict[str, Any]:
    table = read_routing_table(client)
    assert table is not None, "no routing table published"
    return table


def test_only_ready_replicas_enter_the_table(fleet: Fleet, redis_client: redis.Redis) -> None:
    _deployment, ready, _ = fleet
    publish_routing_table()
    (entry,) = _table(redis_client)["models"]["llama-3.1-8b"]["deployments"]
    assert [r["replica_id"] for r in entry["replicas"]] == [ready.replica_id]
    assert entry["weight"] == 90


def test_a_replica_row_carries_endpoint_pool_and_price(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    deployment, _ready, _ = fleet
    publish_routing_table()
    row = _table(redis_client)["models"]["llama-3.1-8b"]["deployments"][0]["replicas"][0]
    pool = deployment.pool
    assert row["endpoint"] == "http://gpu-1.local:18001"
    assert (row["pool"], row["region"], row["gpu_class"]) == ("l4-eu", "eu-west", "L4-24GB")
    assert row["price_per_hour"] == pytest.approx(float(pool.price_per_gpu_hour))


def test_a_rows_prefill_budget_is_the_deployments_or_the_platforms_and_the_gateway_plans_with_it(
    make_pool: MakePool,
    make_deployment: MakeDeployment,
    register: Register,
    redis_client: redis.Redis,
) -> None:
    from registry.models import Deployment
    from serving.gateway.routing import build_snapshot

    pool, secret = make_pool("l40s-eu", "L40S-48GB", "eu-west")
    node = register(secret, "gpu-1", gpus=4)
    deployments = {
        "told": make_deployment(pool, max_num_batched_tokens=4096),
        "interactive": make_deployment(pool, version="v2"),
        "standard": make_deployment(pool, version="v3"),
        "batch": make_deployment(pool, version="v4"),
    }
    for tier in ("interactive", "batch"):
        Deployment.objects.filter(pk=deployments[tier].pk).update(slo_tier=tier)
    do_reconcile()
    replicas = {name: d.replicas.get() for name, d in deployments.items()}
    send_heartbeat(
        node,
        replicas=[
            replica_report(r.replica_id, "Ready", port=18001 + i)
            for i, r in enumerate(replicas.values())
        ],
    )
    publish_routing_table()
    table = _table(redis_client)
    rows = {
        str(d["deployment_id"]): d["replicas"][0]
        for d in table["models"]["llama-3.1-8b"]["deployments"]
    }
    launched = {name: rows[str(d.pk)]["max_num_batched_tokens"] for name, d in deployments.items()}
    # The deployment's own; else the largest chunk whose step with a decode batch fits the
    # tier's TPOT on an L40S (50 ms: 512, 100 ms: 1024); a tier without one leaves vLLM's.
    assert launched == {"told": 4096, "interactive": 512, "standard": 1024, "batch": None}
    state = build_snapshot(table).state
    budgets = {}
    for name in deployments:
        replica = state.replica(replicas[name].replica_id)
        assert replica is not None
        budgets[name] = replica.perf.max_num_batched_tokens
    assert budgets == {**launched, "batch": 2048}  # vLLM's own on an L40S


def test_the_version_moves_only_when_the_content_changes(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    first = publish_routing_table()
    again = publish_routing_table()
    Replica.objects.filter(state=Replica.State.READY).update(state=Replica.State.DRAINING)
    changed = publish_routing_table()
    assert (again, changed) == (0, first + 1)
    assert _table(redis_client)["version"] == changed


def test_a_new_version_is_announced_on_the_updates_channel(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    pubsub = redis_client.pubsub()  # unannotated in redis-py
    pubsub.subscribe(ROUTING_UPDATES_CHANNEL)
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    version = publish_routing_table()
    message = pubsub.get_message(timeout=2)
    pubsub.close()
    assert orjson.loads(message["data"]) == version
