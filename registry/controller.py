"""The rollout controller: read each live rollout's windows, decide, act through actions.py
(every write, the note of its decision included, is a `do_*` call).

First the canary's replicas: a canary with no ready replica (none placed, no room in its pool,
starting, failed) is held at 0 % with its state, reason and since when noted on the rollout,
and is given its step's weight again once one is ready. Then the gates, as before; a failed
gate still rolls back a held canary (what it served before it lost its replicas counts).

Level-triggered and idempotent: a tick reads the rollout's state and the metrics now, so
running it twice, late, or after a crash does no harm. Each rollout is decided under a row
lock taken with SKIP LOCKED, so overlapping ticks never double-step one rollout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from django.db import transaction
from django.utils import timezone

from config.loops import LoopPass
from config.redis import redis_client
from registry.actions import (
    default_metrics_source,
    do_advance_rollout_step,
    do_hold_rollout,
    do_note_canary_state,
    do_promote_rollout,
    do_record_rollout_decision,
    do_release_rollout,
    do_rollback_rollout,
    observe_canary,
)
from registry.models import Rollout
from registry.rollout_metrics import RolloutMetricsSource
from registry.rollout_policy import (
    CanaryState,
    GateThresholds,
    Move,
    StepDecision,
    StepProgress,
    canary_condition,
    decide_step,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TickOutcome:
    rollout_id: int
    move: Move
    reason: str


def run_rollout_tick(metrics: RolloutMetricsSource | None = None) -> list[TickOutcome]:
    metrics = metrics or default_metrics_source()
    live = Rollout.objects.filter(state__in=Rollout.LIVE_STATES).values_list("pk", flat=True)
    outcomes: list[TickOutcome] = []
    # Any other error is that rollout's alone: logged and shown on it (config.loops).
    this_pass = LoopPass("rollout_tick", "rollout")
    for rollout_id in list(live):
        with this_pass.item(rollout_id):
            try:
                outcome = tick_rollout(rollout_id, metrics)
            except (redis.ConnectionError, redis.TimeoutError):
                # No figures is no evidence either way: hold, and try again next tick. (Any
                # other Redis error, a key of the wrong type, is this rollout's failure.)
                logger.warning("rollout %s: metrics unreadable, holding", rollout_id, exc_info=True)
                this_pass.leave_as_was(rollout_id)
                continue
            if outcome is None:
                this_pass.leave_as_was(rollout_id)  # another tick holds it, or it finished
            else:
                outcomes.append(outcome)
    this_pass.record(redis_client())
    return outcomes


def tick_rollout(rollout_id: int, metrics: RolloutMetricsSource) -> TickOutcome | None:
    with transaction.atomic():
        rollout = (
            Rollout.objects.select_for_update(of=("self",), skip_locked=True)
            .filter(pk=rollout_id, state__in=Rollout.LIVE_STATES)
            .first()
        )
        if rollout is None:
            return None  # finished meanwhile, or another tick holds it
        held = _follow_canary(rollout, metrics)
        decision = _decide(rollout, metrics, held)
        _act(rollout, decision, metrics)
        return TickOutcome(rollout.pk, decision.move, decision.reason)


def _follow_canary(rollout: Rollout, metrics: RolloutMetricsSource) -> str | None:
    """Note the canary's state; hold it at 0 % when it does not serve, give a running one its
    step's weight back when it does. Why it is held, or None when it serves."""
    state, reason = canary_condition(observe_canary(rollout))
    do_note_canary_state(rollout, state, reason)
    if state is not CanaryState.SERVING:
        do_hold_rollout(rollout, reason=reason)
        return reason
    if rollout.state == Rollout.State.RUNNING:
        released = do_release_rollout(rollout, reason=reason, metrics=metrics)
        rollout.step_started_at, rollout.canary_mark = (
            released.step_started_at,
            released.canary_mark,
        )
    return None


def _decide(rollout: Rollout, metrics: RolloutMetricsSource, held: str | None) -> StepDecision:
    now = timezone.now()
    progress = StepProgress(
        steps=tuple(rollout.steps),
        step_index=rollout.step_index,
        step_elapsed_s=(now - rollout.step_started_at).total_seconds(),
        step_min_duration_s=float(rollout.step_min_duration_s),
        step_min_requests=rollout.step_min_requests,
        paused=rollout.state == Rollout.State.PAUSED,
        canary_held=held,
    )
    canary = metrics.window_stats(rollout.canary_id, rollout.canary_mark)
    baseline = metrics.window_stats(rollout.baseline_id, rollout.baseline_mark)
    return decide_step(
        progress, canary, baseline, GateThresholds.from_dict(rollout.gate_thresholds)
    )


def _act(rollout: Rollout, decision: StepDecision, metrics: RolloutMetricsSource) -> None:
    gate = decision.verdict.as_dict()
    if decision.move is Move.ROLL_BACK:
        do_rollback_rollout(rollout, actor=None, reason=decision.reason, gate=gate)
    elif decision.move is Move.ADVANCE:
        do_advance_rollout_step(
            rollout, actor=None, reason=decision.reason, gate=gate, metrics=metrics
        )
    elif decision.move is Move.PROMOTE:
        do_promote_rollout(rollout, actor=None, reason=decision.reason, gate=gate, metrics=metrics)
    do_record_rollout_decision(rollout, move=decision.move.value, reason=decision.reason, gate=gate)
