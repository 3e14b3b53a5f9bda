"""Canary gates, the canary's condition and step decisions: plain data in, plain data out,
no Django.

The canary's window (since its current step began) is compared with the baseline's window
(since the rollout began, so the comparison still has a reference once the canary holds 100%).
Latency and error gates catch a broken or slow canary; the quality proxies (output-length
distribution, finish-reason mix, refusal rate) catch one that answers fast but worse, e.g. a
bad quantization that truncates or refuses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from registry.rollout_metrics import DeploymentWindowStats

DEFAULT_STEPS: tuple[int, ...] = (5, 25, 50, 100)


@dataclass(frozen=True, slots=True)
class GateThresholds:
    # No verdict on fewer canary requests than this: a 1-in-10 error is noise, not a signal.
    min_requests: int = 50
    max_error_rate_increase: float = 0.02
    max_ttft_p99_ratio: float = 1.5
    max_tpot_p99_ratio: float = 1.3
    # Latency differences smaller than this never fail a ratio gate (sub-10 ms jitter).
    latency_slack_s: float = 0.010
    # Two-sample KS on output lengths fails when D exceeds both this effect size and the
    # critical value c * sqrt((n + m) / (n * m)); c = 1.95 is alpha = 0.001.
    max_output_length_ks: float = 0.2
    ks_critical_c: float = 1.95
    # Total variation distance between the finish-reason mixes.
    max_finish_reason_shift: float = 0.15
    max_refusal_rate_increase: float = 0.03

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> GateThresholds:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in known})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class GateCheck:
    name: str
    passed: bool
    value: float | None
    limit: float
    detail: str


@dataclass(frozen=True, slots=True)
class GateVerdict:
    """`judged` is False while the canary has too few requests for any verdict."""

    judged: bool
    checks: tuple[GateCheck, ...] = ()
    canary_requests: int = 0
    baseline_requests: int = 0

    @property
    def passed(self) -> bool:
        return self.judged and all(check.passed for check in self.checks)

    @property
    def failures(self) -> tuple[GateCheck, ...]:
        return tuple(check for check in self.checks if not check.passed)

    def summary(self) -> str:
        if not self.judged:
            return f"not judged: {self.canary_requests} canary requests so far"
        if self.passed:
            return f"all gates passed on {self.canary_requests} canary requests"
        return "; ".join(check.detail for check in self.failures)

    def as_dict(self) -> dict[str, Any]:
        return {
            "judged": self.judged,
            "passed": self.passed,
            "canary_requests": self.canary_requests,
            "baseline_requests": self.baseline_requests,
            "checks": [asdict(check) for check in self.checks],
        }


def ks_statistic(a: Mapping[int, int], b: Mapping[int, int]) -> float:
    """Two-sample Kolmogorov-Smirnov D over counts keyed by value (or bucket bound)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    if total_a <= 0 or total_b <= 0:
        return 0.0
    cdf_a = cdf_b = 0.0
    d = 0.0
    for value in sorted(set(a) | set(b)):
        cdf_a += a.get(value, 0) / total_a
        cdf_b += b.get(value, 0) / total_b
        d = max(d, abs(cdf_a - cdf_b))
    return d


