"""The engine model: batching, chunked prefill, KV blocks, preemption, prefix cache, LoRA slots,
and the fast-forward API agreeing exactly with one-step-at-a-time driving."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.engine.core import FINISHED, FIRST_TOKEN, PREEMPTED, Engine, EngineRequest
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs


def l4_8b() -> PerfModel:
    return PerfModel(load_gpu_specs()["L4-24GB"], load_model_specs()["llama-3.1-8b"])


def engine(**kwargs: object) -> Engine:
    return Engine(l4_8b(), **kwargs)  # type: ignore[arg-type]


def request(
    rid: str, prompt: int = 100, out: int = 10, at: float = 0.0, **kw: object
) -> EngineRequest:
    return EngineRequest(rid, prompt, out, at, **kw)  # type: ignore[arg-type]


def run_to_completion(e: Engine, limit: int = 100_000) -> list[tuple[str, str]]:
    finished: list[tuple[str, str]] = []
    for _ in range(limit):
        if not e.has_work:
            return finished
        finished += e.step(e.clock_s).finished
    raise AssertionError("engine did not drain")


def test_kv_cache_is_sized_from_the_perf_model() -> None:
    e = engine()
    assert e.total_blocks == l4_8b().kv_capacity_tokens // 16


def test_it_refuses_to_start_when_one_full_sequence_does_not_fit() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine(max_model_len=131072)


def test_a_request_produces_its_first_token_when_its_prefill_completes() -> None:
    e = engine()
    e.add_request(request("a", prompt=100, out=5))
    result = e.step(0.0)
    assert result.first_token == ["a"]
    assert result.tokens == {"a": 1}
    assert result.duration_s == pytest.approx(l4_8b().prefill_s(100))


def test_it_finishes_with_length_after_max_tokens() -> None:
    e = engine()
    e.add_request(request("a", out=3))
    assert run_to_completion(e) == [("a", "length")]
    assert e.generation_tokens_total == 3


def test_stop_after_emulates_an_eos_with_finish_reason_stop() -> None:
    e = engine()
    e.add_request(request("a", out=50, stop_after=4))
    assert run_to_completion(e) == [("a", "stop")]
    assert e.generation_tokens_total == 4


def test_requests_join_the_running_batch_at_step_boundaries() -> None:
    e = engine()
    e.add_request(request("a", out=20))
    e.step(0.0)
    e.step(e.clock_s)
    e.add_request(request("b", out=20, at=e.clock_s))
    result = e.step(e.clock_s)
    assert set(result.tokens) == {"a", "b"}
    assert e.num_running == 2


def test_chunked_prefill_splits_a_long_prompt_over_the_token_budget() -> None:
    e = engine(max_num_batched_tokens=512)
    e.add_request(request("a", prompt=1200, out=2))
    first, second, third = e.step(0.0), e.step(e.clock_s), e.step(e.clock_s)
    assert first.tokens == {} and second.tokens == {}
    assert third.first_token == ["a"]


def test_decodes_share_the_step_with_a_prefill_chunk() -> None:
    e = engine(max_num_batched_tokens=512)
    e.add_request(request("a", prompt=50, out=30))
    e.step(0.0)
    e.add_request(request("b", prompt=2000, out=5, at=e.clock_s))
    result = e.step(e.clock_s)
    assert result.tokens == {"a": 1}  # a decodes while b's first chunk runs


def test_max_num_seqs_caps_the_running_batch() -> None:
    e = engine(max_num_seqs=2)
    for rid in "abc":
        e.add_request(request(rid))
    e.step(0.0)
    assert (e.num_running, e.num_waiting) == (2, 1)


def test_kv_usage_counts_allocated_blocks() -> None:
    e = engine()
    e.add_request(request("a", prompt=160, out=10))
    e.step(0.0)
    assert e.kv_usage == pytest.approx(10 / e.total_blocks)  # 160 prompt tokens
    e.step(e.clock_s)
    assert e.kv_usage == pytest.approx(11 / e.total_blocks)  # plus the first sampled token


def test_it_preempts_the_newest_request_when_kv_runs_out() -> None:
    e = engine(kv_capacity_tokens=960, max_model_len=512)  # 60 blocks; two requests need 64
    e.add_request(request("old", prompt=400, out=100))
    e.add_request(request("new", prompt=400, out=100))
    preempted: list[str] = []
    while e.has_work and not preempted:
        preempted = e.step(e.clock_s).preempted
    assert preempted == ["new"]
    assert e.preemptions_total == 1
    assert run_to_completion(e) == [("old", "length"), ("new", "length")]


def test_a_preempted_request_keeps_its_tokens_and_resumes() -> None:
    e = engine(kv_capacity_tokens=960, max_model_len=512)  # 60 blocks; two requests need 64
    e.add_request(request("old", prompt=400, out=100))
    e.add_request(request("new", prompt=400, out=100))
    run_to_completion(e)
    assert e.generation_tokens_total == 200


def test_prefix_cache_hits_skip_prefill_of_shared_blocks() -> None:
    e = engine()
    hashes = tuple(range(125))
    e.add_request(request("a", prompt=2008, out=2, block_hashes=hashes))
    run_to_completion(e)
    e.add_request(request("b", prompt=2008, out=2, at=e.clock_s, block_hashes=hashes))
    result = e.step(e.clock_s)
    assert e.prefix_queries_tokens == 4016
    assert e.prefix_hits_tokens == 2000
    assert result.duration_s < l4_8b().prefill_s(2008) / 2


def test_a_full_prompt_hit_still_computes_the_last_block() -> None:
    e = engine()
    hashes = tuple(range(10))
    e.add_request(request("a", prompt=160, out=2, block_hashes=hashes))
    run_to_completion(e)
    e.add_request(request("b", prompt=160, out=2, at=e.clock_s, block_hashes=hashes))
    e.step(e.clock_s)
    assert e.prefix_hits_tokens == 144


def test_different_prefixes_do_not_hit() -> None:
    e = engine()
    e.add_request(request("a", prompt=170, out=2, block_hashes=tuple(range(10))))
    run_to_completion(e)
    e.add_request(
        request("b", prompt=170, out=2, at=e.clock_s, block_hashes=tuple(range(100, 110)))
    )
    e.step(e.clock_s)
    assert e.prefix_hits_tokens == 0


def test_unreferenced_cached_blocks_are_evicted_oldest_first_tail_before_head() -> None:
    e = engine(kv_capacity_tokens=1024, max_model_len=512)  # 64 blocks
    for name, base in (("a", 0), ("b", 100), ("c", 200)):
        hashes = tuple(range(base, base + 30))
        e.add_request(request(name, prompt=480, out=1, at=e.clock_s, block_hashes=hashes))
        run_to_completion(e)
    e.add_request(request("a2", prompt=480, out=1, at=e.clock_s, block_hashes=tuple(range(30))))
    e.step(e.clock_s)
    survivors = e.total_blocks - 2 * 30  # b and c pushed out all but a's head
    assert e.prefix_hits_tokens == survivors * 16


def test_a_request_with_an_inactive_adapter_waits_for_a_free_lora_slot() -> None:
    e = engine(max_loras=1)
    e.add_request(request("x", out=5, lora="sql"))
    e.add_request(request("y", out=5, lora="chat"))
    e.add_request(request("z", out=5))
    e.step(0.0)
    assert e.running_loras == ["sql"]
    assert e.waiting_loras == ["chat"]
    assert e.num_running == 2  # z has no adapter and overtakes the blocked y
    run_to_completion(e)
    assert e.generation_tokens_total == 15


def test_abort_frees_the_batch_slot_and_its_kv() -> None:
    e = engine()
    e.add_request(request("a", out=100))
    e.step(0.0)
    assert e.abort("a")
    assert (e.num_running, e.kv_usage, e.has_work) == (0, 0.0, False)


def test_abort_of_an_unknown_request_reports_false() -> None:
    assert not engine().abort("nope")


def test_it_rejects_a_request_longer_than_max_model_len() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine(max_model_len=1024).add_request(request("a", prompt=1000, out=100))


def test_prompt_tokens_are_counted_when_prefill_completes() -> None:
    e = engine()
    e.add_request(request("a", prompt=300, out=2))
    e.step(0.0)
    assert e.prompt_tokens_total == 300


def test_advance_fast_forwards_a_long_decode_in_few_iterations() -> None:
    e = engine()
    e.add_request(request("a", prompt=100, out=1000))
    events = e.advance(math.inf)
    assert [ev.kind for ev in events] == [FIRST_TOKEN, FINISHED]
    assert events[-1].output_tokens == 1000
    assert e.generation_tokens_total == 1000


def test_next_event_s_is_the_finish_of_a_pure_decode_batch() -> None:
    e = engine()
    e.add_request(request("a", prompt=100, out=50))
    e.advance(e.clock_s + 1e-9)  # the prefill step
    predicted = e.next_event_s()
    events = e.advance(math.inf)
    assert predicted == pytest.approx(events[-1].time_s)


def test_next_event_s_is_none_when_idle() -> None:
    assert engine().next_event_s() is None


# --- stepping and advancing agree ---------------------------------------------------------


@dataclass
class Outcome:
    first_token_s: float | None = None
    finished_s: float | None = None
    reason: str | None = None
    tokens: int = 0
    preemptions: int = 0


def drive_by_steps(e: Engine, requests: list[EngineRequest]) -> dict[str, Outcome]:
    pending = deque(requests)
    out = {r.request_id: Outcome() for r in requests}
    while pending or e.has_work:
        if not e.has_work:
            e.add_request(pending.popleft())
        while pending and pending[0].arrival_s <= e.clock_s:
            e.add_request(pending.popleft())
        result = e.step(e.clock_s)
        for rid in result.preempted:
            out[rid].preemptions += 1
        for rid in result.first_token:
            out[rid].first_token_s = result.ended_s
        for rid, count in result.tokens.items():
            out[rid].tokens += count
        for rid, reason in result.finished:
            out[rid].finished_s, out[rid].reason = result.ended_s, reason
            assert out[rid].tokens == result.finished_output_tokens[rid]
    return out


def drive_by_advance(e: Engine, requests: list[EngineRequest]) -> dict[str, Outcome]:
    out = {r.request_id: Outcome() for r in requests}

    def record(until: float) -> None:
        for ev in e.advance(until):
            if ev.kind == PREEMPTED:
                out[ev.request_id].preemptions += 1
            elif ev.kind == FIRST_TOKEN:
                out[ev.request_id].first_token_s = ev.time_s
            else:
                o = out[ev.request_id]
                o.finished_s, o.reason, o.tokens = ev.time_s, ev.finish_reason, ev.output_tokens

    for r in requests:
        record(r.arrival_s)
        e.add_request(r)
    record(math.inf)
    return out


def small_engine() -> Engine:
    return engine(
        kv_capacity_tokens=1024,
        max_model_len=512,
        max_num_seqs=6,
        max_num_batched_tokens=256,
        max_loras=2,
    )


@st.composite
def workloads(draw: st.DrawFn) -> list[EngineRequest]:
    count = draw(st.integers(1, 14))
    at = 0.0
    requests = []
    for i in range(count):
        at += draw(st.floats(0.0, 0.6, allow_nan=False))
        prompt = draw(st.integers(1, 300))
        out = draw(st.integers(1, 511 - prompt if prompt < 511 else 1))
        family = draw(st.integers(0, 2))
        requests.append(
            EngineRequest(
                request_id=f"r{i}",
                prompt_tokens=prompt,
                max_tokens=min(out, 150),
                arrival_s=at,
                block_hashes=tuple(family * 1000 + j for j in range(prompt // 16)),
                lora=draw(st.sampled_from([None, None, "a", "b", "c"])),
                stop_after=draw(st.one_of(st.none(), st.integers(1, 150))),
            )
        )
    return requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_advance_gives_exactly_the_same_results_as_stepping(requests: list[EngineRequest]) -> None:
    stepped, stepped_engine = {}, small_engine()
    stepped = drive_by_steps(stepped_engine, requests)
    advanced_engine = small_engine()
    advanced = drive_by_advance(advanced_engine, requests)
    for rid, s in stepped.items():
        a = advanced[rid]
        assert (a.tokens, a.reason, a.preemptions) == (s.tokens, s.reason, s.preemptions), rid
        assert a.first_token_s == pytest.approx(s.first_token_s, rel=1e-9)
        assert a.finished_s == pytest.approx(s.finished_s, rel=1e-9)
    for counter in (
        "prefix_queries_tokens",
        "prefix_hits_tokens",
        "prompt_tokens_total",
        "generation_tokens_total",
        "preemptions_total",
    ):
        assert getattr(advanced_engine, counter) == getattr(stepped_engine, counter), counter
    for seconds in ("compute_s_total", "memory_s_total"):
        assert getattr(advanced_engine, seconds) == pytest.approx(
            getattr(stepped_engine, seconds), rel=1e-9
        ), seconds


# --- a copy runs the same future and leaves the original alone ---------------------------


def engine_counters(e: Engine) -> tuple[object, ...]:
    return (
        e.clock_s,
        e.num_running,
        e.num_waiting,
        e.kv_usage,
        e.prefix_hits_tokens,
        e.preemptions_total,
        dict(e.prompt_tokens_by_source),
        dict(e.finished_total),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.floats(0.0, 1.0), st.integers(0, 13))
def test_a_copy_runs_the_same_future_and_leaves_the_original_as_it_was(
    requests: list[EngineRequest], cut: float, extra: int
) -> None:
    # Midway through a workload (preemptions, shared prefixes, LoRA slots and all), a copy
    # drained with one more request added must not touch the original: the original then
    # drains exactly as a second copy taken at the same moment does, event for event.
    e = small_engine()
    at = requests[-1].arrival_s * cut
    for r in requests:
        if r.arrival_s <= at:
            e.advance(r.arrival_s)
            e.add_request(r)
    e.advance(at)
    before = engine_counters(e)
    twin, other = e.copy(), e.copy()
    added = requests[extra % len(requests)]
    other.add_request(
        EngineRequest("added", added.prompt_tokens, 5, at, added.block_hashes, added.lora)
    )
    assert any(ev.request_id == "added" for ev in other.advance(math.inf))
    assert engine_counters(e) == before
    assert e.advance(math.inf) == twin.advance(math.inf)
    assert engine_counters(e) == engine_counters(twin)
