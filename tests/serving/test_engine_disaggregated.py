"""Disaggregated prefill and decode in the engine model: the KV link's arithmetic, a prefill
engine that stops at the first token, a decode engine that waits for the KV to land."""

from __future__ import annotations

import math

import pytest

from serving.engine.core import DECODE, FINISHED, FIRST_TOKEN, PREFILL, Engine, EngineRequest
from serving.engine.link import (
    LinkPort,
    LinkSpec,
    between,
    kv_transfer_s,
    load_link_specs,
    schedule_transfer,
)
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs


def h100_8b() -> PerfModel:
    return PerfModel(load_gpu_specs()["H100-SXM-80GB"], load_model_specs()["llama-3.1-8b"])


def test_the_link_data_has_the_datasheet_figures_and_a_source_for_each() -> None:
    links = load_link_specs()
    assert links["nvlink4"].gbytes_per_s == 450  # 900 GB/s bidirectional
    assert links["infiniband-ndr-400"].gbytes_per_s == 50  # 400 Gb/s
    assert links["roce-200"].gbytes_per_s == 25
    assert all(link.source.startswith("https://") for link in links.values())


def test_a_prompts_kv_takes_tokens_times_kv_bytes_over_bandwidth_plus_latency() -> None:
    link = LinkSpec("ib", gbytes_per_s=50, latency_s=1e-6)
    # llama-3.1-8b bf16: 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 131072 bytes a token.
    seconds = kv_transfer_s(8000, h100_8b().kv_bytes_per_token, link)
    assert seconds == pytest.approx(1e-6 + 8000 * 131072 / 50e9)
    assert 0.020 < seconds < 0.022


def test_transfers_through_one_port_go_one_after_another() -> None:
    link = LinkSpec("slow", gbytes_per_s=1, latency_s=0.001)
    sender, first_receiver, second_receiver = LinkPort(link), LinkPort(link), LinkPort(link)
    assert schedule_transfer(0.0, 1e9, sender, first_receiver) == (0.0, pytest.approx(1.001))
    start, landed = schedule_transfer(0.5, 1e9, sender, second_receiver)
    assert start == pytest.approx(1.0)  # the sender's port was busy until then
    assert landed == pytest.approx(2.001)


def test_the_slower_end_sets_the_pace_between_two_links() -> None:
    links = load_link_specs()
    path = between(links["nvlink4"], links["roce-200"])
    assert path.gbytes_per_s == 25
    assert path.latency_s == links["roce-200"].latency_s


def test_a_prefill_engine_stops_every_request_after_its_first_token() -> None:
    engine = Engine(h100_8b(), role=PREFILL)
    engine.add_request(EngineRequest("a", 2000, 300, 0.0))
    events = engine.advance(math.inf)
    assert [(e.kind, e.output_tokens) for e in events] == [(FIRST_TOKEN, 1), (FINISHED, 1)]
    assert events[0].time_s == events[1].time_s
    assert not engine.has_work


def test_a_decode_engine_refuses_a_request_without_its_kv_arrival() -> None:
    with pytest.raises(ValueError, match="kv_ready_s"):
        Engine(h100_8b(), role=DECODE).add_request(EngineRequest("a", 100, 10, 0.0))
    with pytest.raises(ValueError, match="kv_ready_s"):
        Engine(h100_8b()).add_request(EngineRequest("a", 100, 10, 0.0), kv_ready_s=1.0)


def test_a_decode_engine_holds_the_blocks_and_waits_for_the_kv_to_land() -> None:
    perf = h100_8b()
    engine = Engine(perf, role=DECODE)
    engine.add_request(EngineRequest("a", 4000, 5, 0.0), kv_ready_s=0.25, kv_transfer_s=0.25)
    assert engine.advance(0.2) == []
    assert engine.kv_usage == pytest.approx(250 / engine.total_blocks)  # 4000 tokens held
    assert engine.num_waiting == 1 and engine.num_running == 0
    events = engine.advance(math.inf)
    first, finished = events
    assert first.kind == FIRST_TOKEN
    # One step computing the last prompt token over the landed KV: no prefill of 4000.
    step = perf.batch_step_s(1, 3999)
    assert first.time_s == pytest.approx(0.25 + step)
    assert step < perf.prefill_s(4000) / 5
    assert finished.kind == FINISHED and finished.output_tokens == 5


def test_a_decode_engine_next_event_is_the_kv_landing_when_only_kv_is_in_flight() -> None:
    engine = Engine(h100_8b(), role=DECODE)
    engine.add_request(EngineRequest("a", 100, 5, 0.0), kv_ready_s=0.5)
    engine.step(0.0)  # reserves the blocks
    assert engine.next_event_s() == pytest.approx(0.5)


def test_a_decode_engine_lets_a_landed_request_join_a_running_batch() -> None:
    engine = Engine(h100_8b(), role=DECODE)
    engine.add_request(EngineRequest("a", 1000, 200, 0.0), kv_ready_s=0.0)
    engine.advance(0.1)
    engine.add_request(EngineRequest("b", 1000, 20, 0.1), kv_ready_s=0.3, kv_transfer_s=0.2)
    events = engine.advance(math.inf)
    b_first = next(e for e in events if e.request_id == "b" and e.kind == FIRST_TOKEN)
    # Reserved at the step boundary after 0.1, landed 0.2 s later, joined at the next
    # boundary: within three decode steps (about 10 ms each) of 0.3 s.
    assert 0.3 <= b_first.time_s < 0.33
    assert {e.request_id for e in events if e.kind == FINISHED} == {"a", "b"}


def test_a_decode_engine_without_room_reserves_later_and_the_transfer_starts_then() -> None:
    perf = h100_8b()
    engine = Engine(perf, role=DECODE, kv_capacity_tokens=8192, max_model_len=8192)
    engine.add_request(EngineRequest("a", 6000, 50, 0.0), kv_ready_s=0.0)
    engine.add_request(EngineRequest("b", 6000, 5, 0.0), kv_ready_s=0.01, kv_transfer_s=0.01)
    events = engine.advance(math.inf)
    a_done = next(e.time_s for e in events if e.request_id == "a" and e.kind == FINISHED)
    b_first = next(e.time_s for e in events if e.request_id == "b" and e.kind == FIRST_TOKEN)
    # b's blocks were free only once a finished; its KV landed 10 ms after that.
    assert b_first >= a_done + 0.01