def total_variation(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    total_a, total_b = sum(a.values()), sum(b.values())
    if total_a <= 0 or total_b <= 0:
        return 0.0
    return 0.5 * sum(
        abs(a.get(key, 0) / total_a - b.get(key, 0) / total_b) for key in set(a) | set(b)
    )


def _rate_increase_check(
    name: str, canary_rate: float, baseline_rate: float, baseline_judged: bool, limit: float
) -> GateCheck:
    """The canary's rate may exceed the baseline's by at most `limit`; a baseline with too
    few requests to judge counts as 0 %."""
    reference = baseline_rate if baseline_judged else 0.0
    increase = canary_rate - reference
    label = name.replace("_", " ")
    return GateCheck(
        name=name,
        passed=increase <= limit,
        value=increase,
        limit=limit,
        detail=(
            f"{label} {canary_rate:.1%} vs baseline {reference:.1%} "
            f"(+{increase:.1%}, limit +{limit:.1%})"
        ),
    )


def _latency_check(
    name: str, canary_p99: float | None, baseline_p99: float | None, limit: float, slack_s: float
) -> GateCheck:
    if canary_p99 is None or baseline_p99 is None or baseline_p99 <= 0.0:
        return GateCheck(name, True, None, limit, f"{name}: no baseline to compare")
    ratio = canary_p99 / baseline_p99
    slower_by = canary_p99 - baseline_p99
    return GateCheck(
        name=name,
        passed=ratio <= limit or slower_by <= slack_s,
        value=ratio,
        limit=limit,
        detail=(
            f"{name} {canary_p99 * 1000:.0f} ms vs baseline {baseline_p99 * 1000:.0f} ms "
            f"(x{ratio:.2f}, limit x{limit:.2f})"
        ),
    )


def _output_length_check(
    canary: DeploymentWindowStats, baseline: DeploymentWindowStats, t: GateThresholds
) -> GateCheck:
    n, m = sum(canary.output_lengths.values()), sum(baseline.output_lengths.values())
    if n == 0 or m < t.min_requests:
        return GateCheck(
            "output_length_ks", True, None, t.max_output_length_ks, "output length: no baseline"
        )
    d = ks_statistic(canary.output_lengths, baseline.output_lengths)
    critical = t.ks_critical_c * math.sqrt((n + m) / (n * m))
    limit = max(t.max_output_length_ks, critical)
    return GateCheck(
        name="output_length_ks",
        passed=d <= limit,
        value=d,
        limit=limit,
        detail=f"output-length distribution shifted: KS D {d:.2f} (limit {limit:.2f})",
    )


def _finish_reason_check(
    canary: DeploymentWindowStats, baseline: DeploymentWindowStats, t: GateThresholds
) -> GateCheck:
    if baseline.successes < t.min_requests or canary.successes == 0:
        return GateCheck(
            "finish_reason_shift", True, None, t.max_finish_reason_shift, "finish mix: no baseline"
        )
    shift = total_variation(canary.finish_reasons, baseline.finish_reasons)
    mix = ", ".join(
        f"{reason} {count / canary.successes:.0%}"
        for reason, count in sorted(canary.finish_reasons.items())
    )
    return GateCheck(
        name="finish_reason_shift",
        passed=shift <= t.max_finish_reason_shift,
        value=shift,
        limit=t.max_finish_reason_shift,
        detail=f"finish-reason mix shifted by {shift:.2f} (limit {t.max_finish_reason_shift:.2f}; canary {mix})",
    )


def evaluate_gates(
    canary: DeploymentWindowStats,
    baseline: DeploymentWindowStats,
    thresholds: GateThresholds = GateThresholds(),
) -> GateVerdict:
    if canary.requests < thresholds.min_requests:
        return GateVerdict(
            judged=False, canary_requests=canary.requests, baseline_requests=baseline.requests
        )
    checks = (
        _rate_increase_check(
            "error_rate",
            canary.error_rate,
            baseline.error_rate,
            baseline.requests >= thresholds.min_requests,
            thresholds.max_error_rate_increase,
        ),
        _latency_check(
            "TTFT p99",
            canary.ttft_p99_s,
            baseline.ttft_p99_s,
            thresholds.max_ttft_p99_ratio,
            thresholds.latency_slack_s,
        ),
        _latency_check(
            "TPOT p99",
            canary.tpot_p99_s,
            baseline.tpot_p99_s,
            thresholds.max_tpot_p99_ratio,
            thresholds.latency_slack_s,
        ),
        _output_length_check(canary, baseline, thresholds),
        _finish_reason_check(canary, baseline, thresholds),
        _rate_increase_check(
            "refusal_rate",
            canary.refusal_rate,
            baseline.refusal_rate,
            baseline.successes >= thresholds.min_requests,
            thresholds.max_refusal_rate_increase,
        ),
    )
    return GateVerdict(
        judged=True,
        checks=checks,
        canary_requests=canary.requests,
        baseline_requests=baseline.requests,
    )


# --- the canary's condition -------------------------------------------------------------------


class CanaryState(StrEnum):
    """Where the canary's replicas stand. Only SERVING takes traffic: in every other state the
    rollout holds the canary's weight at 0 % (a weight on nothing would be a lie, and the
    gates would wait on requests that can never come)."""

    PLACING = "placing"  # no replica placed yet
    NO_ROOM = "no_room"  # the fleet found no room for one in the canary's pool
    STARTING = "starting"  # placed, none ready yet
    FAILED = "failed"  # its replicas failed and none is coming
    SERVING = "serving"  # at least one ready replica in the routing table


@dataclass(frozen=True, slots=True)
class CanaryReplicas:
    """The canary's replicas as the fleet reports them."""

    ready: int = 0
    starting: int = 0  # pending or starting
    failed: int = 0
    last_error: str = ""
    # The reconcile's latest reason for not placing one ("" when it placed what was asked).
    placement_failure: str = ""


def canary_condition(replicas: CanaryReplicas) -> tuple[CanaryState, str]:
    """The canary's state and the reason shown with it."""
    if replicas.ready:
        plural = "s" if replicas.ready > 1 else ""
        return CanaryState.SERVING, f"{replicas.ready} ready canary replica{plural}"
    if replicas.starting:
        plural = "s" if replicas.starting > 1 else ""
        return (
            CanaryState.STARTING,
            f"{replicas.starting} canary replica{plural} placed, none ready yet",
        )
    if replicas.placement_failure:
        return CanaryState.NO_ROOM, f"no room for a canary replica: {replicas.placement_failure}"
    if replicas.failed:
        error = replicas.last_error or "no error reported"
        return CanaryState.FAILED, f"the canary's replicas failed: {error}"
    return CanaryState.PLACING, "no canary replica placed yet"


# --- step decisions ---------------------------------------------------------------------------


class Move(StrEnum):
    HOLD = "hold"
    ADVANCE = "advance"
    PROMOTE = "promote"
    ROLL_BACK = "roll_back"


@dataclass(frozen=True, slots=True)
class StepProgress:
    steps: Sequence[int]
    step_index: int
    step_elapsed_s: float
    step_min_duration_s: float
    step_min_requests: int
    paused: bool = False
    # Why the canary takes no traffic (its replicas are not serving); None when it serves.
    canary_held: str | None = None


@dataclass(frozen=True, slots=True)
class StepDecision:
    move: Move
    reason: str
    verdict: GateVerdict = field(default_factory=lambda: GateVerdict(judged=False))


def decide_step(
    progress: StepProgress,
    canary: DeploymentWindowStats,
    baseline: DeploymentWindowStats,
    thresholds: GateThresholds = GateThresholds(),
) -> StepDecision:
    """What the controller does this tick. A failed gate rolls back at once, even while
    paused (a pause holds the weights, it does not switch off the safety net)."""
    verdict = evaluate_gates(canary, baseline, thresholds)
    if verdict.judged and not verdict.passed:
        return StepDecision(Move.ROLL_BACK, f"gate failed: {verdict.summary()}", verdict)
    if progress.canary_held is not None:
        return StepDecision(Move.HOLD, f"held at 0 %: {progress.canary_held}", verdict)
    if progress.paused:
        return StepDecision(Move.HOLD, "paused", verdict)
    waiting: list[str] = []
    if progress.step_elapsed_s < progress.step_min_duration_s:
        waiting.append(
            f"{progress.step_elapsed_s:.0f} of {progress.step_min_duration_s:.0f} s at this step"
        )
    if canary.requests < progress.step_min_requests:
        waiting.append(f"{canary.requests} of {progress.step_min_requests} canary requests")
    if not verdict.judged:
        waiting.append(
            f"{canary.requests} of {thresholds.min_requests} canary requests before any gate verdict"
        )
    if waiting:
        return StepDecision(Move.HOLD, "waiting: " + ", ".join(waiting), verdict)
    weight = progress.steps[progress.step_index]
    if progress.step_index >= len(progress.steps) - 1:
        return StepDecision(Move.PROMOTE, f"all steps passed at {weight}%", verdict)
    following = progress.steps[progress.step_index + 1]
    return StepDecision(
        Move.ADVANCE, f"step {weight}% passed; {verdict.summary()}; next {following}%", verdict
    )


def validate_steps(steps: Sequence[int]) -> list[str]:
    """Problems with a step list; empty when it is usable."""
    problems: list[str] = []
    if not steps:
        return ["a rollout needs at least one step"]
    if any(not isinstance(s, int) or s < 1 or s > 100 for s in steps):
        problems.append("each step is a whole percent from 1 to 100")
    if list(steps) != sorted(set(steps)):
        problems.append("steps must strictly increase")
    if steps[-1] != 100:
        problems.append("the last step must be 100")
    return problems


def promotion_refusal(
    state: CanaryState, reason: str, verdict: GateVerdict, thresholds: GateThresholds
) -> str | None:
    """Why the canary may not take more traffic by hand now (a step or a promotion); None when
    it may: it must serve, and the gates must have judged it and passed."""
    if state is not CanaryState.SERVING:
        return f"The canary has no ready replica ({reason}); its weight stays at 0 %."
    if not verdict.judged:
        return (
            f"No gate verdict yet: {verdict.canary_requests} of {thresholds.min_requests} "
            "canary requests in this step; the gates judge nothing on fewer."
        )
    if not verdict.passed:
        return f"The gates failed: {verdict.summary()}."
    return None
