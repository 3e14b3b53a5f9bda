"""Predicted TTFT, TPOT and cost of one request on one replica.

With `load = max(running + waiting, inflight)` (telemetry lags; the in-flight count is a
fresh lower bound on what the replica holds), `B = max_num_seqs` and
`K = max_num_batched_tokens`. The in-flight counts are every gateway's: the gateways tell
each other of every request they send (serving/gateway/inflight_sync.py). What this one
sent that the others do not know of yet (`unsynced`, a few milliseconds' worth) each of
the other `RouterConfig.gateways` - 1, routing on the same view meanwhile, is assumed to
have sent as well, so `inflight` and `prefill_pending_tokens` below include it that many
times over (with Redis away nothing syncs, and that is all of this gateway's own).

    batch       = min(load, B)                   sequences decoding beside ours
    ahead       = prefill_pending_tokens         prompts sent there not yet prefilled
                + max(0, waiting - inflight) * assumed_queued_prompt_tokens
                                                 (queued requests of other gateways)
                - carried                        the chunk the step in progress carries
                                                 (at most K - waits), when decodes run
                                                 and a seat is free
    queued      = ahead / mean prompt sent there (ours, with none sent)
    first       = max(running, load - queued)    decoding while ours waits: the prompts
                                                 ahead are queued, not decoding
    last        = min(batch, first + queued - finish rate * wait(first))
                                                 after the wait, each admitted prompt
                                                 decoding until it finishes
    waits       = (first + last) / 2 (batch when no prompt is queued)
    room        = K - waits                      prompt tokens a step leaves the prompts
    compute(n)  = compute_base_s + prefill_s_per_token * n    a step computing n tokens
    prefill(n)  = n // room steps of max(step(waits) if waits else decode_base_s,
                  compute(K)), and one of the rest, max(same, compute(waits + rest))
    TTFT        = ((the longer of the decode step and compute(waits + carried) if waits
                   else 0)                       wait for the step boundary
                + prefill(ahead + prompt_tokens - cached_prefix_tokens)
                + (adapter_load_s if the adapter is not resident)
                + (load - B + 1) / finish rate)  when the batch is full: wait for a slot
                * ttft_scale                     learned there (below)
    rate        = prompt tokens sent here per second, ours included (see below)
    chunk       = min(K, max(rate / prefills sent per second, prefill queued now + ours))
    mixed       = max(step, compute(chunk + batch + 1))
    share       = min(max_prefill_share, rate / chunk * mixed)   time in mixed steps
    kv          = max(kv_usage * kv_capacity_tokens, batch * context per sequence)
                + prompt_tokens                  (context per sequence: the in-flight
                                                 prompts there on average, or ours)
    step        = decode_base_s + decode_s_per_seq * (batch + 1)
                + decode_s_per_kv_token * max(0, kv - (batch + 1) * typical_context_tokens)
                                                 (step(n): the same with n for batch)
    TPOT        = 1 / (share / mixed + (1 - share) / step)     (step when mixed = step)

Counted among the decodes, as they were, the prompts queued on a deep queue made every
step of the wait read their contexts too and left their tokens of the budget unused: on
code over 16 L40S the batch tier gathered on one replica was predicted 12.1 s to its first
token at the median where the engine gave 6.0.

`ttft_scale` is the replica's calibration, learned online (`RouterState.observe_ttft`): at
each first token of a request this gateway sent there, a step of a running quantile
(`RouterConfig.ttft_quantile`, 0.98) of the observed TTFT over the one predicted without the
scale. The model is the engine's expectation; the scale turns it into a high quantile of
what that replica really does, and is the safety margin the least-bad path (which accepts
a prediction up to the objective) relies on. It learns what the model leaves out: a prefix
the engine's cache evicted while the prompt queued (the router's index refreshes a
prompt's blocks when it sends it, the engine's cache when it admits it: behind a deep queue
chat's gathering replicas computed up to 39 % more than expected), a kernel faster or
slower than the fit, a real engine rather than the simulator's.

A full batch (`load >= B`) admits a new sequence only when one finishes: the wait is the
sequences queued ahead of ours over the rate at which the replica finishes them, the
decayed rate of the finishes counted there scaled up by `load / inflight` (the share of
the replica's load the counts hold); with no finish seen yet it is left out.

vLLM gives each running decode its token before any prompt gets one, so the prompts share
K - batch tokens a step, and a step that carries decodes lasts at least their decode step
(weights and KV read): prefill queued behind a busy batch moves at the slower of its compute
and the decodes' pace, not at the prefill rate of an idle engine. The cached prefix is what
the router's prefix index credits the replica with, which forgets what the replica's KV
cannot hold (`PrefixIndex.hold_at_most`).

The engine schedules chunked prefill FIFO, so prompts ahead of ours delay our first token,
and prompts arriving after ours share our decode steps. vLLM schedules the running decodes
first and fills the step's token budget K with prefill ("First, schedule the RUNNING
requests", then the waiting ones: `Scheduler.schedule` in vllm/v1/core/sched/scheduler.py,
vLLM 0.32), so a mixed step advances every decode by a token and takes the longer of the
decode's memory time and the chunk's compute: a prompt whose chunk computes within the
decode step costs nothing per token, and a long one stretches the steps it rides in. A
chunk is the mean prompt sent here, or the prefill queued now when more (queued prompts go
in together), at most K. The rates are exponentially decayed counts (every gateway's) of
prompt tokens and of prefills sent (see `RouterState.request_started`), corrected for
their warm-up like the finish rate: a first burst is a burst, not a fifth of one.

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
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
    RouteRequest,
)


class Prediction(NamedTuple):
    ttft_s: float
    tpot_s: float
    cost_usd: float


def decay_factor(at: float, now: float) -> float:
    """What an exponentially decayed average last updated at `at` keeps of itself at `now`."""
    elapsed = now - at
    if elapsed <= 0.0:
        return 1.0
    return math.exp(-elapsed / PROMPT_RATE_WINDOW_S)


def _decayed(value: float, at: float, now: float) -> float:
    """An exponentially decayed average last updated at `at`, as of `now`."""
    if not value:
        return value
    return value * decay_factor(at, now)


def decayed_finish_count(replica: ReplicaState, now: float) -> float:
    """The replica's decayed finish average as stored (no warm-up correction), at `now`."""
    return _decayed(replica.finish_rate, replica.finish_rate_at, now)


