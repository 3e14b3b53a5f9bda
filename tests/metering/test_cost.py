"""Cost to serve: a replica's window cost split by the work each request caused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from metering.cost import ReplicaWindow, ServedRequest, attribute, split_micros, work_weights
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs

PERF = PerfModel(load_gpu_specs()["H100-SXM-80GB"], load_model_specs()["llama-3.1-8b"])
HOUR = ReplicaWindow("r1", 3600.0, 1, 3_490_000)  # $3.49 per GPU-hour


def test_a_decode_token_weighs_more_than_a_prefill_token_on_the_roofline() -> None:
    weights = work_weights(PERF, batch=32, context=1024)
    assert weights.decode_s_per_token > 5 * weights.prefill_s_per_token


def test_the_whole_window_cost_idle_time_included_lands_on_its_requests() -> None:
    served = [ServedRequest("a", 1000, 0, 200), ServedRequest("b", 50, 0, 10)]
    parts = attribute(HOUR, served, work_weights(PERF, 1, 600))
    assert sum(p.cost_usd_micros for p in parts) == 3_490_000
    assert abs(sum(p.gpu_seconds for p in parts) - 3600.0) < 1e-6


def test_cached_prompt_tokens_cost_nothing_to_serve() -> None:
    weights = work_weights(PERF, 8, 2000)
    assert weights.work(1000, 1000, 0) == 0.0
    assert weights.work(1000, 0, 0) > 0.0


def test_a_replica_that_served_nothing_attributes_nothing() -> None:
    assert attribute(HOUR, [], work_weights(PERF, 1, 0)) == []


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
