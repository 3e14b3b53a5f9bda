"""Live per-deployment figures the rollout controller compares: the interface and its sources.

The gateway records one request at settle with `add_request`, inside the settle's own Redis
pipeline (`record_request` does the same alone, with a sync client). The controller reads a window with `window_stats(deployment_id, since)`, where
`since` is a *mark*: a snapshot of the deployment's counters taken with `mark()` when the
window opened (a step started, a rollout started). A window is "counters now minus counters
then", so it is exact whatever the tick timing, costs one HGETALL per deployment, and needs
no clock agreement between gateways and the controller.

Redis layout (one hash per deployment, refreshed TTL `STATS_TTL_S` on each write):

    key   registry:rollout:stats:{deployment_id}
    field requests           every settled request
          errors             requests that failed (upstream error, broken stream, timeout)
          refusals           successful requests whose output the gateway judged a refusal
          finish:{reason}    successful requests by finish reason (stop, length, ...)
          len:{upper}        successful requests by output tokens, bucket upper bound in tokens
          ttft:{k}           time to first token, bucket k covers (2^((k-1)/8), 2^(k/8)] ms
          ttft_slo:{k}       time to first token over its tier's TTFT objective, in the same
                             buckets, the ratio read as seconds (1.0, the objective, falls in
                             the 1 s bucket); requests of a tier without one record none (the
                             autoscaler's signal)
          tpot:{k}           time per output token, same buckets

This module imports nothing from Django: the gateway imports it on the hot path.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from serving.redis_contracts import text as redis_text

STATS_KEY = "registry:rollout:stats:{deployment_id}"
STATS_TTL_S = 7 * 24 * 3600
# The histogram of TTFT over the request's tier's objective (the autoscaler's TTFT signal).
TTFT_OVER_OBJECTIVE = "ttft_slo"

# Eight latency buckets per doubling: a p99 read from them is within ~4.5% of the true one,
# fine enough for ratio gates of 1.3x and more.
LATENCY_BUCKETS_PER_DOUBLING = 8
LATENCY_MAX_BUCKET = 8 * 18  # 2^18 ms, about 4.4 minutes; slower lands in the last bucket

# Output lengths: exact up to 16 tokens, then four buckets per doubling up to 128K tokens.
OUTPUT_LENGTH_EDGES: tuple[int, ...] = tuple(
    sorted({*range(1, 17), *(round(2 ** (k / 4)) for k in range(16, 69))})
)

WindowMark = dict[str, int]


@dataclass(frozen=True, slots=True)
class DeploymentWindowStats:
    """What one deployment served in a window."""

    requests: int = 0
    errors: int = 0
    refusals: int = 0
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    # Output tokens -> count of successful requests. Keys are bucket upper bounds (Redis) or
    # exact lengths (in-memory); the KS statistic works on either.
    output_lengths: Mapping[int, int] = field(default_factory=dict)
    finish_reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def successes(self) -> int:
        return self.requests - self.errors

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def refusal_rate(self) -> float:
        return self.refusals / self.successes if self.successes else 0.0


class RolloutMetricsSource(Protocol):
    def mark(self, deployment_id: int) -> WindowMark:
        """A snapshot to pass as `since` later; JSON-serialisable."""
        ...

    def window_stats(self, deployment_id: int, since: WindowMark) -> DeploymentWindowStats: ...


# --- bucketing --------------------------------------------------------------------------------


def latency_bucket(seconds: float) -> int:
    ms = max(seconds * 1000.0, 1e-3)
    k = math.ceil(LATENCY_BUCKETS_PER_DOUBLING * math.log2(ms))
    return min(max(k, 0), LATENCY_MAX_BUCKET)


def latency_bucket_upper_s(k: int) -> float:
    return 2 ** (k / LATENCY_BUCKETS_PER_DOUBLING) / 1000.0


def output_length_bucket(tokens: int) -> int:
    index = bisect.bisect_left(OUTPUT_LENGTH_EDGES, max(tokens, 0))
    return OUTPUT_LENGTH_EDGES[min(index, len(OUTPUT_LENGTH_EDGES) - 1)]


def quantile_from_buckets(counts: Mapping[int, int], q: float) -> float | None:
    """The q-quantile of a latency histogram, interpolated geometrically inside its bucket."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for k in sorted(counts):
        count = counts[k]
        if count <= 0:
            continue
        if seen + count >= rank:
            fraction = (rank - seen) / count
            lower = latency_bucket_upper_s(k - 1) if k > 0 else 0.0
            upper = latency_bucket_upper_s(k)
            if lower <= 0.0:
                return upper * fraction
            return float(lower * (upper / lower) ** fraction)
        seen += count
    return latency_bucket_upper_s(max(counts))