def warm_up(replica: ReplicaState, now: float) -> float:
    """The correction of the replica's decayed averages for their warm-up: over the `t`
    seconds since this gateway first sent it a request a decayed sum has seen only
    `1 - exp(-t / window)` of a full window, so it is divided by that. Uncorrected, the
    finish rate would start near 0 and predict slot waits of minutes, and the prompt rate
    would start near 0 and predict no prefill in the decodes of the first burst."""
    since = replica.finish_rate_since
    if not since:
        return 1.0
    observed = now - since
    if observed >= 10.0 * PROMPT_RATE_WINDOW_S:
        return 1.0
    seen = 1.0 - math.exp(-observed / PROMPT_RATE_WINDOW_S)
    return 1.0 / seen if seen > 0.0 else 1.0


def decayed_finish_rate(replica: ReplicaState, now: float) -> float:
    """This gateway's requests finished per second on the replica, decayed to `now` and
    corrected for the average's warm-up (`warm_up`)."""
    rate = decayed_finish_count(replica, now)
    if not rate:
        return 0.0
    return rate * warm_up(replica, now)


def predict(
    replica: ReplicaState,
    request: RouteRequest,
    now: float,
    config: RouterConfig,
    cached_blocks: int = 0,
) -> Prediction:
    return RequestPredictor(request, now, config).predict(replica, cached_blocks)


