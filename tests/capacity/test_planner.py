"""The capacity planner: the textbook example, and plans from the engine model."""

from __future__ import annotations

import math

import pytest

from serving.capacity.planner import (
    Headroom,
    PoolOption,
    Workload,
    plan_capacity,
    slo_throughput,
    textbook_estimate,
)
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs


def test_it_reproduces_the_textbook_example() -> None:
    estimate = textbook_estimate(10_000, 0.1, 500, 4_500)
    assert (estimate.gpus, estimate.gpus_with_headroom) == (111, 183)


def test_headroom_factors_add_up_rather_than_multiply() -> None:
    assert Headroom().factor == pytest.approx(1.30 + 0.20 + 0.15)


def test_the_textbook_demand_is_users_times_rate_times_output() -> None:
    estimate = textbook_estimate(2_000, 0.5, 300, 1_000)
    assert estimate.demand_tokens_per_s == pytest.approx(2_000 * 0.5 * 300)
    assert estimate.raw_gpus == pytest.approx(300.0)


def test_a_gpu_too_slow_for_the_tpot_objective_is_infeasible() -> None:
    plan = plan_capacity(Workload(1_000, 0.1, 500, 200), [PoolOption("l4", "L4-24GB")])
    assert "l4" in plan.infeasible
    assert not plan.meets_demand


def test_slo_throughput_keeps_tpot_within_the_objective() -> None:
    perf = PerfModel(load_gpu_specs()["A100-SXM-80GB"], load_model_specs()["llama-3.1-8b"])
    workload = Workload(1, 1.0, 1_000, 300, tpot_slo_s=0.03)
    result = slo_throughput(perf, workload)
    assert not isinstance(result, str)
    assert result.tpot_s <= 0.03
    assert perf.tpot_s(result.batch + 1, 1_150) > 0.03  # the batch is the largest that fits


def test_the_plan_covers_demand_with_headroom() -> None:
    workload = Workload(5_000, 0.1, 800, 250)
    plan = plan_capacity(workload, [PoolOption("h100", "H100-SXM-80GB")])
    line = plan.lines[0]
    capacity = line.replicas * line.tokens_per_s_per_gpu
    assert capacity >= workload.output_tokens_per_s * plan.headroom_factor
    assert (line.replicas - 1) * line.tokens_per_s_per_gpu < (
        workload.output_tokens_per_s * plan.headroom_factor
    )


def test_the_cheapest_pool_per_token_is_filled_first() -> None:
    workload = Workload(5_000, 0.1, 800, 250)
    pools = [PoolOption("h100", "H100-SXM-80GB"), PoolOption("a100", "A100-SXM-80GB")]
    plan = plan_capacity(workload, pools)
    alone = {pool.name: plan_capacity(workload, [pool]).usd_per_hour for pool in pools}
    assert plan.usd_per_hour == pytest.approx(min(alone.values()))


def test_a_capacity_bound_spills_demand_to_the_next_pool() -> None:
    workload = Workload(5_000, 0.1, 800, 250)
    cheapest = plan_capacity(
        workload, [PoolOption("h100", "H100-SXM-80GB"), PoolOption("a100", "A100-SXM-80GB")]
    ).lines[0]
    bounded = PoolOption(cheapest.pool, cheapest.gpu_class, available_gpus=2)
    other = "H100-SXM-80GB" if cheapest.gpu_class != "H100-SXM-80GB" else "A100-SXM-80GB"
    plan = plan_capacity(workload, [bounded, PoolOption("other", other)])
    assert [line.pool for line in plan.lines] == [cheapest.pool, "other"]
    assert plan.lines[0].gpus == 2
    assert math.isclose(sum(line.share_of_demand for line in plan.lines), 1.0)
