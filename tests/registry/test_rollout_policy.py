"""Canary gates and step decisions, on plain data: no database."""

from __future__ import annotations

import random

from registry.rollout_metrics import DeploymentWindowStats, InMemoryRolloutMetrics
from registry.rollout_policy import (
    GateThresholds,
    Move,
    StepProgress,
    decide_step,
    evaluate_gates,
    ks_statistic,
    total_variation,
    validate_steps,
)

CANARY, BASELINE = 2, 1


def _traffic(
    source: InMemoryRolloutMetrics,
    deployment_id: int,
    n: int,
    *,
    seed: int,
    error_every: int = 0,
    ttft_scale: float = 1.0,
    tpot_scale: float = 1.0,
    length_scale: float = 1.0,
    length_cap: int | None = None,
    refuse_every: int = 0,
) -> None:
    rng = random.Random(seed)
    for i in range(n):
        failed = error_every > 0 and i % error_every == 0
        tokens = int(rng.lognormvariate(5.0, 0.6) * length_scale)
        finish = "stop"
        if length_cap is not None and tokens >= length_cap:
            tokens, finish = length_cap, "length"
        source.record(
            deployment_id,
            ok=not failed,
            ttft_s=rng.uniform(0.08, 0.20) * ttft_scale,
            tpot_s=rng.uniform(0.015, 0.025) * tpot_scale,
            output_tokens=tokens,
            finish_reason=finish,
            refused=refuse_every > 0 and i % refuse_every == 0,
        )


def _windows(source: InMemoryRolloutMetrics) -> tuple[DeploymentWindowStats, DeploymentWindowStats]:
    start = {"samples": 0}
    return source.window_stats(CANARY, start), source.window_stats(BASELINE, start)


def _gates(**canary_faults: float | int) -> tuple[bool, set[str]]:
    source = InMemoryRolloutMetrics()
    _traffic(source, BASELINE, 1000, seed=1)
    _traffic(source, CANARY, 300, seed=2, **canary_faults)  # type: ignore[arg-type]
    verdict = evaluate_gates(*_windows(source))
    assert verdict.judged
    return verdict.passed, {check.name for check in verdict.failures}


def test_a_canary_like_its_baseline_passes_every_gate() -> None:
    passed, failed = _gates()
    assert passed, failed


def test_a_canary_that_errors_fails_the_error_rate_gate() -> None:
    assert _gates(error_every=10)[1] == {"error_rate"}


def test_a_canary_with_slow_first_tokens_fails_the_ttft_gate() -> None:
    assert "TTFT p99" in _gates(ttft_scale=3.0)[1]


def test_a_canary_with_slow_decoding_fails_the_tpot_gate() -> None:
    assert "TPOT p99" in _gates(tpot_scale=2.0)[1]


def test_a_canary_that_answers_much_shorter_fails_the_output_length_gate() -> None:
    assert "output_length_ks" in _gates(length_scale=0.3)[1]


def test_a_canary_that_truncates_fails_the_finish_reason_gate() -> None:
    assert "finish_reason_shift" in _gates(length_cap=100)[1]


def test_a_canary_that_refuses_more_fails_the_refusal_gate() -> None:
    assert _gates(refuse_every=8)[1] == {"refusal_rate"}


def test_no_verdict_is_given_on_too_few_canary_requests() -> None:
    source = InMemoryRolloutMetrics()
    _traffic(source, BASELINE, 1000, seed=1)
    _traffic(source, CANARY, 10, seed=2, error_every=1)
    verdict = evaluate_gates(*_windows(source), GateThresholds(min_requests=50))
    assert not verdict.judged
    assert not verdict.passed


def test_ks_statistic_is_zero_for_one_distribution_and_one_for_disjoint_ones() -> None:
    same = {10: 5, 20: 5}
    assert ks_statistic(same, {10: 50, 20: 50}) == 0.0
    assert ks_statistic({10: 4}, {20: 7}) == 1.0


def test_total_variation_measures_the_share_that_moved() -> None:
    shift = total_variation({"stop": 90, "length": 10}, {"stop": 60, "length": 40})
    assert abs(shift - 0.30) < 1e-9


def _progress(index: int, *, elapsed: float = 60.0, paused: bool = False) -> StepProgress:
    return StepProgress(
        steps=(5, 25, 50, 100),
        step_index=index,
        step_elapsed_s=elapsed,
        step_min_duration_s=30.0,
        step_min_requests=100,
        paused=paused,
    )


def test_a_healthy_step_advances_and_the_last_one_promotes() -> None:
    source = InMemoryRolloutMetrics()
    _traffic(source, BASELINE, 1000, seed=1)
    _traffic(source, CANARY, 200, seed=2)
    canary, baseline = _windows(source)
    assert decide_step(_progress(0), canary, baseline).move is Move.ADVANCE
    assert decide_step(_progress(3), canary, baseline).move is Move.PROMOTE


def test_a_step_holds_until_its_minimum_duration_has_passed() -> None:
    source = InMemoryRolloutMetrics()
    _traffic(source, BASELINE, 1000, seed=1)
    _traffic(source, CANARY, 200, seed=2)
    decision = decide_step(_progress(1, elapsed=5.0), *_windows(source))
    assert decision.move is Move.HOLD
    assert "5 of 30 s" in decision.reason


def test_a_step_holds_until_its_minimum_requests_have_arrived() -> None:
    source = InMemoryRolloutMetrics()
    _traffic(source, BASELINE, 1000, seed=1)
    _traffic(source, CANARY, 60, seed=2)
    decision = decide_step(_progress(1), *_windows(source))
    assert decision.move is Move.HOLD
    assert "60 of 100 canary requests" in decision.reason


def test_a_failing_gate_rolls_back_even_before_the_step_is_due() -> None:
    source = InMemoryRolloutMetrics()
    _traffic(source, BASELINE, 1000, seed=1)
    _traffic(source, CANARY, 60, seed=2, error_every=4)
    decision = decide_step(_progress(0, elapsed=1.0), *_windows(source))
    assert decision.move is Move.ROLL_BACK
    assert "error rate" in decision.reason


def test_a_paused_rollout_holds_but_still_rolls_back_a_failing_canary() -> None:
    source = InMemoryRolloutMetrics()
    _traffic(source, BASELINE, 1000, seed=1)
    _traffic(source, CANARY, 200, seed=2)
    assert decide_step(_progress(0, paused=True), *_windows(source)).move is Move.HOLD
    _traffic(source, CANARY, 200, seed=3, ttft_scale=4.0)
    assert decide_step(_progress(0, paused=True), *_windows(source)).move is Move.ROLL_BACK


def test_step_lists_must_increase_and_end_at_100() -> None:
    assert validate_steps([5, 25, 50, 100]) == []
    assert validate_steps([50, 25, 100])
    assert validate_steps([5, 25])
    assert validate_steps([0, 100])
