"""The autoscaler policy: how many replicas a deployment should have. Pure, no Django.

Signals, sampled from replica telemetry every few seconds and averaged over a window of
30 to 60 s so one noisy scrape does not move the fleet:
- load: requests running plus waiting per replica, against the concurrency a replica can carry
  within its TPOT objective (`target_running_per_replica`);
- KV use: the mean fraction of KV cache in use, against `kv_target` (above ~0.9 vLLM preempts);
- queue depth: requests waiting; a persistent queue means every replica is full;
- TTFT: the p95 of each request's TTFT as a fraction of its own tier's objective (requests of
  a tier without one are not counted); ignored while replicas are starting, since it is the
  latency of the fleet without them. Each request against its own tier, not every request
  against one objective: a fleet serving several tiers queues the looser tiers' prompts by
  design (a standard prompt may wait 3 s, a batch one has no bound), and read against the
  tightest tier's 1 s that wait orders replicas nothing needs.

    needed  = replicas x max(load / target_running, kv / kv_target, ttft_p95_of_objective)
    desired = ceil(needed x (1 + warm_buffer))

Up is eager: a higher desired count applies at once (capped at `max_step_up_factor` times the
current count per decision, so one bad window cannot order the whole pool). Down is lazy: the
count applied is the highest recommendation of the last `scale_down_stabilization_s` (the
Kubernetes HPA's stabilization window), and only when it is below the current count by more
than the hysteresis band, one `max_step_down` at a time, once per window (every sample in it
taken at one fleet size), and never before recommendations cover the stabilization window.
An optional forecast (the replicas the same time of day needed before, see
`daily_forecast`) is a floor, so capacity is warm before a known peak. The result is
clamped to the deployment's min and max and to what the pool has room for.

A signal that is not the fleet's is turned off with None. The caller runs this once per fleet
of interchangeable replicas: a colocated deployment's, or one phase of a disaggregated one.
Its decode replicas never prefill, so TTFT is not theirs (`ttft_signal=False`); its prefill
replicas hand each prompt's KV to the decode side, so KV held there is the hand-over's backlog,
not prefill capacity (`kv_target=None`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    window_s: float = 45.0
    target_running_per_replica: float = 64.0
    # None: KV use is not this fleet's signal (a disaggregated deployment's prefill replicas).
    kv_target: float | None = 0.75
    # False: TTFT is not this fleet's clock (a disaggregated deployment's decode replicas).
    ttft_signal: bool = True
    warm_buffer: float = 0.125
    scale_down_stabilization_s: float = 300.0
    # Scale down only when the recommendation is below current x (1 - hysteresis).
    hysteresis: float = 0.1
    max_step_up_factor: float = 2.0
    max_step_down: int = 2

    def __post_init__(self) -> None:
        if not 30.0 <= self.window_s <= 60.0:
            raise ValueError("window_s must be between 30 and 60 seconds")
        if not 0.10 <= self.warm_buffer <= 0.15:
            raise ValueError("warm_buffer must be between 0.10 and 0.15")
        if self.target_running_per_replica <= 0:
            raise ValueError("target_running_per_replica must be positive")
        if self.kv_target is not None and not 0 < self.kv_target <= 1:
            raise ValueError("kv_target must be in (0, 1], or None")


@dataclass(frozen=True, slots=True)
class FleetSample:
    """One scrape of a deployment's ready replicas, summed (running, waiting) or averaged."""

    at_s: float
    replicas: int
    running: int
    waiting: int
    kv_usage: float
    # The p95 of each settled request's TTFT over its own tier's TTFT objective (above 1: the
    # objectives are missed); None: too few requests with an objective settled to say.
    ttft_p95_of_objective: float | None = None


@dataclass(frozen=True, slots=True)
class ReplicaBounds:
    minimum: int
    maximum: int
    # Replicas the pool could hold in all (free GPUs // GPUs per replica + current).
    pool_capacity: int | None = None

    def clamp(self, replicas: int) -> int:
        upper = self.maximum
        if self.pool_capacity is not None:
            upper = min(upper, self.pool_capacity)
        return max(self.minimum, min(replicas, max(upper, self.minimum)))


@dataclass(frozen=True, slots=True)
class Recommendation:
    desired: int
    # The unstabilised, unclamped count the signals ask for (kept by the caller for the
    # scale-down stabilization window).
    raw: int
    reason: str
    # The raw count from the signals alone, before any forecast: what the daily history
    # keeps, so that a forecast peak does not forecast itself the next day.
    reactive: int


