"""Predicted TTFT, TPOT and cost of one request on one replica.

With `load = max(running + waiting, inflight)` (telemetry lags; this gateway's own
in-flight count is a fresh lower bound on what the replica holds) and `B = max_num_seqs`:

    batch       = min(load, B)                     sequences decoding when we arrive
    queued      = max(waiting, load - B)           requests that get a batch slot before us
    step        = decode_base_s + decode_s_per_seq * batch
    prefill(n)  = prefill_base_s + prefill_s_per_token * n
    TTFT        = (step if batch else 0)           wait for the step boundary (continuous batching)
                + queued * prefill(assumed_queued_prompt_tokens)
                + prefill(prompt_tokens - cached_prefix_tokens)
                + (adapter_load_s if the adapter is not resident)
    TPOT        = decode_base_s + decode_s_per_seq * (batch + 1)

Both are multiplied by `1 + kv_inflation * (kv_usage - kv_high_watermark) / (1 - watermark)`
above the watermark (preemptions recompute and stall), and by `stale_penalty` when the
telemetry is older than `stale_after_s` (we no longer know; assume worse).

Cost is the replica's price times the request's fair share of its time: its own prefill
plus `max_tokens` decode steps shared with the `batch + 1` sequences in them.
"""

from __future__ import annotations

from typing import NamedTuple

from serving.router.contracts import ReplicaState, RouterConfig, RouteRequest


class Prediction(NamedTuple):
    ttft_s: float
    tpot_s: float
    cost_usd: float


def replica_load(replica: ReplicaState) -> int:
    return max(replica.running + replica.waiting, replica.inflight)


def predict(
    replica: ReplicaState,
    request: RouteRequest,
    now: float,
    config: RouterConfig,
    cached_blocks: int = 0,
) -> Prediction:
    perf = replica.perf
    load = max(replica.running + replica.waiting, replica.inflight)
    batch = load if load < perf.max_num_seqs else perf.max_num_seqs
    queued = max(replica.waiting, load - perf.max_num_seqs)

    tpot = perf.decode_base_s + perf.decode_s_per_seq * (batch + 1)
    new_tokens = request.prompt_tokens - cached_blocks * config.prefix_block_tokens
    own_prefill = perf.prefill_base_s + perf.prefill_s_per_token * (
        new_tokens if new_tokens > 1 else 1
    )
    ttft = own_prefill
    if batch:
        ttft += perf.decode_base_s + perf.decode_s_per_seq * batch
    if queued:
        ttft += queued * (
            perf.prefill_base_s + perf.prefill_s_per_token * config.assumed_queued_prompt_tokens
        )
    if request.adapter is not None and request.adapter not in replica.adapters_loaded:
        ttft += config.adapter_load_s

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