def exact_quantile(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


# --- the Redis source the gateway writes and the controller reads ------------------------------


def request_fields(
    *,
    ok: bool,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    output_tokens: int = 0,
    finish_reason: str | None = None,
    refused: bool = False,
    ttft_objective_s: float | None = None,
) -> dict[str, int]:
    """The hash increments that record one settled request. `ttft_objective_s`: its tier's
    TTFT objective, None where the tier has none."""
    fields: dict[str, int] = {"requests": 1}
    if ttft_s is not None:
        fields[f"ttft:{latency_bucket(ttft_s)}"] = 1
        if ttft_objective_s:
            fields[f"{TTFT_OVER_OBJECTIVE}:{latency_bucket(ttft_s / ttft_objective_s)}"] = 1
    if tpot_s is not None:
        fields[f"tpot:{latency_bucket(tpot_s)}"] = 1
    if not ok:
        fields["errors"] = 1
        return fields
    fields[f"len:{output_length_bucket(output_tokens)}"] = 1
    fields[f"finish:{finish_reason or 'unknown'}"] = 1
    if refused:
        fields["refusals"] = 1
    return fields


def stats_key(deployment_id: int | str) -> str:
    return STATS_KEY.format(deployment_id=deployment_id)


def add_request(pipe: Any, deployment_id: int | str, **outcome: Any) -> None:
    """Queue the counters of one settled request on a redis-py pipeline (sync or asyncio):
    the gateway folds them into its settle round trip. `outcome` as `request_fields` takes."""
    key = stats_key(deployment_id)
    for name, amount in request_fields(**outcome).items():
        pipe.hincrby(key, name, amount)
    pipe.expire(key, STATS_TTL_S)


def record_request(redis: Any, deployment_id: int | str, **outcome: Any) -> None:
    """Record one settled request (sync redis-py client). One round trip."""
    pipe = redis.pipeline(transaction=False)
    add_request(pipe, deployment_id, **outcome)
    pipe.execute()


def stats_from_counters(counters: Mapping[str, int]) -> DeploymentWindowStats:
    ttft: dict[int, int] = {}
    tpot: dict[int, int] = {}
    lengths: dict[int, int] = {}
    finishes: dict[str, int] = {}
    for name, count in counters.items():
        if count <= 0:
            continue
        kind, _, suffix = name.partition(":")
        if kind == "ttft":
            ttft[int(suffix)] = count
        elif kind == "tpot":
            tpot[int(suffix)] = count
        elif kind == "len":
            lengths[int(suffix)] = count
        elif kind == "finish":
            finishes[suffix] = count
    return DeploymentWindowStats(
        requests=counters.get("requests", 0),
        errors=counters.get("errors", 0),
        refusals=counters.get("refusals", 0),
        ttft_p99_s=quantile_from_buckets(ttft, 0.99),
        tpot_p99_s=quantile_from_buckets(tpot, 0.99),
        output_lengths=lengths,
        finish_reasons=finishes,
    )


class RedisRolloutMetrics:
    """Reads what `record_request` wrote."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis

    def _counters(self, deployment_id: int) -> dict[str, int]:
        raw = self._redis.hgetall(stats_key(deployment_id))
        return {redis_text(name): int(value) for name, value in raw.items()}

    def mark(self, deployment_id: int) -> WindowMark:
        return self._counters(deployment_id)

    def window_stats(self, deployment_id: int, since: WindowMark) -> DeploymentWindowStats:
        now = self._counters(deployment_id)
        # A counter below its mark means the hash expired and restarted: count it from zero.
        window = {
            name: value - since.get(name, 0) if value >= since.get(name, 0) else value
            for name, value in now.items()
        }
        return stats_from_counters(window)


# --- an in-memory source for tests and the cluster simulator -----------------------------------


@dataclass(frozen=True, slots=True)
class RequestSample:
    ok: bool
    ttft_s: float | None
    tpot_s: float | None
    output_tokens: int
    finish_reason: str | None
    refused: bool


class InMemoryRolloutMetrics:
    """Keeps every sample; windows and quantiles are exact."""

    def __init__(self) -> None:
        self._samples: dict[int, list[RequestSample]] = {}

    def record(
        self,
        deployment_id: int,
        *,
        ok: bool,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        output_tokens: int = 0,
        finish_reason: str | None = None,
        refused: bool = False,
    ) -> None:
        sample = RequestSample(ok, ttft_s, tpot_s, output_tokens, finish_reason, refused)
        self._samples.setdefault(deployment_id, []).append(sample)

    def mark(self, deployment_id: int) -> WindowMark:
        return {"samples": len(self._samples.get(deployment_id, []))}

    def window_stats(self, deployment_id: int, since: WindowMark) -> DeploymentWindowStats:
        samples = self._samples.get(deployment_id, [])[since.get("samples", 0) :]
        succeeded = [s for s in samples if s.ok]
        return DeploymentWindowStats(
            requests=len(samples),
            errors=len(samples) - len(succeeded),
            refusals=sum(1 for s in succeeded if s.refused),
            ttft_p99_s=exact_quantile([s.ttft_s for s in samples if s.ttft_s is not None], 0.99),
            tpot_p99_s=exact_quantile([s.tpot_s for s in samples if s.tpot_s is not None], 0.99),
            output_lengths=dict(Counter(s.output_tokens for s in succeeded)),
            finish_reasons=dict(Counter(s.finish_reason or "unknown" for s in succeeded)),
        )