def needed_replicas(
    samples: Sequence[FleetSample], config: AutoscalerConfig, *, latency: bool = True
) -> tuple[float, str]:
    """Replicas the windowed signals call for, before the warm buffer, and the signal that
    decided it. `latency`: whether the TTFT signal counts (see `recommend`)."""
    replicas = sum(s.replicas for s in samples) / len(samples)
    load = sum(s.running + s.waiting for s in samples) / len(samples)
    kv = sum(s.kv_usage for s in samples) / len(samples)
    candidates = {"load": load / config.target_running_per_replica}
    if config.kv_target is not None:
        candidates["kv"] = replicas * kv / config.kv_target
    ttfts = [s.ttft_p95_of_objective for s in samples if s.ttft_p95_of_objective is not None]
    if latency and config.ttft_signal and ttfts:
        # Latency over its objective means the others underestimate (a prefill-bound fleet
        # shows little KV use): ask for as many more replicas as the SLO is missed by.
        candidates["ttft"] = replicas * sum(ttfts) / len(ttfts)
    reason = max(candidates, key=lambda name: candidates[name])
    return candidates[reason], reason


def recommend(
    samples: Sequence[FleetSample],
    *,
    now_s: float,
    current: int,
    bounds: ReplicaBounds,
    config: AutoscalerConfig,
    recent_raw: Sequence[tuple[float, int]] = (),
    forecast: int | None = None,
    starting: int = 0,
) -> Recommendation:
    """The replica count to set now.

    `samples`: telemetry samples (older ones than the window are ignored). `recent_raw`:
    (time, raw) of earlier recommendations, for the scale-down stabilization window.
    `starting`: replicas ordered but not ready yet (cold starts in progress).
    """
    window = [s for s in samples if now_s - config.window_s <= s.at_s <= now_s]
    if not window:
        return Recommendation(bounds.clamp(current), current, "no telemetry", current)
    # While replicas are still starting, the TTFT seen is that of the fleet without them:
    # scaling on it again would order the same capacity twice (and overshoot to the
    # maximum during every cold start). Load and KV count the work, not the latency.
    needed, reason = needed_replicas(window, config, latency=starting == 0)
    raw = reactive = max(1, math.ceil(needed * (1.0 + config.warm_buffer) - 1e-9))
    if forecast is not None and forecast > raw:
        raw, reason = forecast, "forecast"

    if raw > current:
        cap = max(current + 1, math.ceil(current * config.max_step_up_factor))
        return Recommendation(bounds.clamp(min(raw, cap)), raw, f"up on {reason}", reactive)

    horizon = now_s - config.scale_down_stabilization_s
    stabilized = max([raw, *(r for at, r in recent_raw if at >= horizon)])
    # Lazy: only once recommendations cover (nearly) the whole stabilization window, so a
    # restarted loop with no memory does not shrink the fleet on its first quiet sample.
    covered = any(at <= horizon + config.window_s for at, _ in recent_raw)
    # One step down per window: the signals must all have been taken at one fleet size,
    # since the load a fleet shows depends on its size (fewer replicas, slower requests,
    # more of them running at once) and a window from a larger fleet understates it. (One
    # size, not necessarily `current`: a replica that never becomes ready must not pin the
    # fleet at its size forever.)
    settled = all(sample.replicas == window[-1].replicas for sample in window)
    if (
        covered
        and settled
        and stabilized < current * (1.0 - config.hysteresis)
        and stabilized < current
    ):
        target = max(stabilized, current - config.max_step_down)
        return Recommendation(bounds.clamp(target), raw, f"down on {reason}", reactive)
    return Recommendation(bounds.clamp(current), raw, "hold", reactive)


def daily_forecast(
    history: Sequence[tuple[float, int]],
    *,
    now_s: float,
    period_s: float = 86400.0,
    lead_s: float = 600.0,
    spread_s: float = 900.0,
) -> int | None:
    """Replicas needed at this time of day, from earlier days: the most any earlier period
    needed within `spread_s` of `now + lead_s` (the lead covers a replica's cold start).

    `history`: (time, raw recommendation) pairs. None when no earlier period is known.
    """
    target = now_s + lead_s
    best: int | None = None
    for at, raw in history:
        if at > now_s - period_s / 2:
            continue  # this period's own recent past is what the reactive signals cover
        offset = (target - at) % period_s
        if min(offset, period_s - offset) <= spread_s:
            best = raw if best is None else max(best, raw)
    return best
