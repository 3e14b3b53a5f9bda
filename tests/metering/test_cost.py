"""Cost to serve: a replica's ready time split by the work each request caused, the rest idle."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.cost import ReplicaWindow, ServedRequest, split, split_micros, work_weights
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs

PERF = PerfModel(load_gpu_specs()["H100-SXM-80GB"], load_model_specs()["llama-3.1-8b"])
HOUR = ReplicaWindow("r1", 3600 * 1_000_000, 1, 3_490_000)  # $3.49 per GPU-hour


def test_a_decode_token_weighs_more_than_a_prefill_token_on_the_roofline() -> None:
    weights = work_weights(PERF, batch=32, context=1024)
    assert weights.decode_s_per_token > 5 * weights.prefill_s_per_token


def test_requests_pay_for_their_work_and_the_rest_of_the_hour_is_idle() -> None:
    served = [ServedRequest("a", 1000, 0, 200), ServedRequest("b", 50, 0, 10)]
    weights = work_weights(PERF, 1, 600)
    share = split(HOUR, served, weights)
    busy_s = sum(weights.work(r.prompt_tokens, 0, r.completion_tokens) for r in served)
    assert sum(p.cost_usd_micros for p in share.requests) + share.idle_usd_micros == 3_490_000
    assert share.busy_gpu_seconds == pytest.approx(busy_s)
    assert share.requests[0].cost_usd_micros > share.requests[1].cost_usd_micros > 0
    assert share.idle_gpu_seconds == pytest.approx(3600.0 - busy_s)


def test_work_beyond_the_ready_time_is_scaled_to_fill_it_and_nothing_is_idle() -> None:
    minute = ReplicaWindow("r1", 60 * 1_000_000, 2, 3_490_000)
    served = [ServedRequest(str(i), 8000, 0, 2000) for i in range(200)]
    share = split(minute, served, work_weights(PERF, 1, 9000))
    assert share.idle_usd_micros == 0 and share.idle_gpu_seconds == pytest.approx(0.0)
    assert sum(p.cost_usd_micros for p in share.requests) == minute.cost_usd_micros
    assert sum(p.gpu_seconds for p in share.requests) == pytest.approx(120.0)


def test_cached_prompt_tokens_cost_nothing_to_serve() -> None:
    weights = work_weights(PERF, 8, 2000)
    assert weights.work(1000, 1000, 0) == 0.0
    assert weights.work(1000, 0, 0) > 0.0


def test_a_replica_that_served_nothing_is_idle_all_hour() -> None:
    share = split(HOUR, [], work_weights(PERF, 1, 0))
    assert (share.requests, share.idle_usd_micros, share.idle_gpu_seconds) == (
        [],
        3_490_000,
        3600.0,
    )


@given(
    total=st.integers(0, 10**12),
    shares=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=50),
)
def test_split_parts_always_add_up_to_the_total(total: int, shares: list[float]) -> None:
    weight = sum(shares) or 1.0
    parts = split_micros(
        total, [s / weight for s in shares] if sum(shares) else [1 / len(shares)] * len(shares)
    )
    assert sum(parts) == total and min(parts) >= 0
