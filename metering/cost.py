"""Cost to serve: a replica's ready GPU time in an hour, split across what it served.

Pure: no Django, no I/O.

The ledger. A replica holds `gpus` GPUs from the moment it is ready until it stops (draining
included: it still finishes its streams), so an hour costs `gpus x ready seconds in the hour x
pool price per GPU-hour / 3600`. The ready seconds come from the replica's state changes
(metering.ledger), never from the clock: an hour before the replica was ready, or after it
stopped, costs nothing, and a crash stops the meter until the replica is ready again.

The split. Each request is charged the GPU time its work took, estimated in engine-seconds
from the roofline of `serving.engine.perf.PerfModel` for the replica's GPU class and model:

- a prefill token weighs `prefill_s(chunk) / chunk`: the per-token time of a typical chunked
  prefill (compute-bound: 2 x params FLOPs per token), chunk = 512 tokens;
- a decode token weighs `decode_step_s(batch, batch x context) / batch`: one step of the
  replica's mean decode batch in the hour (memory-bound: weights plus KV read once per step,
  shared by the batch), at the hour's mean context;
- a cached prompt token weighs nothing: the prefix cache skipped its prefill.

A disaggregated request is in two replicas' splits, each charging its own part: on its prefill
replica its prompt with no completion, on its decode replica its completion with the whole
prompt cached (it arrived as KV cache over the link); metering.rollups adds the two up.

The mean batch is read from the requests themselves: the sum of their decode times
(total - TTFT) over the ready time is the mean number decoding at once. A decode token
therefore weighs more on a quiet replica (its step is shared by fewer requests).

What the requests' work does not fill is the replica's idle time, charged to nobody's request
and reported as the pool's idle cost: capacity kept warm, which is the autoscaler's to shrink,
not a tenant's doing. When the estimates add up to more than the ready time (the roofline is
an estimate), the requests' shares are scaled down to fill it exactly and nothing is idle.

Money is split in whole micro-USD by largest remainder: requests' parts plus the idle part add
up to the replica-hour's cost exactly. GPU-seconds are split as floats (a measure, not money).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serving.engine.perf import PerfModel

PREFILL_CHUNK_TOKENS = 512
MAX_BATCH = 256
US_PER_HOUR = 3_600_000_000


@dataclass(frozen=True, slots=True)
class WorkWeights:
    prefill_s_per_token: float
    decode_s_per_token: float

    def work(self, prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int) -> float:
        """Engine-seconds of the request's work on one replica (all its GPUs at once)."""
        uncached = max(0, prompt_tokens - max(0, cached_prompt_tokens))
        return uncached * self.prefill_s_per_token + max(0, completion_tokens) * (
            self.decode_s_per_token
        )


@dataclass(frozen=True, slots=True)
class ServedRequest:
    request_id: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    decode_ms: float = 0.0  # total - TTFT: time spent in the decode batch


@dataclass(frozen=True, slots=True)
class ReplicaWindow:
    """A replica's ready time within one period, on its GPUs at its pool's price."""

    replica_id: str
    ready_us: int
    gpus: int
    usd_micros_per_gpu_hour: int

    @property
    def ready_s(self) -> float:
        return self.ready_us / 1e6

    @property
    def gpu_seconds(self) -> float:
        return self.ready_us * self.gpus / 1e6

    @property
    def cost_usd_micros(self) -> int:
        return gpu_time_usd_micros(self.ready_us * self.gpus, self.usd_micros_per_gpu_hour)


