"""Predicted TTFT, TPOT and cost of one request on one replica.

With `load = max(running + waiting, inflight)` (telemetry lags; this gateway's own
in-flight count is a fresh lower bound on what the replica holds), `B = max_num_seqs` and
`K = max_num_batched_tokens`:

    batch       = min(load, B)                   sequences decoding when we arrive
    ahead       = prefill_pending_tokens         this gateway's prompts not yet prefilled
                + max(0, waiting - inflight) * assumed_queued_prompt_tokens
                                                 (queued requests of other gateways)
    prefill(n)  = (1 + n // K) * prefill_base_s + prefill_s_per_token * n
    TTFT        = (decode step if batch else 0)  wait for the step boundary
                + prefill(ahead + prompt_tokens - cached_prefix_tokens)
                + (adapter_load_s if the adapter is not resident)
    share       = prefill_s_per_token * (prompt-token rate sent here, ours included)
    TPOT        = (decode_base_s + decode_s_per_seq * (batch + 1)) / (1 - share)

The engine schedules chunked prefill FIFO, so prompts ahead of ours delay our first token,
and prompts arriving after ours interrupt our decode steps: a step carrying a prefill chunk
of up to K tokens takes that chunk's compute time, so decodes advance only in the
`1 - share` of the replica's time left over by prefill. The rate is the gateway's own
exponentially decayed count of prompt tokens sent (see `RouterState.request_started`).

Both are multiplied by `1 + kv_inflation * (kv_usage - kv_high_watermark) / (1 - watermark)`
above the watermark (preemptions recompute and stall), and by `stale_penalty` when the
telemetry is older than `stale_after_s` (we no longer know; assume worse).

Cost is the replica's price times the request's fair share of its time: its own prefill
plus `max_tokens` decode steps shared with the `batch + 1` sequences in them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from serving.router.contracts import (
    PROMPT_RATE_WINDOW_S,
    ReplicaState,
    RouterConfig,
    RouteRequest,
)


class Prediction(NamedTuple):
    ttft_s: float
    tpot_s: float
    cost_usd: float


def replica_load(replica: ReplicaState) -> int:
    return max(replica.running + replica.waiting, replica.inflight)


def decayed_rate(replica: ReplicaState, now: float) -> float:
    """The replica's prompt tokens per second, decayed from its last update to `now`."""
    elapsed = now - replica.prompt_rate_at
    if elapsed <= 0.0 or not replica.prompt_rate:
        return replica.prompt_rate
    return replica.prompt_rate * math.exp(-elapsed / PROMPT_RATE_WINDOW_S)


def predict(
    replica: ReplicaState,
    request: RouteRequest,
    now: float,
    config: RouterConfig,
    cached_blocks: int = 0,
) -> Prediction:
    perf = replica.perf
    inflight = replica.inflight
    load = replica.running + replica.waiting
    if inflight > load:
        load = inflight
    batch = load if load < perf.max_num_seqs else perf.max_num_seqs
    new_tokens = request.prompt_tokens - cached_blocks * config.prefix_block_tokens
    if new_tokens < 1:
        new_tokens = 1
    per_token = perf.prefill_s_per_token

    ahead = replica.prefill_pending_tokens
    if replica.waiting > inflight:
        ahead += (replica.waiting - inflight) * config.assumed_queued_prompt_tokens
    to_prefill = ahead + new_tokens
    # One step per K prompt tokens at least, each paying the fixed prefill overhead.
    steps = 1 + to_prefill // perf.max_num_batched_tokens
    own_prefill = perf.prefill_base_s + per_token * new_tokens
    ttft = steps * perf.prefill_base_s + per_token * to_prefill
    if batch:
        ttft += perf.decode_base_s + perf.decode_s_per_seq * batch
    if request.adapter is not None and request.adapter not in replica.adapters_loaded:
        ttft += config.adapter_load_s

    share = per_token * (decayed_rate(replica, now) + new_tokens / PROMPT_RATE_WINDOW_S)
    if share > config.max_prefill_share:
        share = config.max_prefill_share
    tpot = (perf.decode_base_s + perf.decode_s_per_seq * (batch + 1)) / (1.0 - share)

    factor = 1.0
    if replica.kv_usage > config.kv_high_watermark:
        over = (replica.kv_usage - config.kv_high_watermark) / (1.0 - config.kv_high_watermark)
        factor += config.kv_inflation * min(over, 1.0)
    if now - replica.telemetry_at > config.stale_after_s:
        factor *= config.stale_penalty

    gpu_seconds = own_prefill + request.max_tokens * tpot / (batch + 1)
    return Prediction(
        ttft * factor, tpot * factor, replica.price_per_hour / 3600.0 * gpu_seconds * factor
    )


def is_candidate(
    replica: ReplicaState, request: RouteRequest, now: float, config: RouterConfig
) -> bool:
    """Hard filters: a replica failing any of them never receives the request."""
    if not replica.healthy or replica.breaker_open_until > now:
        return False
    if now - replica.telemetry_at > config.dead_after_s:
        return False
    allowed = request.allowed_regions
    if allowed is not None and replica.region not in allowed:
        return False
    if request.prompt_tokens > replica.perf.kv_capacity_tokens:
        return False
    return not (
        request.adapter is not None
        and replica.max_loras <= 0
        and request.adapter not in replica.adapters_loaded
    )
