"""A model served from several pools rolls out pool by pool.

Each rollout moves its baseline's own share of the model's traffic weight to a canary on the
baseline's pool; the other pools' deployments keep their weights until a rollout of their
own. With one deployment the share is 100 and the weights are the steps themselves.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from django.test import Client

from registry.actions import do_create_deployment, do_promote_rollout, do_start_rollout
from registry.models import Deployment, Rollout
from registry.tasks import rollout_tick
from serving.actions.routing_table import publish_routing_table, read_routing_table
from serving.models import GpuPool
from tests.registry.conftest import approved_version, make_model
from tests.registry.test_rollouts import ready_replica
from tests.registry.test_rollouts_honest import _serve


def _weights(*deployments: Deployment) -> list[int]:
    return [Deployment.objects.get(pk=d.pk).traffic_weight for d in deployments]


def _version_weights(client: redis.Redis, model: str) -> dict[str, int]:
    """What the gateway splits the model's traffic by: each version's summed weight."""
    publish_routing_table()
    table = read_routing_table(client) or {"models": {}}
    weights: dict[str, int] = {}
    for deployment in table["models"][model]["deployments"]:
        version = deployment["version"]
        weights[version] = weights.get(version, 0) + deployment["weight"]
    return weights


@pytest.fixture
def two_pools(pools: dict[str, GpuPool]) -> tuple[Deployment, Deployment]:
    model = make_model("llama-3.1-8b")
    v1 = approved_version(model, "v1", "bf16")
    approved_version(model, "v2", "bf16")
    on_h100 = do_create_deployment(name="llama-h100", model_version=v1, pool=pools["h100"])
    on_h200 = do_create_deployment(name="llama-h200", model_version=v1, pool=pools["h200"])
    for deployment in (on_h100, on_h200):
        ready_replica(deployment)
    return on_h100, on_h200


def _roll_out(baseline: Deployment, staff: Any, client: redis.Redis) -> Rollout:
    v2 = baseline.model_version.model.versions.get(version="v2")
    rollout = do_start_rollout(
        baseline, v2, actor=staff, steps=[50, 100], step_min_duration_s=0, step_min_requests=0
    )
    ready_replica(rollout.canary)
    rollout_tick.apply()
    rollout.refresh_from_db()
    _serve(client, rollout.baseline_id, 60)
    _serve(client, rollout.canary_id, 60)
    return rollout


def test_a_model_on_two_pools_rolls_out_one_pool_at_a_time(
    two_pools: tuple[Deployment, Deployment], staff: Any, redis_client: redis.Redis
) -> None:
    on_h100, on_h200 = two_pools
    assert _weights(on_h100, on_h200) == [100, 100]

    first = _roll_out(on_h100, staff, redis_client)
    assert first.canary.pool == on_h100.pool
    # Half of the H100 deployment's share: a quarter of the model's traffic goes to v2.
    assert _weights(on_h100, first.canary, on_h200) == [50, 50, 100]
    assert _version_weights(redis_client, "llama-3.1-8b") == {"v1": 150, "v2": 50}
    browser = Client()
    browser.force_login(staff)
    page = browser.get(f"/console/rollouts/{first.pk}/").content.decode()
    assert 'id="rollout-weight">25 %' in page  # of the model's traffic, not of the weights

    do_promote_rollout(first, actor=staff, reason="pool h100 done")
    assert _weights(on_h100, first.canary, on_h200) == [0, 100, 100]
    assert Deployment.objects.get(pk=on_h100.pk).status == Deployment.Status.DRAINING

    # The H200 pool next, while v2 already serves on the H100 pool.
    second = _roll_out(on_h200, staff, redis_client)
    assert _weights(first.canary, on_h200, second.canary) == [100, 50, 50]
    do_promote_rollout(second, actor=staff, reason="pool h200 done")
    assert _version_weights(redis_client, "llama-3.1-8b") == {"v2": 200}


def test_a_second_pool_waits_for_the_first_pools_rollout(
    two_pools: tuple[Deployment, Deployment], staff: Any, redis_client: redis.Redis
) -> None:
    from django.core.exceptions import ValidationError

    on_h100, on_h200 = two_pools
    _roll_out(on_h100, staff, redis_client)
    v2 = on_h200.model_version.model.versions.get(version="v2")
    with pytest.raises(ValidationError, match="already has a live rollout"):
        do_start_rollout(on_h200, v2, actor=staff)
    assert _weights(on_h200) == [100]