def gpu_time_usd_micros(gpu_us: int, usd_micros_per_gpu_hour: int) -> int:
    """GPU-microseconds at a price per GPU-hour, rounded half up to the micro-USD."""
    return (gpu_us * usd_micros_per_gpu_hour + US_PER_HOUR // 2) // US_PER_HOUR


@dataclass(frozen=True, slots=True)
class Attribution:
    request_id: str
    gpu_seconds: float
    cost_usd_micros: int


@dataclass(frozen=True, slots=True)
class WindowSplit:
    """A replica-hour split: what its requests are charged and what is left idle."""

    window: ReplicaWindow
    requests: list[Attribution]
    idle_gpu_seconds: float
    idle_usd_micros: int

    @property
    def busy_gpu_seconds(self) -> float:
        return self.window.gpu_seconds - self.idle_gpu_seconds


def mean_decode_batch(window: ReplicaWindow, requests: Sequence[ServedRequest]) -> int:
    decoding_s = sum(max(0.0, r.decode_ms) for r in requests) / 1000.0
    batch = round(decoding_s / window.ready_s) if window.ready_us > 0 else 1
    return min(MAX_BATCH, max(1, batch))


def mean_context(requests: Sequence[ServedRequest]) -> int:
    if not requests:
        return 0
    total = sum(r.prompt_tokens + r.completion_tokens / 2 for r in requests)
    return round(total / len(requests))


def work_weights(perf: PerfModel, batch: int, context: int) -> WorkWeights:
    batch = max(1, batch)
    return WorkWeights(
        prefill_s_per_token=perf.prefill_s(PREFILL_CHUNK_TOKENS) / PREFILL_CHUNK_TOKENS,
        decode_s_per_token=perf.decode_step_s(batch, batch * max(0, context)) / batch,
    )


def weights_for_window(
    perf: PerfModel, window: ReplicaWindow, requests: Sequence[ServedRequest]
) -> WorkWeights:
    return work_weights(perf, mean_decode_batch(window, requests), mean_context(requests))


def work_cost_usd_micros(
    weights: WorkWeights, gpus: int, usd_micros_per_gpu_hour: int, request: ServedRequest
) -> int:
    """What the request's work costs on a replica of `gpus` GPUs with these weights: the
    price of its busy GPU time, idle time excluded (the rule `split` charges by)."""
    work_s = weights.work(
        request.prompt_tokens, request.cached_prompt_tokens, request.completion_tokens
    )
    return gpu_time_usd_micros(round(work_s * 1e6) * gpus, usd_micros_per_gpu_hour)


@dataclass(frozen=True, slots=True)
class Placement:
    """A replica as the saving prices it: its engine model, its GPUs and their price."""

    perf: PerfModel
    gpus: int
    usd_micros_per_gpu_hour: int


def moved_work_usd_micros(
    request: ServedRequest, here: Placement, there: Placement, batch: int, context: int
) -> int:
    """How much more (less, when negative) the request's work costs on `there` than on
    `here`, both at one decode batch and context: those of the replica it ran on.

    One batch for both prices the hardware choice alone. Pricing `there` at the batch it had
    in the same period would charge the router for batch sizes its own choices made (sending
    work away from a replica empties its batch and makes its tokens look dear), which is not
    what the baseline policy would have met there."""
    return work_cost_usd_micros(
        work_weights(there.perf, batch, context), there.gpus, there.usd_micros_per_gpu_hour, request
    ) - work_cost_usd_micros(
        work_weights(here.perf, batch, context), here.gpus, here.usd_micros_per_gpu_hour, request
    )


def split(
    window: ReplicaWindow, requests: Sequence[ServedRequest], weights: WorkWeights
) -> WindowSplit:
    """Charge each request its work's share of the window, the rest idle (module docstring)."""
    total_cost = window.cost_usd_micros
    works = [
        weights.work(r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens) for r in requests
    ]
    busy_s = sum(works)
    if busy_s <= 0 or window.ready_us <= 0:
        # Nothing served, or only requests that failed before any token: all of it is idle.
        unpaid = [Attribution(r.request_id, 0.0, 0) for r in requests]
        return WindowSplit(window, unpaid, window.gpu_seconds, total_cost)
    busy_fraction = min(1.0, busy_s / window.ready_s)
    charged_micros = min(total_cost, round(total_cost * busy_fraction))
    shares = [w / busy_s for w in works]
    micros = split_micros(charged_micros, shares)
    charged_gpu_s = window.gpu_seconds * busy_fraction
    attributions = [
        Attribution(r.request_id, charged_gpu_s * share, cost)
        for r, share, cost in zip(requests, shares, micros, strict=True)
    ]
    return WindowSplit(
        window, attributions, window.gpu_seconds - charged_gpu_s, total_cost - charged_micros
    )


def split_micros(total: int, shares: Sequence[float]) -> list[int]:
    """Whole micro-USD parts of `total` in proportion to `shares`, adding up to `total`
    exactly (largest remainder)."""
    exact = [total * share for share in shares]
    parts = [int(x) for x in exact]
    short = total - sum(parts)
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - parts[i], reverse=True)
    # Float shares may sum a hair off 1: `short` is then -1 or len+1 at worst; fix either way.
    step = 1 if short >= 0 else -1
    for n in range(abs(short)):
        i = by_remainder[n % len(parts)] if step > 0 else by_remainder[-1 - n % len(parts)]
        parts[i] += step
    return parts
