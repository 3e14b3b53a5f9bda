"""The prefill budget of an engine step (vLLM's `--max-num-batched-tokens`) the platform
launches a replica with. Pure, no Django.

vLLM runs a newly admitted prompt's chunk, up to the budget, in the same step as every running
decode, so each decode waits for the chunk's compute. Left to itself, vLLM's OpenAI server
picks the budget by GPU memory (`GpuSpec.default_max_num_batched_tokens`): 8192 tokens on an
H100, whose full chunk is about 235 ms of llama-3.1-8b against a 50 ms TPOT objective, and
2048 on an L40S, about 150 ms. Once prefill traffic keeps steps busy, decodes read at the
chunk's pace and miss TPOT, whichever replica the router picks.

The rule: the largest power of two, from 256 or `max_num_seqs` (vLLM refuses less) up to
vLLM's largest default (8192), whose full chunk run with a typical decode batch still fits in one
TPOT objective. A step's time is the roofline's `max(memory, compute)`, so a chunk is free
while its compute hides under the weights and KV read (about 450 tokens beside that batch on
an L40S, 300 on an H100) and costs its compute beyond that; prefill throughput is nearly the
class's from there on (an L40S computes 512 tokens in 40 ms and 2048 in 150 ms), while
every larger chunk lengthens each decode's step. A tier without a TPOT objective
keeps vLLM's own choice (None): nothing reads at the decode's pace. A class so slow that even
the smallest chunk misses gets the smallest: it costs its decodes least.

Figures (llama-3.1-8b bf16, 32 sequences decoding at 1,024 tokens of context, 50 ms):
H100 and H200 1024 (a 2048 chunk takes 56 ms), RTX PRO 6000 512 (1024: 56 ms), A100 512
(46 ms), L40S 512 (40 ms; 1024: 76 ms), L4 256 (the smallest: with the 19 sequences its KV
holds at 1,024 tokens its decode step alone is 91 ms). The timed step carries the chunk and the
batch's tokens together, where vLLM counts the decodes within the budget: one batch (32
tokens) longer than vLLM's, on the safe side.
Measured in the cluster simulator over 120 s of every workload family, and why it is the
default: bench/RESULTS.md, "The engine's prefill budget".
"""

from __future__ import annotations

from serving.engine.perf import PerfModel

# vLLM's defaults are 2048 and 8192; nothing larger is ever chosen. Nothing smaller than
# SMALLEST_BUDGET either: below it a step's fixed part dwarfs the chunk and prompts crawl.
LARGEST_BUDGET = 8192
SMALLEST_BUDGET = 256
# The decode batch a chunk shares its step with, and each sequence's context: the operating
# point the router's coefficients are fitted around (serving.router.coefficients).
TYPICAL_DECODE_BATCH = 32
TYPICAL_CONTEXT_TOKENS = 1024


def candidate_budgets(max_num_seqs: int) -> list[int]:
    """Powers of two from the first at least `max_num_seqs` and `SMALLEST_BUDGET` up to
    `LARGEST_BUDGET`, or `max_num_seqs` itself when it is larger."""
    budget = SMALLEST_BUDGET
    while budget < max_num_seqs:
        budget *= 2
    candidates = []
    while budget <= LARGEST_BUDGET:
        candidates.append(budget)
        budget *= 2
    return candidates or [max_num_seqs]


def mixed_step_s(perf: PerfModel, chunk_tokens: int, max_num_seqs: int = 256) -> float:
    """One step that prefills `chunk_tokens` of a new prompt while the typical batch decodes."""
    batch = max(1, min(TYPICAL_DECODE_BATCH, perf.max_batch(TYPICAL_CONTEXT_TOKENS, max_num_seqs)))
    return perf.batch_step_s(
        chunk_tokens + batch,
        batch * TYPICAL_CONTEXT_TOKENS,
        attention_units=chunk_tokens * chunk_tokens,
    )


def chosen_max_num_batched_tokens(
    perf: PerfModel, tpot_s: float | None, max_num_seqs: int = 256
) -> int | None:
    """The budget the platform launches `perf`'s replicas with for a tier whose TPOT objective
    is `tpot_s` (module docstring); None: leave vLLM's own."""
    if tpot_s is None:
        return None
    candidates = candidate_budgets(max_num_seqs)
    fitting = [b for b in candidates if mixed_step_s(perf, b, max_num_seqs) <= tpot_s]
    return fitting[-1] if fitting else candidates[0]
