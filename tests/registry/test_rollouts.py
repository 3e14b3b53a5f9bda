"""Canary rollouts end to end: requests recorded through the gateway's writer into Redis,
the controller task reading them, the weights and the transition log it leaves."""

from __future__ import annotations

import random
from typing import Any

import pytest
import redis

from registry.actions import do_create_deployment, do_start_rollout
from registry.models import Deployment, Model, Rollout, RolloutTransition
from registry.rollout_metrics import record_request
from registry.tasks import rollout_tick
from serving.models import GpuPool, Node, Replica
from tests.registry.conftest import approved_version, client_for


def ready_replica(deployment: Deployment, state: str = Replica.State.READY) -> Replica:
    """A replica of `deployment` as the fleet reports it once its engine answers."""
    node, _ = Node.objects.get_or_create(
        pool=deployment.pool,
        hostname=f"{deployment.pool.name}-node",
        defaults={"agent_url": "http://gpu-node:9100"},
    )
    return Replica.objects.create(
        deployment=deployment,
        node=node,
        gpu_indices=[Replica.objects.filter(node=node).count()],
        port=18000 + Replica.objects.count(),
        state=state,
    )


@pytest.fixture
def held_rollout(
    staff: Any, pools: dict[str, GpuPool], llama_8b: Model, redis_client: Any
) -> Rollout:
    """Just started: its canary has no replica yet."""
    v1 = approved_version(llama_8b, "v1", "bf16")
    v2 = approved_version(llama_8b, "v2", "bf16")
    baseline = do_create_deployment(name="llama-8b-l4", model_version=v1, pool=pools["l4"])
    ready_replica(baseline)
    return do_start_rollout(
        baseline,
        v2,
        actor=staff,
        step_min_duration_s=0,
        step_min_requests=60,
        gate_thresholds={"min_requests": 40},
    )


@pytest.fixture
def rollout(held_rollout: Rollout) -> Rollout:
    """Its canary serves from one ready replica, and the controller gave it the first step."""
    ready_replica(held_rollout.canary)
    rollout_tick.apply()
    held_rollout.refresh_from_db()
    return held_rollout


def _serve(
    client: redis.Redis,
    deployment_id: int,
    n: int,
    *,
    seed: int,
    error_every: int = 0,
    slowdown: float = 1.0,
) -> None:
    rng = random.Random(seed)
    for i in range(n):
        record_request(
            client,
            deployment_id,
            ok=not (error_every and i % error_every == 0),
            ttft_s=rng.uniform(0.1, 0.3) * slowdown,
            tpot_s=rng.uniform(0.02, 0.03) * slowdown,
            output_tokens=int(rng.lognormvariate(5.0, 0.5)),
            finish_reason="stop",
        )


def _weights(rollout: Rollout) -> tuple[int, int]:
    baseline = Deployment.objects.get(pk=rollout.baseline_id)
    canary = Deployment.objects.get(pk=rollout.canary_id)
    return baseline.traffic_weight, canary.traffic_weight


def test_once_its_canary_serves_a_rollout_sends_the_first_step_to_it(
    rollout: Rollout,
) -> None:
    assert _weights(rollout) == (95, 5)
    assert rollout.canary.model_version.version == "v2"
    assert rollout.canary.pool_id == rollout.baseline.pool_id


def test_a_canary_that_returns_errors_is_rolled_back_within_one_tick(
    rollout: Rollout, redis_client: redis.Redis
) -> None:
    _serve(redis_client, rollout.baseline_id, 500, seed=1)
    _serve(redis_client, rollout.canary_id, 50, seed=2, error_every=5)

    rollout_tick.apply()

    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLED_BACK
    assert _weights(rollout) == (100, 0)
    assert Deployment.objects.get(pk=rollout.canary_id).status == Deployment.Status.DRAINING
    last = rollout.transitions.last()
    assert last is not None
    assert (last.actor_label, last.to_state, last.to_weight) == ("controller", "rolled_back", 0)
    assert "error rate 20.0%" in last.reason
    failed = [check["name"] for check in last.gate["checks"] if not check["passed"]]
    assert failed == ["error_rate"]


def test_a_slow_canary_is_rolled_back_within_one_tick(
    rollout: Rollout, redis_client: redis.Redis
) -> None:
    _serve(redis_client, rollout.baseline_id, 500, seed=1)
    _serve(redis_client, rollout.canary_id, 50, seed=2, slowdown=3.0)

    rollout_tick.apply()

    rollout.refresh_from_db()
    assert rollout.state == Rollout.State.ROLLED_BACK
    assert _weights(rollout) == (100, 0)
    reason = rollout.transitions.last().reason  # type: ignore[union-attr]
    assert "TTFT p99" in reason
    assert "TPOT p99" in reason


def test_a_healthy_canary_walks_every_step_to_100_percent(
    rollout: Rollout, redis_client: redis.Redis
) -> None:
    _serve(redis_client, rollout.baseline_id, 600, seed=1)
    seen = [_weights(rollout)[1]]
    for step in range(len(rollout.steps)):
        rollout_tick.apply()  # not enough canary requests yet: holds
        assert _weights(rollout)[1] == seen[-1]
        _serve(redis_client, rollout.canary_id, 80, seed=10 + step)
        rollout_tick.apply()
        seen.append(_weights(rollout)[1])

    rollout.refresh_from_db()
    assert seen == [5, 25, 50, 100, 100]
    assert rollout.state == Rollout.State.PROMOTED
    assert _weights(rollout) == (0, 100)
    assert Deployment.objects.get(pk=rollout.baseline_id).status == Deployment.Status.DRAINING
    moves = list(rollout.transitions.values_list("to_state", "to_weight", "actor_label"))
    assert moves == [
        ("running", 0, "ops"),
        ("running", 5, "controller"),
        ("running", 25, "controller"),
        ("running", 50, "controller"),
        ("running", 100, "controller"),
        ("promoted", 100, "controller"),
    ]


