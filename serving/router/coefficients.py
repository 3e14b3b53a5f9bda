"""Turn the engine's roofline model into the router's linear `ReplicaPerf` coefficients.

Called by whoever builds the routing table, once per replica shape, never per request.
The engine model is only imported for type checking so the router stays importable alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.router.contracts import ReplicaPerf

if TYPE_CHECKING:
    from serving.engine.perf import PerfModel


def coefficients_from_perf(
    perf: PerfModel,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    typical_context_tokens: int = 1024,
    typical_prompt_tokens: int = 512,
    long_prompt_tokens: int = 4096,
) -> ReplicaPerf:
    """Secant fits of the roofline around typical operating points.

    Decode: the line through the step times at batch 1 and at a mid batch (32 or what KV
    allows), each sequence holding `typical_context_tokens`; it is exact while decode stays
    bandwidth-bound, which is where an LLM engine lives. Prefill: the line through a typical
    and a long prompt, where prefill is compute-bound (attention's growth included on
    average); `prefill_base_s`, the intercept of a whole prompt's prefill, is at least a
    one-token prefill, since a short prompt is bound by reading the weights once, so long
    prompts are overestimated by at most that floor: on the safe side for an SLO check.
    `compute_base_s` is the same line's own intercept, without the floor: one step of a
    chunked prefill computes while it reads the weights, so a 512-token step on an L40S
    takes 38 ms in the engine model where the floored line says 67 ms. KV beyond
    `typical_context_tokens` a sequence: the mid batch's step with twice the context, less
    its step, per extra token.
    `max_num_batched_tokens` None: what vLLM picks for the GPU when the flag is not given.
    """
    budget = max_num_batched_tokens or perf.gpu.default_max_num_batched_tokens
    mid_batch = max(2, min(32, perf.max_batch(typical_context_tokens, max_num_seqs)))
    step_one = perf.decode_step_s(1, typical_context_tokens)
    step_mid = perf.decode_step_s(mid_batch, mid_batch * typical_context_tokens)
    decode_s_per_seq = (step_mid - step_one) / (mid_batch - 1)
    decode_base_s = step_one - decode_s_per_seq
    # What each KV token beyond the typical context adds to the mid batch's step.
    extra = mid_batch * typical_context_tokens
    step_long = perf.decode_step_s(mid_batch, 2 * extra)
    decode_s_per_kv_token = max(0.0, (step_long - step_mid) / extra)

    short = perf.prefill_s(typical_prompt_tokens)
    long = perf.prefill_s(long_prompt_tokens)
    prefill_s_per_token = (long - short) / (long_prompt_tokens - typical_prompt_tokens)
    compute_base_s = max(0.0, short - prefill_s_per_token * typical_prompt_tokens)
    prefill_base_s = max(perf.prefill_s(1), compute_base_s)
    return ReplicaPerf(
        prefill_s_per_token=prefill_s_per_token,
        prefill_base_s=prefill_base_s,
        compute_base_s=compute_base_s,
        decode_base_s=decode_base_s,
        decode_s_per_seq=decode_s_per_seq,
        kv_capacity_tokens=perf.kv_capacity_tokens,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        kv_bytes_per_token=perf.kv_bytes_per_token,
        decode_s_per_kv_token=decode_s_per_kv_token,
        typical_context_tokens=typical_context_tokens,
    )
