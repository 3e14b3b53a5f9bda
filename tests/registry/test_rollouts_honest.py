"""Rollouts that cannot lie: a canary with no ready replica is held at 0 % and says why and
since when; a step or a promotion needs a serving canary and a gate verdict; the baseline
drains only once the canary serves."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import redis
from django.test import Client
from django.utils import timezone

from registry.actions import do_create_deployment, do_start_rollout
from registry.models import Deployment, Model, Rollout
from registry.rollout_metrics import DeploymentWindowStats, record_request
from registry.rollout_policy import (
    CanaryReplicas,
    CanaryState,
    GateThresholds,
    Move,
    StepProgress,
    canary_condition,
    decide_step,
)
from registry.tasks import rollout_tick
from serving.actions.reconcile import do_reconcile
from serving.models import Gpu, GpuPool, Node, Replica
from tests.registry import test_rollouts
from tests.registry.conftest import approved_version, client_for
from tests.registry.test_rollouts import ready_replica

# The fixtures of test_rollouts: a rollout just started (its canary has no replica yet) and
# one whose canary serves from a ready replica at the first step.
held_rollout = test_rollouts.held_rollout
rollout = test_rollouts.rollout


def _weights(of: Rollout) -> tuple[int, int]:
    baseline = Deployment.objects.get(pk=of.baseline_id)
    canary = Deployment.objects.get(pk=of.canary_id)
    return baseline.traffic_weight, canary.traffic_weight


def _serve(client: redis.Redis, deployment_id: int, n: int) -> None:
    for i in range(n):
        record_request(
            client,
            deployment_id,
            ok=True,
            ttft_s=0.1 + (i % 7) / 100,
            tpot_s=0.02,
            output_tokens=100 + i % 13,
            finish_reason="stop",
        )


@pytest.fixture
def one_gpu_pool(pools: dict[str, GpuPool]) -> GpuPool:
    """The demo's old A100 pool: one node, one GPU, which the baseline's replica holds."""
    pool = pools["h100"]
    node = Node.objects.create(pool=pool, hostname="h100-1", agent_url="http://h100-1:9100")
    Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="H100", memory_mb=81559)
    return pool


@pytest.fixture
def unplaceable(
    staff: Any, one_gpu_pool: GpuPool, llama_8b: Model, redis_client: redis.Redis
) -> Rollout:
    v1 = approved_version(llama_8b, "v1", "bf16")
    v2 = approved_version(llama_8b, "v2", "bf16")
    baseline = do_create_deployment(name="llama-8b-h100", model_version=v1, pool=one_gpu_pool)
    do_reconcile()  # places the baseline's replica on the pool's only GPU
    Replica.objects.filter(deployment=baseline).update(state=Replica.State.READY, port=18001)
    started = do_start_rollout(
        baseline, v2, actor=staff, step_min_duration_s=0, step_min_requests=20
    )
    do_reconcile()  # finds no room for the canary
    rollout_tick.apply()
    started.refresh_from_db()
    return started


# --- the canary's condition, without a database ------------------------------------------


def test_a_canary_with_a_ready_replica_serves_whatever_else_it_has() -> None:
    state, reason = canary_condition(CanaryReplicas(ready=1, failed=2, placement_failure="x"))
    assert (state, reason) == (CanaryState.SERVING, "1 ready canary replica")


def test_a_canary_with_no_room_says_what_its_pool_lacks() -> None:
    state, reason = canary_condition(CanaryReplicas(placement_failure="needs 1 free GPU"))
    assert (state, reason) == (
        CanaryState.NO_ROOM,
        "no room for a canary replica: needs 1 free GPU",
    )


def test_a_held_canary_holds_even_when_its_step_is_otherwise_done() -> None:
    progress = StepProgress(
        steps=(5, 100),
        step_index=0,
        step_elapsed_s=900,
        step_min_duration_s=0,
        step_min_requests=0,
        canary_held="no canary replica placed yet",
    )
    served = DeploymentWindowStats(requests=500, ttft_p99_s=0.1, tpot_p99_s=0.02)
    decision = decide_step(progress, served, served, GateThresholds())
    assert (decision.move, decision.reason) == (
        Move.HOLD,
        "held at 0 %: no canary replica placed yet",
    )


def test_the_wait_names_the_gate_minimum_beside_the_step_minimum() -> None:
    progress = StepProgress((5, 100), 0, 10, 0, step_min_requests=20)
    decision = decide_step(progress, DeploymentWindowStats(), DeploymentWindowStats())
    assert decision.reason == (
        "waiting: 0 of 20 canary requests, 0 of 50 canary requests before any gate verdict"
    )


# --- the controller -------------------------------------------------------------------------


def test_a_canary_that_cannot_be_placed_holds_at_zero_and_says_why_and_since_when(
    unplaceable: Rollout,
) -> None:
    held = unplaceable
    assert _weights(held) == (100, 0)
    assert (held.state, held.canary_state) == (Rollout.State.RUNNING, "no_room")
    assert held.canary_reason == (
        "no room for a canary replica: needs 1 free GPU on one node; its pool has 0 free on 1 node"
    )
    assert held.canary_since is not None
    assert timezone.now() - held.canary_since < timedelta(seconds=30)
    assert held.last_decision["move"] == "hold"
    assert held.last_decision["reason"].startswith("held at 0 %: no room for a canary replica")


def test_the_hold_keeps_its_since_from_tick_to_tick(unplaceable: Rollout) -> None:
    since = unplaceable.canary_since
    do_reconcile()
    rollout_tick.apply()
    unplaceable.refresh_from_db()
    assert (unplaceable.canary_state, unplaceable.canary_since) == ("no_room", since)
    assert _weights(unplaceable) == (100, 0)


def test_room_in_the_pool_clears_the_reason_and_the_ready_canary_gets_its_step(
    unplaceable: Rollout,
) -> None:
    node = Node.objects.get(hostname="h100-1")
    Gpu.objects.create(node=node, index=1, uuid="GPU-1", name="H100", memory_mb=81559)
    do_reconcile()
    rollout_tick.apply()
    unplaceable.refresh_from_db()
    assert (unplaceable.canary_state, unplaceable.canary_placement_failure) == ("starting", "")
    assert _weights(unplaceable) == (100, 0)

    Replica.objects.filter(deployment=unplaceable.canary).update(
        state=Replica.State.READY, port=18002
    )
    rollout_tick.apply()
    unplaceable.refresh_from_db()
    assert (unplaceable.canary_state, unplaceable.canary_reason) == (
        "serving",
        "1 ready canary replica",
    )
    assert _weights(unplaceable) == (95, 5)
    last = unplaceable.transitions.last()
    assert last is not None
    assert (last.actor_label, last.from_weight, last.to_weight) == ("controller", 0, 5)


def test_a_canary_that_loses_its_replicas_goes_back_to_zero(
    held_rollout: Rollout, redis_client: redis.Redis
) -> None:
    replica = ready_replica(held_rollout.canary)
    rollout_tick.apply()
    assert _weights(held_rollout) == (95, 5)
    Replica.objects.filter(pk=replica.pk).update(state=Replica.State.FAILED, last_error="OOM")
    rollout_tick.apply()
    held_rollout.refresh_from_db()
    assert _weights(held_rollout) == (100, 0)
    assert (held_rollout.canary_state, held_rollout.canary_reason) == (
        "failed",
        "the canary's replicas failed: OOM",
    )


# --- promote and step are refused without a serving canary and a verdict ----------------------


def test_promote_is_refused_over_rest_while_the_canary_has_no_ready_replica(
    unplaceable: Rollout, staff: Any
) -> None:
    before = unplaceable.transitions.count()
    response = client_for(staff).post(f"/api/v1/rollouts/{unplaceable.pk}/promote/")
    assert response.status_code == 400
    assert response.json() == [
        "The canary has no ready replica (no room for a canary replica: needs 1 free GPU on "
        "one node; its pool has 0 free on 1 node); its weight stays at 0 %."
    ]
    unplaceable.refresh_from_db()
    assert (unplaceable.state, _weights(unplaceable)) == (Rollout.State.RUNNING, (100, 0))
    assert unplaceable.transitions.count() == before
    assert Deployment.objects.get(pk=unplaceable.baseline_id).status == "active"


def test_a_step_is_refused_over_rest_before_the_gates_have_a_verdict(
    rollout: Rollout, staff: Any, redis_client: redis.Redis
) -> None:
    _serve(redis_client, rollout.canary_id, 10)
    response = client_for(staff).post(f"/api/v1/rollouts/{rollout.pk}/advance/")
    assert response.status_code == 400
    assert response.json() == [
        "No gate verdict yet: 10 of 40 canary requests in this step; "
        "the gates judge nothing on fewer."
    ]
    assert _weights(rollout) == (95, 5)


def test_the_console_refuses_a_promote_with_a_message_and_changes_nothing(
    unplaceable: Rollout, staff: Any
) -> None:
    browser = Client()
    browser.force_login(staff)
    page = browser.post(f"/console/rollouts/{unplaceable.pk}/promote/", follow=True)
    assert page.status_code == 200
    assert "The canary has no ready replica (no room for a canary replica" in page.text
    assert _weights(unplaceable) == (100, 0)
    assert Rollout.objects.get(pk=unplaceable.pk).state == Rollout.State.RUNNING


def test_the_console_page_shows_the_hold_its_reason_since_when_and_the_gate_minimum(
    unplaceable: Rollout, staff: Any
) -> None:
    browser = Client()
    browser.force_login(staff)
    page = browser.get(f"/console/rollouts/{unplaceable.pk}/").text
    assert "Canary weight held at 0 %" in page
    assert f"since {timezone.localtime(unplaceable.canary_since):%Y-%m-%d %H:%M:%S}" in page
    assert "needs 1 free GPU on one node; its pool has 0 free on 1 node" in page
    assert 'id="rollout-weight">0 %' in page
    assert "No verdict before 50 canary requests in a step (more than the step's 20)" in page


def test_the_start_form_shows_the_gate_minimum(staff: Any) -> None:
    browser = Client()
    browser.force_login(staff)
    page = browser.get("/console/rollouts/").text
    assert "no verdict, so no step and no promotion, before\n    50 canary requests" in page


# --- the baseline drains only once the canary serves -----------------------------------------


def test_the_baseline_is_not_drained_until_the_canary_serves(
    held_rollout: Rollout, staff: Any, redis_client: redis.Redis
) -> None:
    client = client_for(staff)
    assert client.post(f"/api/v1/rollouts/{held_rollout.pk}/promote/").status_code == 400
    assert Deployment.objects.get(pk=held_rollout.baseline_id).status == "active"

    ready_replica(held_rollout.canary)
    rollout_tick.apply()
    _serve(redis_client, held_rollout.baseline_id, 100)
    _serve(redis_client, held_rollout.canary_id, 40)
    response = client.post(f"/api/v1/rollouts/{held_rollout.pk}/promote/")

    assert response.status_code == 200, response.json()
    assert response.json()["state"] == "promoted"
    assert _weights(held_rollout) == (0, 100)
    assert Deployment.objects.get(pk=held_rollout.baseline_id).status == "draining"