def test_a_tick_is_idempotent_once_the_rollout_has_finished(
    rollout: Rollout, redis_client: redis.Redis
) -> None:
    _serve(redis_client, rollout.baseline_id, 500, seed=1)
    _serve(redis_client, rollout.canary_id, 50, seed=2, error_every=3)
    rollout_tick.apply()
    rollout_tick.apply()
    assert RolloutTransition.objects.filter(rollout=rollout).count() == 3
    assert _weights(rollout) == (100, 0)


def test_a_step_does_not_advance_before_its_minimum_duration(
    rollout: Rollout, redis_client: redis.Redis
) -> None:
    Rollout.objects.filter(pk=rollout.pk).update(step_min_duration_s=3600)
    _serve(redis_client, rollout.baseline_id, 500, seed=1)
    _serve(redis_client, rollout.canary_id, 200, seed=2)
    rollout_tick.apply()
    rollout.refresh_from_db()
    assert _weights(rollout) == (95, 5)
    assert "of 3600 s" in rollout.last_decision["reason"]


def test_staff_pause_holds_the_weights_and_resume_continues(
    rollout: Rollout, staff: Any, redis_client: redis.Redis
) -> None:
    client = client_for(staff)
    assert client.post(f"/api/v1/rollouts/{rollout.pk}/pause/", {"reason": "look"}).json()[
        "state"
    ] == ("paused")
    _serve(redis_client, rollout.baseline_id, 500, seed=1)
    _serve(redis_client, rollout.canary_id, 100, seed=2)
    rollout_tick.apply()
    assert _weights(rollout) == (95, 5)

    client.post(f"/api/v1/rollouts/{rollout.pk}/resume/")
    _serve(redis_client, rollout.canary_id, 100, seed=3)
    rollout_tick.apply()
    assert _weights(rollout) == (75, 25)


def test_staff_can_promote_now_and_the_actor_is_recorded(
    rollout: Rollout, staff: Any, redis_client: redis.Redis
) -> None:
    _serve(redis_client, rollout.baseline_id, 100, seed=1)
    _serve(redis_client, rollout.canary_id, 40, seed=2)
    response = client_for(staff).post(
        f"/api/v1/rollouts/{rollout.pk}/promote/", {"reason": "urgent fix"}
    )
    assert response.status_code == 200
    assert response.json()["state"] == "promoted"
    assert _weights(rollout) == (0, 100)
    last = rollout.transitions.last()
    assert (last.actor_label, last.reason) == ("ops", "urgent fix")  # type: ignore[union-attr]


def test_staff_abort_sends_all_traffic_back_to_the_baseline(rollout: Rollout, staff: Any) -> None:
    response = client_for(staff).post(f"/api/v1/rollouts/{rollout.pk}/abort/")
    assert response.json()["state"] == "aborted"
    assert _weights(rollout) == (100, 0)


def test_a_tenant_member_can_neither_see_nor_move_a_rollout(
    rollout: Rollout, acme_user: Any
) -> None:
    client = client_for(acme_user)
    assert client.get(f"/api/v1/rollouts/{rollout.pk}/").status_code == 404
    assert client.get("/api/v1/rollouts/").json()["results"] == []
    assert client.post(f"/api/v1/rollouts/{rollout.pk}/promote/").status_code == 403
    assert _weights(rollout) == (95, 5)


def test_staff_start_a_rollout_over_rest_with_cohort_mode(
    staff: Any, pools: dict[str, GpuPool], llama_8b: Model, redis_client: redis.Redis
) -> None:
    v1 = approved_version(llama_8b, "v1", "bf16")
    v2 = approved_version(llama_8b, "v2", "bf16")
    baseline = do_create_deployment(name="llama-8b-l4", model_version=v1, pool=pools["l4"])
    response = client_for(staff).post(
        "/api/v1/rollouts/",
        {
            "baseline": baseline.pk,
            "target_version": v2.pk,
            "steps": [10, 100],
            "cohort_by_tenant": True,
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["canary_weight"], body["step_weight"], body["cohort_by_tenant"]) == (0, 10, True)
    assert (body["state"], body["canary_state"], body["canary_held"]) == (
        "running",
        "placing",
        True,
    )


def test_a_second_live_rollout_of_the_same_model_is_refused(rollout: Rollout, staff: Any) -> None:
    v3 = approved_version(rollout.model, "v3", "bf16")
    response = client_for(staff).post(
        "/api/v1/rollouts/",
        {"baseline": rollout.baseline_id, "target_version": v3.pk},
        format="json",
    )
    assert response.status_code == 400


def test_every_tick_notes_its_decision_on_the_rollout_a_hold_included(
    held_rollout: Rollout, staff: Any, redis_client: redis.Redis
) -> None:
    rollout = held_rollout
    ready_replica(rollout.canary)
    assert (rollout.last_tick_at, rollout.last_decision) == (None, {})
    rollout_tick.apply()  # the canary serves now, but has no requests yet: holds
    rollout.refresh_from_db()
    assert rollout.last_tick_at is not None
    assert rollout.last_decision["move"] == "hold"
    assert rollout.last_decision["gate"]["judged"] is False
    assert (rollout.state, _weights(rollout)) == (Rollout.State.RUNNING, (95, 5))
    # Start and release are transitions; the hold on the gates is a note.
    assert rollout.transitions.count() == 2
    shown = client_for(staff).get(f"/api/v1/rollouts/{rollout.pk}/").json()
    assert shown["last_decision"] == rollout.last_decision
