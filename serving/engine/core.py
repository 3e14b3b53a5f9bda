"""One vLLM engine (v1 scheduler semantics) as plain Python, on a clock the caller injects.

Two ways to drive it, which give the same results:

* ``step(now_s)`` runs exactly one engine step starting at ``max(now_s, clock_s)`` and reports
  what every request did in it. The engine simulator uses it in real time, because it streams
  each token as it is produced.
* ``advance(until_s)`` runs every step that starts before ``until_s`` and returns only the
  events (first token, finish, preemption) with their virtual timestamps. When the batch is
  pure decode and nothing can join it (no admissible waiting request, no finish, no KV
  allocation failure), the run of identical steps is computed in closed form instead of one by
  one. Token counts per request are exact; timestamps agree with stepping up to float rounding.
  The cluster simulator calls ``advance(t)`` before ``add_request`` at time ``t``.

``next_event_s()`` says when the engine next needs attention if nothing new arrives: the end of
the current pure-decode run (a finish or a KV allocation failure), or the end of the next step
otherwise. It never lies past the next event.

Scheduling follows vLLM v1: running requests first (decodes and unfinished prefill chunks, in
admission order, within the ``max_num_batched_tokens`` budget), preempting the newest running
request by recompute when a KV block cannot be allocated; then, only if nothing was preempted,
waiting requests in FIFO order (preempted ones return to the front). A request whose LoRA
adapter is not active while all ``max_loras`` slots are taken is skipped and keeps its place; a
request whose blocks do not fit stops admission for this step.

Roles, for disaggregated prefill and decode (`role`):

* ``colocated`` (the default): prefill and decode on one engine, as above.
* ``prefill``: every request stops after its first token (what vLLM's disaggregated proxy
  asks of a prefill instance, ``max_tokens=1``); its KV then goes to a decode engine. The
  blocks are freed at the finish: vLLM's NIXL connector keeps them until the decode side has
  read them, milliseconds on a fast link, which this model leaves out.
* ``decode``: requests arrive with their prompt's KV on the way (``add_request(...,
  kv_ready_s=...)``). A request waits in the FIFO queue until its prompt's blocks fit, then
  holds them while the KV lands (as vLLM's decode side allocates before it pulls); from the
  first step starting at or after ``kv_ready_s`` it runs, computing only the last prompt
  token (vLLM recomputes it to sample) and then decoding. If its blocks are reserved later
  than the simulator assumed when it booked the link, the transfer is taken to start at the
  reservation (``kv_transfer_s`` after it). A preempted request recomputes its whole
  context locally, as vLLM does.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from serving.engine.perf import PerfModel

FIRST_TOKEN = "first_token"
FINISHED = "finished"
PREEMPTED = "preempted"

COLOCATED = "colocated"
PREFILL = "prefill"
DECODE = "decode"
ROLES: tuple[str, ...] = (COLOCATED, PREFILL, DECODE)

# vLLM's labels of vllm:prompt_tokens_by_source (vllm/v1/metrics/stats.py PromptTokenStats).
LOCAL_COMPUTE = "local_compute"
LOCAL_CACHE_HIT = "local_cache_hit"
EXTERNAL_KV_TRANSFER = "external_kv_transfer"
PROMPT_TOKEN_SOURCES: tuple[str, ...] = (LOCAL_COMPUTE, LOCAL_CACHE_HIT, EXTERNAL_KV_TRANSFER)


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    block_hashes: tuple[int, ...] = ()
    lora: str | None = None
    priority: int = 0
    # Emulates EOS: the request stops (finish reason "stop") after this many output tokens.
    stop_after: int | None = None
    # Prompt tokens a KV connector loads from elsewhere (a remote prefill's KV) instead of
    # computing them, beyond the local prefix-cache hit; honoured at first admission only.
    external_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineEvent:
    kind: str  # FIRST_TOKEN, FINISHED or PREEMPTED
    request_id: str
    time_s: float
    output_tokens: int
    finish_reason: str | None = None


@dataclass(slots=True)
class StepResult:
    started_s: float
    duration_s: float
    # request_id -> tokens produced in this step (one per sampled request).
    tokens: dict[str, int] = field(default_factory=dict)
    first_token: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # request_id -> seconds from arrival to first scheduling, for requests scheduled first here.
    queue_time_s: dict[str, float] = field(default_factory=dict)
    # request_id -> total output tokens, for the requests in `finished`.
    finished_output_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> prompt tokens not computed here (prefix-cache hits plus KV loaded from
    # elsewhere), for the requests in `first_token`.
    cached_prompt_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def ended_s(self) -> float:
        return self.started_s + self.duration_s


@dataclass(frozen=True, slots=True)
class RequestProgress:
    request_id: str
    output_tokens: int
    first_token_s: float | None
    finished_s: float | None
    finish_reason: str | None
    preemptions: int


class _Sequence:
    __slots__ = (
        "blocks",
        "cache_hit_tokens",
        "computed",
        "external_tokens",
        "finish_reason",
        "finished_s",
        "first_scheduled_s",
        "first_token_s",
        "kv_ready_s",
        "kv_transfer_s",
        "limit",
        "limit_reason",
        "output",
        "preemptions",
        "req",
        "shared",
    )

    def __init__(self, req: EngineRequest, output_cap: int | None = None) -> None:
        self.req = req
        self.computed = 0  # tokens whose KV is in the cache
        self.output = 0  # tokens sampled so far (kept across preemptions)
        self.shared: list[int] = []  # prefix-cache block hashes this sequence references
        self.blocks = 0  # KV blocks held, shared ones included
        stop = req.stop_after if req.stop_after is not None else req.max_tokens
        self.limit = min(req.max_tokens, stop)
        if output_cap is not None and output_cap < self.limit:
            self.limit = output_cap
        self.limit_reason = "stop" if stop < req.max_tokens else "length"
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.finish_reason: str | None = None
        self.preemptions = 0
        # Decode role: when the prompt's KV lands (None once it is local) and how long its
        # transfer takes, should the blocks be reserved late.
        self.kv_ready_s: float | None = None
        self.kv_transfer_s = 0.0
        # Where the prompt's KV came from at first admission, for prompt_tokens_by_source.
        self.cache_hit_tokens = 0
        self.external_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.output

    def progress(self) -> RequestProgress:
        return RequestProgress(
            self.req.request_id,
            self.output,
            self.first_token_s,
            self.finished_s,
            self.finish_reason,
            self.preemptions,
        )


class Engine:
    def __init__(
        self,
        perf: PerfModel,
        *,
        max_model_len: int = 8192,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_loras: int = 0,
        kv_capacity_tokens: int | None = None,
        clock_s: float = 0.0,
        role: str = COLOCATED,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown engine role {role!r}; use one of {', '.join(ROLES)}")
        self.role = role
        capacity = perf.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
        self.perf = perf
        self.block_size = block_size
        self.total_blocks = capacity // block_size
        if self.total_blocks * block_size < max_model_len:
            # vLLM refuses to start in this case too; without it one request could never run.
            raise ValueError(
                f"max_model_len {max_model_len} needs {math.ceil(max_model_len / block_size)} KV "
                f"blocks but the cache holds {self.total_blocks} ({capacity} tokens)"
            )
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.max_loras = max_loras
        self.clock_s = clock_s

        self._running: list[_Sequence] = []
        self._waiting: deque[_Sequence] = deque()
        # Decode role: requests holding their blocks while their KV is on the wire.
        self._receiving: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._used_blocks = 0  # blocks referenced by running sequences
        self._cache: dict[int, int] = {}  # block hash -> references from running sequences
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, LRU first
        self._lora_refs: dict[str, int] = {}

        # Step-time constants, so hot loops do arithmetic and no attribute chains.
        self._t0 = perf.step_overhead_s
        self._weights_s = perf.memory_time_s(0)
        self._kv_token_s = perf.memory_time_s(1) - self._weights_s
        self._token_flop_s = perf.compute_time_s(1)
        self._attention_unit_s = perf.compute_time_s(0, 1.0)

        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        # vLLM's prompt_tokens_by_source: every prompt token once, at its first output token.
        self.prompt_tokens_by_source: dict[str, int] = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        self.finished_total: dict[str, int] = {"length": 0, "stop": 0, "abort": 0}
        # Seconds of the roofline's compute and memory terms over every step so far: over
        # wall time, how much of the GPU's (efficiency-scaled) FLOPS and bandwidth was used.
        self.compute_s_total = 0.0
        self.memory_s_total = 0.0

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self, req: EngineRequest, *, kv_ready_s: float | None = None, kv_transfer_s: float = 0.0
    ) -> None:
        """`kv_ready_s` (decode role only, and required there): when the prompt's KV lands;
        `kv_transfer_s`: the transfer's length, should the blocks be reserved later than
        `kv_ready_s - kv_transfer_s`."""
        if (kv_ready_s is None) == (self.role == DECODE):
            raise ValueError(
                "a decode engine needs kv_ready_s (when the KV lands); other roles compute it"
            )
        if req.request_id in self._by_id:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        if req.prompt_tokens < 1 or req.max_tokens < 1:
            raise ValueError("a request needs at least one prompt token and one output token")
        output_cap = 1 if self.role == PREFILL else None
        if req.prompt_tokens + (output_cap or req.max_tokens) > self.max_model_len:
            raise ValueError(
                f"prompt ({req.prompt_tokens}) plus max_tokens ({req.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if req.lora is not None and self.max_loras < 1:
            raise ValueError("LoRA is not enabled on this engine")
        if not self.has_work:
            # An idle engine does not step, so its clock jumps to the arrival.
            self.clock_s = max(self.clock_s, req.arrival_s)
        seq = _Sequence(req, output_cap)
        if kv_ready_s is not None:
            seq.kv_ready_s = kv_ready_s
            seq.kv_transfer_s = kv_transfer_s
        self._by_id[req.request_id] = seq
        self._waiting.append(seq)

    def copy(self) -> Engine:
        """An engine in this one's state that shares nothing mutable with it: what it would
        do next can be run on the copy (`bench/lookahead.py`'s router runs every replica's
        forward) and leaves this one as it was."""
        twin = copy.copy(self)
        sequences: dict[int, _Sequence] = {}
        for seq in self._by_id.values():
            clone = copy.copy(seq)
            clone.shared = list(seq.shared)
            sequences[id(seq)] = clone
        twin._by_id = {rid: sequences[id(seq)] for rid, seq in self._by_id.items()}
        twin._running = [sequences[id(seq)] for seq in self._running]
        twin._waiting = deque(sequences[id(seq)] for seq in self._waiting)
        twin._receiving = [sequences[id(seq)] for seq in self._receiving]
        twin._cache = dict(self._cache)
        twin._evictable = OrderedDict(self._evictable)
        twin._lora_refs = dict(self._lora_refs)
        twin.prompt_tokens_by_source = dict(self.prompt_tokens_by_source)
        twin.finished_total = dict(self.finished_total)
        return twin

    def abort(self, request_id: str) -> bool:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self._waiting:
            self._waiting.remove(seq)
        elif seq in self._receiving:
            self._receiving.remove(seq)
            self._release(seq)
        else:
            self._running.remove(seq)
            self._release(seq)
        self.finished_total["abort"] += 1
        return True

    def progress(self, request_id: str) -> RequestProgress | None:
        seq = self._by_id.get(request_id)
        return None if seq is None else seq.progress()

    # --- stats -----------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._receiving)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        # Requests whose KV is still landing wait too, as vLLM counts them.
        return len(self._waiting) + len(self._receiving)

    @property
    def kv_usage(self) -> float:
        # Like vLLM, cached blocks nobody references count as free: they are evictable.
        return self._used_blocks / self.total_blocks

    @property
    def running_loras(self) -> list[str]:
        return sorted(self._lora_refs)

    @property
    def waiting_loras(self) -> list[str]:
        return sorted({s.req.lora for s in self._waiting if s.req.lora is not None})

    # --- KV blocks -------------------------------------------------------------------------

    def _free_blocks(self) -> int:
        return self.total_blocks - self._used_blocks

    def _allocate(self, count: int) -> None:
        unreferenced = self.total_blocks - self._used_blocks - len(self._evictable)
        for _ in range(count - unreferenced):
            evicted, _ = self._evictable.popitem(last=False)
            del self._cache[evicted]
        self._used_blocks += count

    def _release(self, seq: _Sequence) -> None:
        # Tail blocks first, as vLLM frees them, so the shared head of a prefix is evicted last.
        for block_hash in reversed(seq.shared):
            refs = self._cache[block_hash] - 1
            self._cache[block_hash] = refs
            if refs == 0:
                self._evictable[block_hash] = None
                self._used_blocks -= 1
        self._used_blocks -= seq.blocks - len(seq.shared)
        seq.shared = []
        seq.blocks = 0
        lora = seq.req.lora
        if lora is not None:
            refs = self._lora_refs[lora] - 1
            if refs:
                self._lora_refs[lora] = refs
            else:
                del self._lora_refs[lora]

    def _cached_prefix(self, seq: _Sequence) -> list[int]:
        if not self.enable_prefix_caching or seq.computed:
            return []
        # vLLM always computes the last prompt token, so a full hit stops one block short.
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.req.block_hashes[:limit]:
            if block_hash not in self._cache:
                break
            hits.append(block_hash)
        return hits

    def _register_computed_blocks(self, seq: _Sequence) -> None:
        """Publish the sequence's newly completed prompt blocks in the prefix cache."""
        hashes = seq.req.block_hashes
        full = min(len(hashes), seq.computed // self.block_size)
        while len(seq.shared) < full:
            block_hash = hashes[len(seq.shared)]
            refs = self._cache.get(block_hash)
            if refs is None:
                self._cache[block_hash] = 1  # our private block becomes the cached copy
            else:
                # Computed concurrently by another request: share that copy, free ours.
                if refs == 0:
                    del self._evictable[block_hash]
                else:
                    self._used_blocks -= 1
                self._cache[block_hash] = refs + 1
            seq.shared.append(block_hash)

    # --- scheduling ------------------------------------------------------------------------

    def _preempt(self, seq: _Sequence, result: StepResult) -> None:
        self._release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions_total += 1
        self._waiting.appendleft(seq)
        result.preempted.append(seq.req.request_id)

    def _lora_blocked(self, seq: _Sequence) -> bool:
        lora = seq.req.lora
        return (
            lora is not None
            and lora not in self._lora_refs
            and len(self._lora_refs) >= self.max_loras
        )

    def _external_tokens(self, seq: _Sequence, hit_tokens: int) -> int:
        """Prompt tokens a connector loads beyond the local hit: only at first admission (a
        preempted request recomputes its context, as vLLM's connector loads once)."""
        if seq.first_scheduled_s is not None:
            return 0
        return max(0, min(seq.req.external_tokens, seq.req.prompt_tokens) - hit_tokens)

    def _admission_start(self, seq: _Sequence, hits: list[int]) -> tuple[int, int]:
        """(tokens already in the cache at admission, those of them loaded from elsewhere).
        A prompt loaded whole still has its last token computed, to sample from (vLLM)."""
        hit_tokens = len(hits) * self.block_size
        external = self._external_tokens(seq, hit_tokens)
        return min(hit_tokens + external, seq.num_tokens - 1), external

    def _admission_blocks(self, hits: list[int], start: int, chunk: int) -> tuple[int, int]:
        """(new blocks to allocate, cached hit blocks that are evictable today), for `chunk`
        tokens computed after the first `start`."""
        new_blocks = math.ceil((start + chunk) / self.block_size) - len(hits)
        revived = sum(1 for h in hits if self._cache[h] == 0)
        return new_blocks, revived

    def _schedule_running(
        self, budget: int, result: StepResult
    ) -> tuple[list[tuple[_Sequence, int]], int]:
        scheduled: list[tuple[_Sequence, int]] = []
        running = self._running
        block = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.computed, budget)
            need = -(-(seq.computed + n) // block) - seq.blocks
            while need > self._free_blocks():
                victim = running.pop()
                self._preempt(victim, result)
                if victim is seq:
                    break
            if i >= len(running):  # seq itself was preempted
                break
            if need > 0:
                self._allocate(need)
                seq.blocks += need
            scheduled.append((seq, n))
            budget -= n
            i += 1
        return scheduled, budget

    def _schedule_waiting(
        self, budget: int, now_s: float, result: StepResult, scheduled: list[tuple[_Sequence, int]]
    ) -> None:
        skipped: list[_Sequence] = []
        waiting = self._waiting
        while waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = waiting[0]
            if seq.kv_ready_s is not None:
                if not self._reserve_remote(seq, now_s):
                    break
                waiting.popleft()
                continue
            if self._lora_blocked(seq):
                skipped.append(waiting.popleft())
                continue
            hits = self._cached_prefix(seq)
            start, external = self._admission_start(seq, hits)
            chunk = min(seq.num_tokens - start, budget)
            new_blocks, revived = self._admission_blocks(hits, start, chunk)
            if new_blocks + revived > self._free_blocks():
                break
            waiting.popleft()
            for block_hash in hits:
                refs = self._cache[block_hash]
                if refs == 0:
                    del self._evictable[block_hash]
                    self._used_blocks += 1
                self._cache[block_hash] = refs + 1
            seq.shared = hits
            seq.computed = start
            self._allocate(new_blocks)
            seq.blocks = len(hits) + new_blocks
            if seq.first_scheduled_s is None:
                hit_tokens = len(hits) * self.block_size
                seq.cache_hit_tokens = hit_tokens
                seq.external_tokens = external
                seq.first_scheduled_s = now_s
                result.queue_time_s[seq.req.request_id] = now_s - seq.req.arrival_s
                if self.enable_prefix_caching:
                    self.prefix_queries_tokens += seq.req.prompt_tokens
                    self.prefix_hits_tokens += hit_tokens
            if seq.req.lora is not None:
                self._lora_refs[seq.req.lora] = self._lora_refs.get(seq.req.lora, 0) + 1
            self._running.append(seq)
            scheduled.append((seq, chunk))
            budget -= chunk
        waiting.extendleft(reversed(skipped))

    # --- KV arriving from a prefill engine (decode role) ----------------------------------

    def _remote_blocks(self, seq: _Sequence) -> int:
        return -(-seq.req.prompt_tokens // self.block_size)

    def _reserve_remote(self, seq: _Sequence, now_s: float) -> bool:
        """Hold the prompt's blocks while its KV lands; False when they do not fit."""
        assert seq.kv_ready_s is not None
        blocks = self._remote_blocks(seq)
        if blocks > self._free_blocks():
            return False
        self._allocate(blocks)
        seq.blocks = blocks
        seq.kv_ready_s = max(seq.kv_ready_s, now_s + seq.kv_transfer_s)
        self._receiving.append(seq)
        return True

    def _next_landing_s(self) -> float:
        """When the first KV still on the wire lands (inf when none is)."""
        return min(
            (s.kv_ready_s for s in self._receiving if s.kv_ready_s is not None), default=math.inf
        )

    def _promote_landed(self, now_s: float, result: StepResult) -> None:
        """Requests whose KV has landed join the running batch, their last prompt token to
        compute (it samples the first output token)."""
        landed = sorted(
            (s for s in self._receiving if s.kv_ready_s is not None and s.kv_ready_s <= now_s),
            key=lambda s: s.kv_ready_s or 0.0,
        )
        for seq in landed:
            if len(self._running) >= self.max_num_seqs:
                break
            self._receiving.remove(seq)
            seq.kv_ready_s = None
            seq.computed = seq.req.prompt_tokens - 1
            seq.external_tokens = seq.req.prompt_tokens
            seq.first_scheduled_s = now_s
            result.queue_time_s[seq.req.request_id] = now_s - seq.req.arrival_s
            self._running.append(seq)

    def step(self, now_s: float) -> StepResult:
        start = max(now_s, self.clock_s)
        result = StepResult(started_s=start, duration_s=0.0)
        if self._receiving:
            self._promote_landed(start, result)
        scheduled, budget = self._schedule_running(self.max_num_batched_tokens, result)
        if not result.preempted:
            self._schedule_waiting(budget, start, result, scheduled)
        if not scheduled:
            self.clock_s = start
            return result

        tokens = 0
        context = 0
        attention = 0
        for seq, n in scheduled:
            tokens += n
            context += seq.computed
            if n > 1:
                attention += n * (seq.computed + n)
        memory_s = self._weights_s + context * self._kv_token_s
        compute_s = tokens * self._token_flop_s + attention * self._attention_unit_s
        duration = self._t0 + (memory_s if memory_s > compute_s else compute_s)
        self.compute_s_total += compute_s
        self.memory_s_total += memory_s
        end = start + duration
        result.duration_s = duration
        self.clock_s = end

        finished: list[_Sequence] = []
        for seq, n in scheduled:
            seq.computed += n
            if self.enable_prefix_caching and len(seq.shared) < len(seq.req.block_hashes):
                self._register_computed_blocks(seq)
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end
            seq.output += 1
            self.generation_tokens_total += 1
            rid = seq.req.request_id
            result.tokens[rid] = 1
            if seq.output == 1:
                seq.first_token_s = end
                result.first_token.append(rid)
                self._count_prompt_sources(seq)
                result.cached_prompt_tokens[rid] = seq.cache_hit_tokens + seq.external_tokens
            if seq.output >= seq.limit:
                finished.append(seq)
        for seq in finished:
            self._finish(seq, seq.limit_reason, end)
            result.finished.append((seq.req.request_id, seq.limit_reason))
            result.finished_output_tokens[seq.req.request_id] = seq.output
        return result

    def _count_prompt_sources(self, seq: _Sequence) -> None:
        prompt = seq.req.prompt_tokens
        self.prompt_tokens_total += prompt
        by_source = self.prompt_tokens_by_source
        by_source[LOCAL_CACHE_HIT] += seq.cache_hit_tokens
        by_source[EXTERNAL_KV_TRANSFER] += seq.external_tokens
        by_source[LOCAL_COMPUTE] += prompt - seq.cache_hit_tokens - seq.external_tokens

    def _finish(self, seq: _Sequence, reason: str, now_s: float) -> None:
        self._running.remove(seq)
        self._release(seq)
        seq.finished_s = now_s
        seq.finish_reason = reason
        del self._by_id[seq.req.request_id]
        self.finished_total[reason] += 1

    # --- fast forward ----------------------------------------------------------------------

    def _pure_decode_batch(self) -> bool:
        """True when every running request decodes one token per step and no waiting request
        could join: then the next steps are identical in shape until something finishes or a
        block cannot be allocated."""
        running = self._running
        if not running or len(running) > self.max_num_batched_tokens:
            return False
        for seq in running:
            if seq.num_tokens - seq.computed != 1 or seq.output == 0:
                return False
        return not self._waiting_could_join()

    def _waiting_could_join(self) -> bool:
        if not self._waiting or len(self._running) >= self.max_num_seqs:
            return False
        budget = self.max_num_batched_tokens - len(self._running)
        if budget <= 0:
            return False
        block = self.block_size
        decode_blocks = sum(1 for s in self._running if s.computed + 1 > s.blocks * block)
        for seq in self._waiting:
            if seq.kv_ready_s is not None:
                return self._remote_blocks(seq) + decode_blocks <= self._free_blocks()
            if self._lora_blocked(seq):
                continue
            hits = self._cached_prefix(seq)
            start, _ = self._admission_start(seq, hits)
            chunk = min(seq.num_tokens - start, budget)
            new_blocks, revived = self._admission_blocks(hits, start, chunk)
            return new_blocks + revived + decode_blocks <= self._free_blocks()
        return False

    def _decode_run_constants(self) -> tuple[float, float, float]:
        """Step i of a pure-decode run takes t0 + max(a + i*d, m)."""
        batch = len(self._running)
        context = sum(s.computed for s in self._running)
        a = self._weights_s + context * self._kv_token_s
        d = batch * self._kv_token_s
        m = batch * self._token_flop_s
        return a, d, m

    def _run_duration(self, k: int, a: float, d: float, m: float) -> float:
        """Sum of the first k step durations of a pure-decode run, in closed form."""
        if k <= 0:
            return 0.0
        if a >= m:
            i0 = 0
        elif d <= 0:
            i0 = k
        else:
            i0 = min(k, max(0, math.ceil((m - a) / d)))
        total = k * self._t0 + i0 * m
        if k > i0:
            total += (k - i0) * a + d * ((k - 1) * k - (i0 - 1) * i0) / 2
        return total

    def _steps_before(self, until_s: float, k_max: int, a: float, d: float, m: float) -> int:
        """How many of the next k_max steps start before until_s."""
        window = until_s - self.clock_s
        if window <= 0:
            return 0
        lo, hi = 1, k_max  # step 0 starts at clock_s < until_s
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._run_duration(mid - 1, a, d, m) < window:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _steps_with_blocks(self, k_max: int) -> int:
        """How many decode steps can allocate their blocks without preempting."""
        free = self._free_blocks()
        block = self.block_size

        def blocks_needed(k: int) -> int:
            return sum(max(0, -(-(s.computed + k) // block) - s.blocks) for s in self._running)

        if blocks_needed(k_max) <= free:
            return k_max
        lo, hi = 0, k_max - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks_needed(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _fast_forward(self, until_s: float, events: list[EngineEvent]) -> bool:
        """Run a pure-decode stretch in one go. False when there was nothing to fast-forward."""
        if not self._pure_decode_batch():
            return False
        k_finish = min(s.limit - s.output for s in self._running)
        a, d, m = self._decode_run_constants()
        k = self._steps_before(until_s, k_finish, a, d, m)
        k = self._steps_with_blocks(k)
        if k < 2:
            return False  # one ordinary step is just as cheap and handles the edge cases
        block = self.block_size
        new_blocks = 0
        for seq in self._running:
            need = -(-(seq.computed + k) // block) - seq.blocks
            if need > 0:
                new_blocks += need
                seq.blocks += need
            seq.computed += k
            seq.output += k
        self._allocate(new_blocks)
        self.generation_tokens_total += k * len(self._running)
        self.compute_s_total += k * m
        self.memory_s_total += k * a + d * k * (k - 1) / 2
        self.clock_s += self._run_duration(k, a, d, m)
        for seq in [s for s in self._running if s.output >= s.limit]:
            self._finish(seq, seq.limit_reason, self.clock_s)
            events.append(
                EngineEvent(
                    FINISHED, seq.req.request_id, self.clock_s, seq.output, seq.limit_reason
                )
            )
        return True

    def advance(self, until_s: float) -> list[EngineEvent]:
        """Run every step that starts before until_s; return the events in time order."""
        events: list[EngineEvent] = []
        while self.clock_s < until_s and self.has_work:
            landing = self._next_landing_s() if self._receiving else math.inf
            if self._fast_forward(until_s if landing > until_s else landing, events):
                continue
            result = self.step(self.clock_s)
            if not result.duration_s:
                # Nothing to compute: only KV on the wire. Idle until it lands.
                landing = self._next_landing_s()
                if landing == math.inf:
                    break
                if landing >= until_s:
                    self.clock_s = max(self.clock_s, until_s)
                    break
                self.clock_s = max(self.clock_s, landing)
                continue
            end = result.ended_s
            for rid in result.preempted:
                seq = self._by_id[rid]
                events.append(EngineEvent(PREEMPTED, rid, result.started_s, seq.output))
            for rid in result.first_token:
                events.append(EngineEvent(FIRST_TOKEN, rid, end, 1))
            for rid, reason in result.finished:
                tokens = result.finished_output_tokens[rid]
                events.append(EngineEvent(FINISHED, rid, end, tokens, reason))
        if not self.has_work and until_s != math.inf:
            # An idle engine's clock follows the caller's; advance(inf) means "drain".
            self.clock_s = max(self.clock_s, until_s)
        return events

    def next_event_s(self) -> float | None:
        """When the engine next changes by itself (no new arrivals), or None when idle."""
        if not self.has_work:
            return None
        landing = max(self.clock_s, self._next_landing_s()) if self._receiving else math.inf
        if not self._running and not self._waiting:
            return landing
        if self._pure_decode_batch():
            k_finish = min(s.limit - s.output for s in self._running)
            k = max(1, self._steps_with_blocks(k_finish))
            return min(landing, self.clock_s + self._run_duration(k, *self._decode_run_constants()))
        return min(landing, self.clock_s + self._next_step_estimate_s())

    def _next_step_estimate_s(self) -> float:
        # A step's length depends on what gets scheduled; the fastest possible step is a lower
        # bound, so the caller wakes no later than the next event.
        return self._t0 + self._weights_s
