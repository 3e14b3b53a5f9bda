"""Cost to serve: a replica's GPU-time in a window, split across the requests it served.

Pure: no Django, no I/O.

Method. A replica holds `gpus` GPUs for the whole window whether they compute or idle, so the
window costs `gpus x window seconds x pool price per GPU-hour / 3600`. Idle time is part of
that cost: it is split across the window's requests the same way as busy time (a replica kept
warm for five requests costs those five requests all of it). A window with no requests leaves
its cost unattributed; the caller reports it as the pool's idle cost.

The split is in proportion to the work each request caused, in engine-seconds from the
roofline of `serving.engine.perf.PerfModel` for that replica's GPU class and model:

- a prefill token weighs `prefill_s(chunk) / chunk`: the per-token time of a typical chunked
  prefill (compute-bound: 2 x params FLOPs per token), chunk = 512 tokens;
- a decode token weighs `decode_step_s(batch, batch x context) / batch`: one step of the
  replica's mean decode batch in the window (memory-bound: weights plus KV read once per step,
  shared by the batch), at the window's mean context;
- a cached prompt token weighs nothing: the prefix cache skipped its prefill.

The mean batch is read from the requests themselves: the sum of their decode times
(total - TTFT) over the window length is the mean number decoding at once. A decode token
therefore weighs more on a quiet replica (its step is shared by fewer requests), which is what
a quiet replica really costs per token.

Cost is money, so it is split in whole micro-USD by largest remainder: the parts add up to the
window's cost exactly. GPU-seconds are split as floats (a measure, not a sum of money).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serving.engine.perf import PerfModel

PREFILL_CHUNK_TOKENS = 512
MAX_BATCH = 256


@dataclass(frozen=True, slots=True)
class WorkWeights:
    prefill_s_per_token: float
    decode_s_per_token: float

    def work(self, prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int) -> float:
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
    replica_id: str
    window_s: float
    gpus: int
    usd_micros_per_gpu_hour: int

    @property
    def gpu_seconds(self) -> float:
        return self.window_s * self.gpus

    @property
    def cost_usd_micros(self) -> int:
        numerator = round(self.window_s * 1000) * self.gpus * self.usd_micros_per_gpu_hour
        return (numerator + 1_800_000) // 3_600_000


@dataclass(frozen=True, slots=True)
class Attribution:
    request_id: str
    gpu_seconds: float
    cost_usd_micros: int


def mean_decode_batch(window: ReplicaWindow, requests: Sequence[ServedRequest]) -> int:
    decoding_s = sum(max(0.0, r.decode_ms) for r in requests) / 1000.0
    batch = round(decoding_s / window.window_s) if window.window_s > 0 else 1
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


def attribute(
    window: ReplicaWindow, requests: Sequence[ServedRequest], weights: WorkWeights
) -> list[Attribution]:
    """Split the window's GPU-seconds and cost across `requests` by work. Empty when the
    replica served nothing (its cost is then idle cost, the caller's to report)."""
    if not requests:
        return []
    works = [
        weights.work(r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens) for r in requests
    ]
    total_work = sum(works)
    if total_work <= 0:
        # Requests that failed before any token did no measurable work: share equally.
        works = [1.0] * len(requests)
        total_work = float(len(requests))
    shares = [w / total_work for w in works]
    micros = split_micros(window.cost_usd_micros, shares)
    return [
        Attribution(r.request_id, window.gpu_seconds * share, cost)
        for r, share, cost in zip(requests, shares, micros, strict=True)
    ]


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