class RequestPredictor:
    """`predict` for one request at one instant, on one replica after another, with the
    request's and the config's terms looked up once (the cost-aware policy predicts for many
    candidates per decision): `new_tokens`, the prompt left to prefill past a cached prefix,
    then `latency`, which can stop at the decode step when that alone is too slow."""

    __slots__ = (
        "adapter",
        "adapter_load_s",
        "block_tokens",
        "gateways",
        "kv_inflation",
        "max_share",
        "max_tokens",
        "now",
        "prompt_tokens",
        "queued_tokens",
        "stale_after_s",
        "stale_penalty",
        "step_bounds_tpot",
        "uncached_tokens",
        "watermark",
    )

    def __init__(self, request: RouteRequest, now: float, config: RouterConfig) -> None:
        self.now = now
        self.prompt_tokens = prompt_tokens = request.prompt_tokens
        self.uncached_tokens = prompt_tokens if prompt_tokens >= 1 else 1
        self.max_tokens = request.max_tokens
        self.adapter = request.adapter
        self.block_tokens = config.prefix_block_tokens
        self.queued_tokens = config.assumed_queued_prompt_tokens
        self.adapter_load_s = config.adapter_load_s
        self.max_share = config.max_prefill_share
        self.watermark = config.kv_high_watermark
        self.kv_inflation = config.kv_inflation
        self.stale_after_s = config.stale_after_s
        self.stale_penalty = config.stale_penalty
        self.gateways = config.gateways
        # TPOT is at least the decode step while the prefill share stays in [0, 1) and the
        # KV and staleness factors are at least 1 (the replica's part is checked per replica).
        self.step_bounds_tpot = (
            config.max_prefill_share < 1.0
            and config.kv_inflation >= 0.0
            and config.stale_penalty >= 1.0
        )

    def predict(self, replica: ReplicaState, cached_blocks: int = 0) -> Prediction:
        new_tokens = self.new_tokens(cached_blocks)
        terms = self.latency(replica, new_tokens)
        assert terms is not None  # no step limit: always predicted
        ttft, tpot, factor, batch = terms
        perf = replica.perf
        own_prefill = perf.prefill_base_s + perf.prefill_s_per_token * new_tokens
        gpu_seconds = own_prefill + self.max_tokens * tpot / (batch + 1)
        return Prediction(
            ttft * factor, tpot * factor, replica.price_per_hour / 3600.0 * gpu_seconds * factor
        )

    def new_tokens(self, cached_blocks: int) -> int:
        """The prompt tokens to prefill past `cached_blocks` (`uncached_tokens` for none)."""
        new_tokens = self.prompt_tokens - cached_blocks * self.block_tokens
        return new_tokens if new_tokens >= 1 else 1

    def latency(
        self, replica: ReplicaState, new_tokens: int, step_limit: float = math.inf
    ) -> tuple[float, float, float, int] | None:
        """(TTFT, TPOT, factor, batch): TTFT and TPOT before the factor both take for the
        replica's KV pressure and its telemetry's age, and the batch the request joins. None,
        predicting no further, when the decode step it joins is over `step_limit`, and so,
        provably, is its TPOT."""
        perf = replica.perf
        # What we know of, and as many again from each other gateway as we sent that they
        # do not know of yet (on the same view, they send where we do).
        others = self.gateways - 1
        inflight = replica.inflight + replica.unsynced * others
        waiting = replica.waiting
        load = replica.running + waiting
        if inflight > load:
            load = inflight
        batch = load if load < perf.max_num_seqs else perf.max_num_seqs
        # The KV a step reads, every sequence's whole context (a shared prefix once per
        # sequence, so the scraped KV use, shared blocks once, is only a floor): that of the
        # requests in flight there a sequence, or, with none, ours.
        if inflight and replica.inflight_context_tokens:
            per_sequence = replica.inflight_context_tokens / replica.inflight
        else:
            per_sequence = float(self.prompt_tokens)
        scraped_kv = replica.kv_usage * perf.kv_capacity_tokens
        decode_step = self.decode_step_s(perf, batch, per_sequence, scraped_kv)
        per_token = perf.prefill_s_per_token
        if (
            decode_step > step_limit
            and self.step_bounds_tpot
            and per_token >= 0.0
            and replica.prompt_rate >= 0.0
        ):
            return None

        # The prompts queued there.
        ahead = replica.prefill_pending_tokens + replica.unsynced_prefill_tokens * others
        if waiting > inflight:
            ahead += (waiting - inflight) * self.queued_tokens
        decay = decay_factor(replica.prompt_rate_at, self.now) * warm_up(replica, self.now)
        prompts = replica.prompt_rate * decay + new_tokens / PROMPT_RATE_WINDOW_S
        prefills = replica.prefill_rate * decay + 1.0 / PROMPT_RATE_WINDOW_S
        finished = -1.0  # not looked up yet
        # While ours waits, the prompts ahead of it are queued, not decoding (as many as
        # their tokens make prompts of the mean size sent here, or of ours with none sent):
        # the steps start with the load less them (at least the running the telemetry
        # saw), which each admission grows and each finish shrinks, and are counted at
        # their mean, first and last, the last after the wait at the first.
        waiting_batch = batch
        waiting_step = decode_step
        queued = 0
        if ahead and batch:
            if replica.prefill_rate > 0.0 and replica.prompt_rate > 0.0:
                queued = int(ahead * replica.prefill_rate / replica.prompt_rate)
            else:
                queued = ahead // new_tokens
        if queued > 0:
            first = load - queued if load > queued else 0
            if first < replica.running:
                first = replica.running
            if first < batch:
                first_step = self.decode_step_s(perf, first, per_sequence, scraped_kv)
                wait = prefill_steps_s(perf, ahead + new_tokens, first, first_step)
                finished = self.finish_rate(replica, load)
                last = first + queued - finished * wait
                if last > batch:
                    last = float(batch)
                elif last < 0.0:
                    last = 0.0
                waiting_batch = int((first + last) / 2.0)
                if waiting_batch < batch:
                    waiting_step = self.decode_step_s(perf, waiting_batch, per_sequence, scraped_kv)
                else:
                    waiting_batch = batch
        carried = 0
        if ahead and waiting_batch and waiting_batch < perf.max_num_seqs:
            # The step in progress already carries a chunk of it (the budget the decodes
            # leave), which the wait for the step boundary below covers: a prompt leaves
            # the pending count only at its first token, when its last step ends.
            carried = perf.max_num_batched_tokens - waiting_batch
            if carried > ahead:
                carried = ahead
            ahead -= carried
        to_prefill = ahead + new_tokens
        # Each step gives every running decode its token first and the prompts the rest of
        # the budget K, and takes at least the batch's decode step: prefill advances by
        # K - batch tokens a step, at the pace of its compute or of the decodes, the slower.
        # A step computes its decodes' tokens and its chunk's while it reads the weights and
        # the decodes' KV, and lasts the longer: at least the decode step, or with no decode
        # the weights' read (decode_base_s).
        floor = waiting_step if waiting_batch else perf.decode_base_s
        ttft = prefill_steps_s(perf, to_prefill, waiting_batch, floor)
        if waiting_batch:
            # The step in progress: its decodes, and the chunk it carries when it computes
            # longer than they read.
            boundary = perf.decode_base_s + perf.decode_s_per_seq * waiting_batch
            if carried:
                chunk_step = perf.compute_base_s + per_token * (waiting_batch + carried)
                if chunk_step > boundary:
                    boundary = chunk_step
            ttft += boundary
        if load >= perf.max_num_seqs:
            if finished < 0.0:
                finished = self.finish_rate(replica, load)
            if finished > 0.0:
                ttft += (load - perf.max_num_seqs + 1) / finished
        adapter = self.adapter
        if adapter is not None and adapter not in replica.adapters_loaded:
            ttft += self.adapter_load_s

        # Prefill rides in mixed steps: each carries every running decode, ours included,
        # and one chunk of the prompts sent here (their mean size, ours counted, at most K),
        # and takes at least the decode step. Such steps fill the share `s` of the time
        # their compute needs; ours advances one token a step either way.
        chunk = prompts / prefills
        if chunk < to_prefill:
            chunk = float(to_prefill)  # prompts queued now go in together
        if chunk > perf.max_num_batched_tokens:
            chunk = float(perf.max_num_batched_tokens)
        mixed_step = perf.compute_base_s + per_token * (chunk + batch + 1)
        if mixed_step > decode_step:
            share = prompts / chunk * mixed_step
            if share > self.max_share:
                share = self.max_share
            tpot = 1.0 / (share / mixed_step + (1.0 - share) / decode_step)
        else:
            tpot = decode_step

        factor = 1.0
        kv_usage, watermark = replica.kv_usage, self.watermark
        if kv_usage > watermark:
            over = (kv_usage - watermark) / (1.0 - watermark)
            factor += self.kv_inflation * min(over, 1.0)
        if self.now - replica.telemetry_at > self.stale_after_s:
            factor *= self.stale_penalty
        return ttft * replica.ttft_scale, tpot, factor, batch

    def decode_step_s(
        self, perf: ReplicaPerf, batch: int, per_sequence: float, scraped_kv: float
    ) -> float:
        """A step of `batch` running decodes and ours: the weights' read, a term a sequence,
        and the KV read past the fit's typical context (`batch` sequences of `per_sequence`
        tokens, at least the scraped use, and our prompt)."""
        step = perf.decode_base_s + perf.decode_s_per_seq * (batch + 1)
        per_kv_token = perf.decode_s_per_kv_token
        if per_kv_token:
            kv_tokens = batch * per_sequence
            if scraped_kv > kv_tokens:
                kv_tokens = scraped_kv
            excess = kv_tokens + self.prompt_tokens - (batch + 1) * perf.typical_context_tokens
            if excess > 0:
                step += per_kv_token * excess
        return step

    def finish_rate(self, replica: ReplicaState, load: int) -> float:
        """Requests finishing per second on the replica: this gateway's decayed rate there,
        scaled to the whole `load` (our share of it is ours); 0 with none seen yet."""
        finished = decayed_finish_rate(replica, self.now)
        if finished > 0.0 and replica.inflight:
            finished *= load / replica.inflight
        return finished


def prefill_steps_s(perf: ReplicaPerf, tokens: int, batch: int, floor: float) -> float:
    """`tokens` of prompt prefilled beside `batch` running decodes: steps of K - batch prompt
    tokens (at least one), each computing its decodes' tokens and its chunk's and lasting
    at least `floor` (the decode step, or the weights' read with no decode)."""
    room = perf.max_num_batched_tokens - batch
    if room < 1:
        room = 1
    full_steps = tokens // room
    last = tokens - full_steps * room
    per_token = perf.prefill_s_per_token
    compute_base = perf.compute_base_s + per_token * batch
    full = compute_base + per_token * room
    seconds = full_steps * (full if full > floor else floor)
    if last:
        tail = compute_base + per_token * last
        seconds += tail if tail > floor else floor
    return seconds


def idle_prefill_s(perf: ReplicaPerf, tokens: int) -> float:
    """An idle engine's prefill of `tokens`, in steps of `max_num_batched_tokens`: each the
    longer of its compute and the weights' read (`decode_base_s`), as `latency` counts the
    steps of a replica with no decode running."""
    return prefill_steps_s(perf, tokens if tokens >= 1 else 1, 0, perf.decode_base_s)


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
