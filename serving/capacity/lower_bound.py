"""The fewest replicas of one GPU class on which any router could meet the SLO for a workload.

A router's smallest fleet means little alone: this is the floor it is measured against
(`bench/routing.py` prints each policy's fleet as a multiple of it). It bounds fleets on which
at least `share` (99 %) of the counted tiers' requests meet both clocks, TTFT and TPOT: by
default every tier with an objective (interactive and standard), since a fleet that meets
interactive's objectives by starving standard's is no answer; batch, with none, is left to
spare time and constrains nothing. `counted_tiers=("interactive",)` bounds the looser
criterion of interactive alone.

Derivation. Every term is optimistic for the fleet, so the bound never exceeds what the best
possible router achieves on the engine model (`serving.engine.perf.PerfModel` steps run by
`serving.engine.core.Engine`, no LoRA adapters). Notation: a step takes at least
`t0 + max(W + K x context, F x tokens)` (overhead, weights read, every scheduled sequence's KV
read, 2 x params FLOPs a token; attention FLOPs are left out, chunking can shrink them); a
decode step reading a sequence of context `x` takes at least `a + K x`, `a = t0 + W`.

1. **Feasibility.** A request whose new tokens (2) cannot prefill within its TTFT objective on
   an idle replica (`t0 + max(W, F x new)`), or (two output tokens or more) whose tier's TPOT
   is below a lone decode step at its prompt, misses on any fleet. When more than
   `(1 - share)` of the counted requests do, no fleet of this class meets the SLO: None.
   Otherwise `k = floor((1 - share) x counted)` less those may miss, anywhere: every sum
   below drops, term by term, its own `k` largest summands (each sum only grows with them).
2. **New tokens.** A prompt block no earlier request had (hashes salted per tenant, as the
   gateway salts them) is in no cache when the request arrives, and a later arrival on its
   replica is admitted after it (FIFO), so the request computes it itself; a repeat may be
   free (the best router sends it where the block is). A request without hashes is all new.
3. **Prefill, in short windows.** A counted request arriving at `a >= L` with
   `a + TTFT <= H` computes its new tokens within `[L, H]`, at `F` a token: over windows of
   1 s to `window_s`, `N x (H - L) >= F x new tokens`. Short windows show bursts.
4. **Slots.** The engine schedules every running decode in every step (only the newest
   admitted sequence can be mid-prefill), and a preempted sequence goes back to the front of
   the FIFO queue, so no request is admitted while one waits: the requests admitted and not
   finished on a replica never exceed `max_num_seqs` (B), preempted ones included. A
   counted request is admitted at some `s` in `[a, a + TTFT - p]` (p: its idle prefill, 1)
   and finishes after `s + p + D`, D its output less one times its lone decode step (contexts
   prompt, prompt + 1, ...): its overlap with a window is at least the smaller of the two
   ends' (the overlap rises, stays, then falls with `s`), whether it arrived in the window or
   before. For the requests whose whole life lies inside (`a >= L`, deadline
   `a + TTFT + (out - 1) x TPOT <= H`), the step grows with the batch: their decode steps
   lie inside, so with n of them on a replica, `n a + sum K x <= T`, and their decode time is
   `sum_steps c s >= a D + sum_steps c K sum_batch x >= a D + (sum sqrt(K x))^2 / n`
   (Cauchy-Schwarz twice), summed over replicas by the convexity of `y^2 / z`:
   `overlaps + prefills + a D + a S1^2 / (N T - S2) <= N B T` (S1 = sum sqrt(K x),
   S2 = sum K x over their decode tokens, D their count).
5. **TPOT.** For requests meeting TPOT tau whose decode steps lie in the window (as in 4),
   with contexts at least theta (`k = K theta`) and `b = (tau - a) / k`:
   `(c - b) s <= mu c (s - tau)` for every step with `s >= a + k c`, `mu = tau / (tau - a)`
   (check c below and above b), and each request's steps sum to at most `(out - 1) tau`, so
   `sum c s <= min(b, B) x (their steps' time)`. With 4's lower bound on `sum c s` this gives
   each replica's time S: `min(b, B) S >= a D + a S1^2 / (S - S2)`, the same over the fleet,
   and `N T >= S`. Theta runs over quantiles of the window's prompts (a subset is valid).
   This is the old "decode tokens at the TPOT-sized batch" term, with the step's fixed part
   shared over the batch TPOT allows at the window's own contexts.
6. **Shared TPOT budget.** The same requests, each at its own contexts: a request meeting
   TPOT tau spends at most `(out - 1) tau` in the steps it decodes in (TPOT is the time
   from its first token to its last over `out - 1`; those steps are disjoint and lie in it).
   A step with c of them takes at least `a + K x` summed over their contexts, so over the
   steps `sum c s >= a D + sum_steps (sum sqrt(K x))^2 >= a D + S1^2 / m` (m steps,
   Cauchy-Schwarz twice) and `sum c s <= sum (out - 1) tau`: `m >= S1^2 / beta'` with
   `beta' = sum (out - 1)(tau - a)`, and `m >= D / B`. The steps take `N T >= a m + S2`.
   beta' keeps every request (one that misses only shrinks it); S1, S2, D drop their `k`
   largest. Where 5 bounds the batch by one context theta, this one lets long and short
   contexts share a step as they would; neither is implied by the other.
7. **The other tiers kept up** (`kept_up_ttft_s`, what `bench/routing.py` also asks: every
   tier's TTFT p99 within 30 s). A request of a tier not counted whose TTFT is within the
   limit computes its new tokens (2) within `[a, a + limit]`, so term 3's windows carry
   those FLOPs too. numpy's p99 (linear) is at least the value at rank
   `floor(0.99 (n - 1))` of the tier's n served requests, so all but
   `n - 1 - floor(0.99 (n - 1))` of them are within the limit: each tier drops that many of
   its largest, on its own, beside the counted requests' `k`. A request longer than the
   model's context never runs and is in no tier's p99: left out. Only the prefill: a
   request may keep decoding long after its first token, so its decode is not forced into
   any window.

Windows slide by a quarter of their length from the first arrival to the last deadline, plus
the whole span. Still loose, the largest first:
- No term charges the prefill chunks that share steps with decodes. The engine runs a newly
  admitted prompt's chunk, up to `max_num_batched_tokens`, in one step with every running
  sequence, so each admission onto a replica lengthens a step of every request decoding
  there: on an L40S a 2048-token chunk is a step of about 140 ms against a 50 ms objective. A
  router can only avoid it by admitting in groups and letting them drain, which costs
  replicas of its own; a valid term must weigh the two, and none does yet. On uncached
  prompts this is most of the gap (`tests/capacity/test_lower_bound.py`'s spread stream,
  nothing to route for but balance: bound 6; the simulator's smallest L40S fleets are 20
  under cost-aware and 26 under least load with vLLM's 2048-token steps, 11 and 22 with
  512-token steps, and were 23 and 27 with 8192).
- Requests outside the counted tiers cost only their prefill, and only with
  `kept_up_ttft_s` (term 7); their decodes nothing (a router could park them).
- A step's prefill hides under its decode's memory time, so the terms are a maximum, never
  added.
- 4's D uses lone steps for requests that run past the window, and 5 and 6 only see
  requests whose deadline (at the TPOT objective, not the likely pace) falls inside it.
- Attention and queueing are left out. KV capacity is left out (shared prefixes are held
  once and preempted sequences hold none, so the old per-request Little's-law term did not
  hold).

Not proven: a preempted request's recompute step samples a token without reading its KV,
which 4's inside part, 5 and 6 count as a read (D still holds: the request first waits out a
whole step, at least `a`, more than that read), and so does the sustained floor below (at
most one context's read, K x its context, per preemption).

**The sustained floor** (`sustained_replicas`) is a second figure, of another question: how
many replicas the workload's work needs, every tier's, batch included, per second of its
arrival span, at the engine's best efficiency allowed by the counted tiers' TPOT objectives.
Every request must be served some time, and a fleet serving the traffic continuously must
keep up with it on average, or its queue grows without end whatever the router does. The
bound above counts only what the objectives force into a window and lets a router park every
request outside the counted tiers; on workloads whose decode dominates, that leaves out most
of the work. The floor does not bound a finite run's fleet: a run ending with a backlog can
drain it after its arrivals stop, so a fleet below the floor can look as if it met the SLO
over a short run. It is a steady-state figure: for traffic that goes on (the families are
stationary samples; bursty and diurnal ones repeat), below it no router keeps up within the
SLO, and its mean hides their peaks, so there it is low. What it does bound in any run that
meets the SLO is the steps' total time: at least floor x span.

Derivation, in the notation above. Every step takes at least `t0 + W + K x` its sequences'
contexts and at least `t0 + F x` its computed tokens, so the fleet's steps take at least
each of:
- (memory) `a x m + K x U`, with m steps and U the contexts read by every decode token of
  every tier (prompt + i for the i-th). `m >= D / max_num_seqs`: every decode token is in
  one step, at most `max_num_seqs` a step. And `m >= S1^2 / beta'` over the counted
  requests, term 6 over the whole span: the steps carrying their decodes are at least that
  many (their TPOT budget shares each step's fixed part over a batch whose KV read it also
  pays), and other tiers' decodes only add reads to them.
- (compute) `F x (new + D)`, new the prompt tokens no earlier request's blocks hold.
Their larger over the span from the first arrival to the last is the floor, in replicas,
not rounded. As in 1 and 6, the counted requests that may miss (beyond those no fleet can
serve in time) drop their largest S1 summands, and beta' keeps every one; when more than
that cannot be served in time, the TPOT term is left out (the bound is then None).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import numpy.typing as npt

from serving.engine.perf import PerfModel
from serving.router.contracts import DEFAULT_SLO_TIERS, SloTier

BLOCK_TOKENS = 16  # the gateway's and the simulator's prefix block
SHORT_WINDOWS_S = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0)  # with window_s: bursts show in these
CONTEXT_QUANTILES = (0.0, 0.25, 0.5, 0.75, 0.9)  # the thetas of term 5

Floats = npt.NDArray[np.float64]


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
    """What one counted request asks of the fleet, at least."""

    arrival_s: float
    ttft_s: float  # objective; inf: none
    tpot_s: float  # objective; inf: none
    prompt_tokens: int
    prefill_s: float  # its own prefill on an idle replica (term 1)
    compute_s: float  # its new tokens' FLOPs (term 3)
    decode_tokens: int  # output less the first token
    kv_s: float  # S2: K x the contexts of its decode steps
    kv_root_s: float  # S1: sum of sqrt(K x context) over its decode steps, from below
    lone_decode_s: float  # D: its decode steps run alone


@dataclass(frozen=True, slots=True)
class _Columns:
    """The counted work as arrays, in arrival order."""

    arrival: Floats
    ttft: Floats
    tpot: Floats
    deadline: Floats
    prompt: Floats
    prefill: Floats
    compute: Floats
    tokens: Floats
    kv: Floats
    kv_root: Floats
    lone: Floats

    @classmethod
    def of(cls, works: list[_Work]) -> _Columns:
        def column(name: str) -> Floats:
            return np.array([getattr(w, name) for w in works], dtype=np.float64)

        ttft, tpot, tokens = column("ttft_s"), column("tpot_s"), column("decode_tokens")
        arrival = column("arrival_s")
        return cls(
            arrival=arrival,
            ttft=ttft,
            tpot=tpot,
            deadline=arrival + ttft + tokens * tpot,
            prompt=column("prompt_tokens"),
            prefill=column("prefill_s"),
            compute=column("compute_s"),
            tokens=tokens,
            kv=column("kv_s"),
            kv_root=column("kv_root_s"),
            lone=column("lone_decode_s"),
        )

    def arriving(self, low: float, high: float) -> _Columns:
        """The requests arriving in [low, high) (views, not copies)."""
        rows = slice(*np.searchsorted(self.arrival, (low, high), side="left"))
        return _Columns(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass(frozen=True, slots=True)
class _Engine:
    """The step-time constants the terms use, and the batch cap."""

    fixed_s: float  # a = t0 + W: a decode step's least part without KV
    kv_token_s: float  # K: one context token's KV read
    max_num_seqs: int

    @classmethod
    def of(cls, perf: PerfModel, max_num_seqs: int) -> _Engine:
        return cls(
            fixed_s=perf.step_overhead_s + perf.memory_time_s(0),
            kv_token_s=perf.memory_time_s(1) - perf.memory_time_s(0),
            max_num_seqs=max_num_seqs,
        )


def lower_bound_replicas(
    requests: Iterable[BoundRequest],
    perf: PerfModel,
    *,
    tiers: dict[str, SloTier] | None = None,
    counted_tiers: Sequence[str] | None = None,
    share: float = 0.99,
    window_s: float = 60.0,
    max_num_seqs: int = 256,
    kept_up_ttft_s: float | None = None,
    max_model_len: int | None = None,
) -> int | None:
    """The fewest replicas of `perf`'s class and TP on which any router could meet the SLO
    for `share` of the counted tiers' requests (module docstring); None when none could.
    `counted_tiers` None: every tier with an objective (batch work is left to spare time).
    `kept_up_ttft_s`: every other tier must also keep its TTFT p99 within this (term 7;
    requests longer than `max_model_len` never run and are left out of it)."""
    tiers = tiers or DEFAULT_SLO_TIERS
    requests = list(requests)
    kept_up = (
        _kept_up_work(requests, perf, tiers, counted_tiers, kept_up_ttft_s, max_model_len)
        if kept_up_ttft_s is not None
        else []
    )
    works, infeasible = _counted_work(requests, perf, tiers, counted_tiers)
    counted = len(works) + infeasible
    if counted == 0:
        return 0
    may_miss = _may_miss(share, counted) - infeasible
    if may_miss < 0:
        return None
    if not works:
        return 0
    work = _Columns.of(works)
    engine = _Engine.of(perf, max_num_seqs)
    # A request arriving this long before a window holds no slot in it (term 4).
    held = work.ttft + work.lone
    lookback = float(held[np.isfinite(held)].max(initial=0.0))
    replicas = 1
    kept_up_end = max((float(t.arrival.max()) + t.ttft_s for t in kept_up), default=0.0)
    for low, high in _windows(work, window_s, kept_up_end):
        arrived = work.arriving(low, high)
        replicas = max(
            replicas,
            _prefill_replicas(arrived, low, high, may_miss, kept_up),
            _slot_replicas(work.arriving(low - lookback, high), engine, low, high, may_miss),
            _tpot_replicas(arrived, engine, low, high, may_miss),
            _budget_replicas(arrived, engine, low, high, may_miss),
        )
    return replicas


def sustained_replicas(
    requests: Iterable[BoundRequest],
    perf: PerfModel,
    *,
    tiers: dict[str, SloTier] | None = None,
    counted_tiers: Sequence[str] | None = None,
    share: float = 0.99,
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
) -> float:
    """Replicas of `perf`'s class and TP that every tier's work needs, on average over the
    arrival span, at the engine's best efficiency within the counted tiers' TPOT objectives
    for `share` of their requests (module docstring: the sustained floor; `counted_tiers`
    as `lower_bound_replicas` takes it). A request longer than `max_model_len` (prompt and
    output) never runs, so it asks no work. 0.0 without requests or with all arriving at
    once."""
    ordered = sorted(
        (r for r in requests if max_model_len is None or _length(r) <= max_model_len),
        key=lambda r: r.arrival_s,
    )
    if not ordered:
        return 0.0
    span = ordered[-1].arrival_s - ordered[0].arrival_s
    if span <= 0:
        return 0.0
    seen: set[int] = set()
    new = decode = context = 0.0
    for request in ordered:
        new += max(1, _new_tokens(request, seen))  # the last token is always computed
        tokens = max(0, request.output_tokens - 1)
        decode += tokens
        context += _decode_context(max(1, request.prompt_tokens), tokens)
    engine = _Engine.of(perf, max_num_seqs)
    steps = max(
        decode / max_num_seqs,
        _tpot_steps(ordered, perf, tiers or DEFAULT_SLO_TIERS, counted_tiers, share, engine),
    )
    memory_s = engine.fixed_s * steps + engine.kv_token_s * context
    compute_s = perf.compute_time_s(new + decode)
    return max(memory_s, compute_s) / span


def _length(request: BoundRequest) -> int:
    return request.prompt_tokens + request.output_tokens


def _may_miss(share: float, counted: int) -> int:
    """How many of `counted` requests may miss with `share` of them meeting the SLO."""
    return math.floor((1.0 - share) * counted + 1e-9)


def _decode_context(prompt: int, tokens: int) -> float:
    """The KV tokens `tokens` decode steps read after a `prompt`: prompt + i at step i."""
    return tokens * prompt + tokens * (tokens - 1) / 2


def _tpot_steps(
    requests: Sequence[BoundRequest],
    perf: PerfModel,
    tiers: dict[str, SloTier],
    counted_tiers: Sequence[str] | None,
    share: float,
    engine: _Engine,
) -> float:
    """The fewest steps carrying the counted requests' decodes within their TPOT budget over
    the whole span (term 6's `S1^2 / beta'`); 0 when the SLO cannot be met at all."""
    works, infeasible = _counted_work(requests, perf, tiers, counted_tiers)
    may_miss = _may_miss(share, len(works) + infeasible) - infeasible
    if may_miss < 0:
        return 0.0
    timed = [w for w in works if w.decode_tokens and math.isfinite(w.tpot_s)]
    slack = sum(w.decode_tokens * (w.tpot_s - engine.fixed_s) for w in timed)
    if slack <= 0:
        return 0.0
    kv_root = _less_heaviest(np.array([w.kv_root_s for w in timed]), may_miss)
    return kv_root**2 / slack


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
    t0, weights_s = perf.step_overhead_s, perf.memory_time_s(0)
    kv_token_s = perf.memory_time_s(1) - weights_s
    for request in sorted(requests, key=lambda r: r.arrival_s):
        new_tokens = max(1, _new_tokens(request, seen))  # the last token is always computed
        if not _is_counted(request.tier, tiers, counted_tiers):
            continue
        tier = tiers.get(request.tier)
        ttft = tier.ttft_s if tier is not None and tier.ttft_s is not None else math.inf
        tpot = tier.tpot_s if tier is not None and tier.tpot_s is not None else math.inf
        prompt = max(1, request.prompt_tokens)
        decode_tokens = max(0, request.output_tokens - 1)
        compute_s = perf.compute_time_s(new_tokens)
        prefill_s = t0 + max(weights_s, compute_s)
        lone_step_s = perf.decode_step_s(1, prompt)
        if prefill_s > ttft or (decode_tokens and lone_step_s > tpot):
            infeasible += 1
            continue
        # Decode step i (0-based) reads prompt + i tokens of KV; sqrt's sum from below by
        # its integral over [i - 1, i].
        kv_s = kv_token_s * _decode_context(prompt, decode_tokens)
        top, bottom = prompt + decode_tokens - 1, prompt - 1
        kv_root_s = math.sqrt(kv_token_s) * 2 / 3 * (top**1.5 - bottom**1.5)
        works.append(
            _Work(
                arrival_s=request.arrival_s,
                ttft_s=ttft,
                tpot_s=tpot,
                prompt_tokens=prompt,
                prefill_s=prefill_s,
                compute_s=compute_s,
                decode_tokens=decode_tokens,
                kv_s=kv_s,
                kv_root_s=kv_root_s if decode_tokens else 0.0,
                lone_decode_s=decode_tokens * (t0 + weights_s) + kv_s,
            )
        )
    return works, infeasible


@dataclass(frozen=True, slots=True)
class _KeptUp:
    """Term 7: one tier not counted, its requests' arrivals and new tokens' FLOPs."""

    arrival: Floats
    compute: Floats
    ttft_s: float
    may_miss: int


def _p99_misses(count: int) -> int:
    """How many of `count` values may exceed a limit their p99 is within: numpy's linear
    p99 lies between the values at ranks floor(0.99 (n - 1)) and the next (0-based), so
    that rank's value and all below it are within."""
    return count - 1 - math.floor(0.99 * (count - 1) + 1e-9) if count else 0


def _kept_up_work(
    requests: Sequence[BoundRequest],
    perf: PerfModel,
    tiers: dict[str, SloTier],
    counted_tiers: Sequence[str] | None,
    ttft_s: float,
    max_model_len: int | None,
) -> list[_KeptUp]:
    """Each tier not counted: its requests that can run, with their new tokens' FLOPs (the
    blocks no earlier request of any tier had, as `_counted_work` counts them)."""
    seen: set[int] = set()
    arrivals: dict[str, list[float]] = {}
    computes: dict[str, list[float]] = {}
    for request in sorted(requests, key=lambda r: r.arrival_s):
        new_tokens = max(1, _new_tokens(request, seen))
        counted = _is_counted(request.tier, tiers, counted_tiers)
        if counted or (max_model_len is not None and _length(request) > max_model_len):
            continue
        arrivals.setdefault(request.tier, []).append(request.arrival_s)
        computes.setdefault(request.tier, []).append(perf.compute_time_s(new_tokens))
    return [
        _KeptUp(
            arrival=np.array(arrivals[name], dtype=np.float64),
            compute=np.array(computes[name], dtype=np.float64),
            ttft_s=ttft_s,
            may_miss=_p99_misses(len(arrivals[name])),
        )
        for name in arrivals
    ]


def _is_counted(name: str, tiers: dict[str, SloTier], counted_tiers: Sequence[str] | None) -> bool:
    """Whether a tier's requests are counted: named in `counted_tiers`, or by default any
    tier with an objective."""
    if counted_tiers is not None:
        return name in counted_tiers
    tier = tiers.get(name)
    return tier is not None and (tier.ttft_s is not None or tier.tpot_s is not None)


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


def _windows(
    work: _Columns, window_s: float, whole_until: float = 0.0
) -> Iterator[tuple[float, float]]:
    """Windows of each length up to `window_s`, sliding by a quarter of it from the first
    arrival to the last deadline, then the whole span, and again to `whole_until` if that is
    later."""
    start = float(work.arrival[0])
    ends = np.concatenate([work.deadline, work.arrival + work.ttft, work.arrival + work.prefill])
    end = float(np.max(ends[np.isfinite(ends)]))
    for length in sorted({*(s for s in SHORT_WINDOWS_S if s < window_s), window_s}):
        low = start
        while low + length <= end:
            yield low, low + length
            low += length / 4
    whole = max(end, start + window_s)
    yield start, whole
    if whole_until > whole:
        yield start, whole_until


def _less_heaviest(values: Floats, may_miss: int) -> float:
    """The sum of `values` without its `may_miss` largest (they may be the ones that miss)."""
    if may_miss <= 0 or values.size == 0:
        return float(values.sum())
    if may_miss >= values.size:
        return 0.0
    return float(np.partition(values, values.size - may_miss)[: values.size - may_miss].sum())


def _prefill_replicas(
    work: _Columns, low: float, high: float, may_miss: int, kept_up: Sequence[_KeptUp] = ()
) -> int:
    """Term 3: the new tokens of the requests whose TTFT window lies inside; and term 7's,
    each tier not counted dropping its own largest that may miss."""
    inside = (work.arrival >= low) & (work.arrival + work.ttft <= high)
    compute_s = _less_heaviest(work.compute[inside], may_miss)
    for tier in kept_up:
        within = (tier.arrival >= low) & (tier.arrival + tier.ttft_s <= high)
        compute_s += _less_heaviest(tier.compute[within], tier.may_miss)
    return _ceil(compute_s / (high - low))


def _inside(work: _Columns, low: float, high: float) -> npt.NDArray[np.bool_]:
    """Requests whose whole life, prefill and decode at the TPOT objective, lies inside."""
    return (work.arrival >= low) & (work.deadline <= high)


def _slot_replicas(work: _Columns, engine: _Engine, low: float, high: float, may_miss: int) -> int:
    """Term 4: slot-seconds held in the window against max_num_seqs per replica."""
    span = high - low
    held = work.prefill + work.lone
    latest = work.arrival + work.ttft - work.prefill  # the latest admission meeting TTFT

    def overlap(admitted: Floats) -> Floats:
        return np.minimum(admitted + held, high) - np.maximum(admitted, low)

    with np.errstate(invalid="ignore"):  # no TTFT objective: inf - inf, no overlap known
        overlaps = np.nan_to_num(np.minimum(overlap(work.arrival), overlap(latest)), nan=0.0)
    overlaps = np.maximum(overlaps, 0.0)
    inside = _inside(work, low, high)
    outside = _less_heaviest(overlaps[~inside], may_miss)
    prefills = _less_heaviest(work.prefill[inside], may_miss)
    tokens = _less_heaviest(work.tokens[inside], may_miss)
    kv = _less_heaviest(work.kv[inside], may_miss)
    kv_root = _less_heaviest(work.kv_root[inside], may_miss)
    a, slots = engine.fixed_s, engine.max_num_seqs
    base = outside + prefills + a * tokens
    replicas = max(1, _ceil((base + kv) / (slots * span)), _ceil(kv / span))
    while True:
        free = replicas * span - kv  # the steps' time left for the fixed parts
        if free > 0 and base + max(kv, a * kv_root**2 / free) <= replicas * slots * span:
            return replicas
        replicas += 1


def _tpot_replicas(work: _Columns, engine: _Engine, low: float, high: float, may_miss: int) -> int:
    """Term 5: the decode steps of the requests inside, at the batch their TPOT allows."""
    inside = _inside(work, low, high) & (work.tokens > 0)
    if not inside.any():
        return 0
    a = engine.fixed_s
    replicas = 0
    for tpot in np.unique(work.tpot[inside]):
        tier = inside & (work.tpot == tpot)
        for theta in np.quantile(work.prompt[tier], CONTEXT_QUANTILES):
            chosen = tier & (work.prompt >= theta)
            batch = min(engine.max_num_seqs, (tpot - a) / (engine.kv_token_s * theta))
            seconds = _decode_seconds(
                batch,
                a,
                _less_heaviest(work.tokens[chosen], may_miss),
                _less_heaviest(work.kv[chosen], may_miss),
                _less_heaviest(work.kv_root[chosen], may_miss),
            )
            replicas = max(replicas, _ceil(seconds / (high - low)))
    return replicas


def _budget_replicas(
    work: _Columns, engine: _Engine, low: float, high: float, may_miss: int
) -> int:
    """Term 6: the decode steps of the requests inside, against the time their TPOT
    objectives let them spend in steps together."""
    inside = _inside(work, low, high) & (work.tokens > 0)
    if not inside.any():
        return 0
    a = engine.fixed_s
    tokens = work.tokens[inside]
    slack = float(np.sum(tokens * (work.tpot[inside] - a)))  # beta - a D, every request kept
    if not math.isfinite(slack):
        return 0
    kv = _less_heaviest(work.kv[inside], may_miss)
    kv_root = _less_heaviest(work.kv_root[inside], may_miss)
    fewest_steps = max(kv_root**2 / slack, _less_heaviest(tokens, may_miss) / engine.max_num_seqs)
    return _ceil((a * fewest_steps + kv) / (high - low))


def _decode_seconds(batch: float, a: float, tokens: float, kv: float, kv_root: float) -> float:
    """The least S with `batch x S >= a x tokens + a x kv_root^2 / (S - kv)` and
    `batch x S >= a x tokens + kv` (term 5): the larger root of the quadratic."""
    middle = batch * kv + a * tokens
    constant = a * (tokens * kv - kv_root**2)
    root = (middle + math.sqrt(max(0.0, middle**2 - 4 * batch * constant))) / (2 * batch)
    return max(root, (a * tokens + kv) / batch)


def _ceil(value: float) -> int:
    return math.ceil(value - 1e-9)
