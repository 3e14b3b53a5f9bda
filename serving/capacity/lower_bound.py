"""The fewest replicas of one GPU class on which any router could meet the SLO for a workload.

A router's smallest fleet means little alone: this is the floor it is measured against
(`bench/routing.py` prints each policy's fleet as a multiple of it). It bounds fleets on which
at least `share` (99 %) of the counted tiers' requests meet both clocks, TTFT and TPOT: by
default every tier with an objective (interactive and standard), since a fleet that meets
interactive's objectives by starving standard's is no answer; batch, with none, is left to
spare time and constrains nothing. `counted_tiers=("interactive",)` bounds the looser
criterion of interactive alone.

Derivation. Every term is optimistic for the fleet, so the bound never exceeds what the best
possible router achieves on the engine model (`serving.engine.perf.PerfModel`):

1. **Feasibility.** A request whose prompt cannot prefill within its TTFT objective on an idle
   replica (`PerfModel.ttft_s` of its new tokens), or whose tier's TPOT is below a lone
   sequence's decode step (`decode_step_s(1, prompt)`), misses on any fleet. When more than
   `(1 - share)` of the counted requests do, no fleet of this class meets the SLO: None.
2. **New tokens.** Only prompt tokens in KV blocks no earlier request had are prefilled: the
   best router sends every repeat of a block where it is cached (block hashes of the workload,
   salted per tenant as the gateway salts them). A request without hashes is all new.
3. **A replica's rates.** Prefill: one new token costs `compute_time_s(1)` (2 x params FLOPs at
   the model's efficiency; no attention term, no step overhead). Decode: a step costs at least
   its overhead plus the weights read once plus every sequence's KV read
   (`step_overhead_s + memory_time_s`), so a decoded token costs at least the fixed part over
   the batch plus its own context's KV (prompt plus half its output, on average over its
   tokens). The batch is at most the largest whose step meets the tier's TPOT with every
   sequence at the window's smallest prompt, whose KV fits and that `max_num_seqs` allows; a
   replica that holds a stricter tier's request runs shorter steps, so a token never costs
   less than its own tier's share. A step costs the larger of its memory and compute time, so prefill computed alongside a
   decode can hide under it: a window's replica-seconds are at least the larger of the prefill
   seconds and the decode seconds, never their sum.
4. **KV.** A request holds at least its prompt's KV for its whole decode, which lasts at least
   `output x decode_step_s(1, prompt)`: by Little's law the KV in use over a window is at least
   the sum of `prompt x that time` over the window, which `N x kv_capacity_tokens x T` must hold.
5. **Windows.** In a window `[t, t + T)` the requests that arrive in it and whose SLO deadline
   (arrival + TTFT objective + output x TPOT objective) falls in it must have all their work done
   in it, less the `floor((1 - share) x counted)` requests with the most work, which may be the
   ones that miss. `N >= max(prefill, decode, kv) / T`; the bound is the largest over windows of
   length `window_s` (sliding by a quarter of it) and over the whole workload.

The bound is loose where the engine model's step overhead, chunking and queueing matter (they
cost every router something) and tight where a workload is bandwidth- or compute-bound in its
peak minute, which is where fleets are sized.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from serving.engine.perf import PerfModel
from serving.router.contracts import DEFAULT_SLO_TIERS, SloTier

BLOCK_TOKENS = 16  # the gateway's and the simulator's prefix block


class BoundRequest(Protocol):
    """What the bound reads of a request (a `serving.clustersim.SimRequest` is one)."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def tier(self) -> str: ...
    @property
    def block_hashes(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class _Work:
    arrival_s: float
    deadline_s: float
    new_tokens: int
    prompt_tokens: int
    output_tokens: int
    tpot_s: float


def lower_bound_replicas(
    requests: Iterable[BoundRequest],
    perf: PerfModel,
    *,
    tiers: dict[str, SloTier] | None = None,
    counted_tiers: Sequence[str] | None = None,
    share: float = 0.99,
    window_s: float = 60.0,
    max_num_seqs: int = 256,
) -> int | None:
    """The fewest replicas of `perf`'s class and TP on which any router could meet the SLO
    for `share` of the counted tiers' requests (module docstring); None when none could.
    `counted_tiers` None: every tier with an objective (batch work is left to spare time)."""
    tiers = tiers or DEFAULT_SLO_TIERS
    works, infeasible = _counted_work(requests, perf, tiers, counted_tiers)
    counted = len(works) + infeasible
    if counted == 0:
        return 0
    may_miss = math.floor((1.0 - share) * counted + 1e-9)
    if infeasible > may_miss:
        return None
    may_miss -= infeasible
    start = min(w.arrival_s for w in works) if works else 0.0
    end = max(w.deadline_s for w in works) if works else 0.0
    windows = [(start, max(end, start + window_s))]
    step = window_s / 4
    t = start
    while t + window_s <= end:
        windows.append((t, t + window_s))
        t += step
    replicas = 1 if works else 0
    for low, high in windows:
        inside = [w for w in works if w.arrival_s >= low and w.deadline_s <= high]
        seconds = _replica_seconds(inside, perf, may_miss, max_num_seqs)
        replicas = max(replicas, math.ceil(seconds / (high - low) - 1e-9))
    return replicas


def _counted_work(
    requests: Iterable[BoundRequest],
    perf: PerfModel,
    tiers: dict[str, SloTier],
    counted_tiers: Sequence[str] | None,
) -> tuple[list[_Work], int]:
    """The counted requests' work, in arrival order, and how many no fleet can serve in time."""
    seen: set[int] = set()
    works: list[_Work] = []
    infeasible = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        new_tokens = _new_tokens(request, seen)
        tier = tiers.get(request.tier)
        has_objective = tier is not None and (tier.ttft_s is not None or tier.tpot_s is not None)
        if (request.tier not in counted_tiers) if counted_tiers is not None else not has_objective:
            continue
        ttft = tier.ttft_s if tier is not None and tier.ttft_s is not None else math.inf
        tpot = tier.tpot_s if tier is not None and tier.tpot_s is not None else math.inf
        prompt = max(1, request.prompt_tokens)
        lone_step = perf.decode_step_s(1, prompt)
        if perf.ttft_s(prompt, prompt - max(1, new_tokens)) > ttft or lone_step > tpot:
            infeasible += 1
            continue
        deadline = request.arrival_s + ttft + request.output_tokens * tpot
        if math.isinf(deadline):
            deadline = request.arrival_s + perf.ttft_s(prompt) + request.output_tokens * lone_step
        works.append(
            _Work(request.arrival_s, deadline, new_tokens, prompt, request.output_tokens, tpot)
        )
    return works, infeasible


def _new_tokens(request: BoundRequest, seen: set[int]) -> int:
    """Prompt tokens outside every block an earlier request had (each block computed once)."""
    if not request.block_hashes:
        return request.prompt_tokens
    fresh = 0
    for block in request.block_hashes:
        if block not in seen:
            seen.add(block)
            fresh += 1
    hashed = len(request.block_hashes) * BLOCK_TOKENS
    return fresh * BLOCK_TOKENS + max(0, request.prompt_tokens - hashed)


def _replica_seconds(
    works: list[_Work], perf: PerfModel, may_miss: int, max_num_seqs: int
) -> float:
    """Replica-seconds the window's work needs at least, its `may_miss` heaviest requests
    left out: the largest of its prefill, decode and KV terms."""
    if not works:
        return 0.0
    smallest_prompt = min(w.prompt_tokens for w in works)
    per_token = perf.compute_time_s(1)
    # A step's fixed part (overhead and the weights read) shared by the largest batch the
    # tier's TPOT allows; each token then reads its own context's KV.
    fixed = perf.step_overhead_s + perf.memory_time_s(0)
    batch = {
        tpot: _largest_batch(perf, tpot, smallest_prompt, max_num_seqs)
        for tpot in {w.tpot_s for w in works}
    }
    kv_s_per_token = perf.memory_time_s(1) - perf.memory_time_s(0)
    capacity = max(1, perf.kv_capacity_tokens)
    terms = []
    for w in works:
        prefill = w.new_tokens * per_token
        mean_context = w.prompt_tokens + w.output_tokens / 2
        decode = w.output_tokens * (fixed / batch[w.tpot_s] + mean_context * kv_s_per_token)
        held = w.prompt_tokens * w.output_tokens * perf.decode_step_s(1, w.prompt_tokens)
        terms.append((prefill, decode, held / capacity))
    if may_miss:
        # The requests that may miss are taken to be the ones that would cost the most.
        terms.sort(key=lambda term: max(term), reverse=True)
        terms = terms[may_miss:]
    return max(sum(term[i] for term in terms) for i in range(3))


def _largest_batch(perf: PerfModel, tpot_s: float, context: int, max_num_seqs: int) -> int:
    """The largest decode batch whose step meets `tpot_s` with every sequence at `context`
    tokens (the fewest any of them has), whose KV fits, within max_num_seqs."""
    context = max(1, context)
    low, high = 1, max(1, min(max_num_seqs, perf.kv_capacity_tokens // context))
    while low < high:  # the step grows with the batch: bisect for the largest within TPOT
        middle = (low + high + 1) // 2
        if perf.decode_step_s(middle, middle * context) <= tpot_s:
            low = middle
        else:
            high = middle - 1
    return low
