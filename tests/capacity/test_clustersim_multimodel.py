"""Multi-model fleets in the cluster simulator: pools serving their own models, requests
routed by model, per-model engine figures and summaries, and bench/multimodel.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import multimodel
from bench.multimodel import ClassFit, Row
from serving.clustersim.fleet import FleetSpec, PoolSpec, homogeneous, smallest_tensor_parallel
from serving.clustersim.report import summarize, summary_rows
from serving.clustersim.simulator import SimConfig, SimResult, simulate
from serving.clustersim.workloads import SimRequest, assign_models, poisson

REPO = Path(__file__).resolve().parents[2]
H100 = "H100-SXM-80GB"
L40S = "L40S-48GB"
B70, B8, B1 = "llama-3.1-70b", "llama-3.1-8b", "llama-3.2-1b"
POLICIES = ("cost_aware", "least_load", "llm_d_epp", "dynamo_kv", "round_robin")

# A 70B on H100s, an 8B on L40S (the fleet's own model) and a 1B on L40S.
MIXED = FleetSpec(
    pools=(
        PoolSpec("h100-70b", H100, 1, tensor_parallel=4, model=B70),
        PoolSpec("l40s-8b", L40S, 2),
        PoolSpec("l40s-1b", L40S, 1, model=B1),
    ),
    model=B8,
)


def requests(models: dict[str, float], count: int = 60) -> list[SimRequest]:
    arrivals = poisson(4.0, 60.0, seed=3)[:count]
    return assign_models(arrivals, models, seed=4)


def model_of_replica(result: SimResult) -> dict[str, str]:
    return {r.replica_id: result.fleet.pool_model(r.pool) for r in result.replicas}


@pytest.mark.parametrize("policy", POLICIES)
def test_each_request_runs_only_on_a_pool_of_its_own_model(policy: str) -> None:
    workload = requests({B70: 1, B8: 1, B1: 1})
    result = simulate(MIXED, workload, SimConfig(policy=policy))
    served_on = model_of_replica(result)
    served = [r for r in result.records if r.replica_id is not None]
    assert len(served) == len(workload)
    assert {r.request.model for r in served} == {B70, B8, B1}
    for record in served:
        assert record.replica_id is not None
        assert served_on[record.replica_id] == record.request.model


def test_a_request_without_a_model_asks_for_the_fleets_model() -> None:
    workload = poisson(4.0, 5.0, seed=1)
    result = simulate(MIXED, workload)
    served_on = model_of_replica(result)
    assert {served_on[r.replica_id] for r in result.records if r.replica_id} == {B8}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_for_a_model_no_pool_serves_fails_as_no_candidates(policy: str) -> None:
    workload = requests({B8: 1, B1: 1})
    result = simulate(homogeneous(L40S, 2), workload, SimConfig(policy=policy))
    for record in result.records:
        if record.request.model == B1:
            assert record.failed == "no_candidates" and record.replica_id is None
        else:
            assert record.failed is None and record.finished_s is not None
    assert any(r.request.model == B1 for r in result.records)


def test_a_pools_engine_model_is_its_own_models() -> None:
    big, small = (MIXED.perf(pool) for pool in MIXED.pools[:2])
    assert (big.model.name, big.tensor_parallel) == (B70, 4)
    assert small.model.name == B8
    same_class = FleetSpec(pools=(PoolSpec("a", H100, 1, tensor_parallel=4, model=B70),))
    eight = homogeneous(H100, 1)
    per_token_70b = same_class.perf(same_class.pools[0]).decode_step_s(1, 1000)
    per_token_8b = eight.perf(eight.pools[0]).decode_step_s(1, 1000)
    # 70.6B over four GPUs still reads more weight bytes per GPU than 8B over one.
    assert per_token_70b > 1.5 * per_token_8b


def test_a_70b_is_slower_per_token_than_an_8b_on_the_same_class_in_the_simulation() -> None:
    fleet = FleetSpec(
        pools=(
            PoolSpec("h100-70b", H100, 1, tensor_parallel=4, model=B70),
            PoolSpec("h100-8b", H100, 1),
        )
    )
    result = simulate(fleet, requests({B70: 1, B8: 1}, count=30))
    tpot = {
        model: max(t for r in result.records if r.request.model == model and (t := r.tpot_s))
        for model in (B70, B8)
    }
    slowest_8b = tpot[B8]
    fastest_70b = min(
        t for r in result.records if r.request.model == B70 and (t := r.tpot_s) is not None
    )
    assert fastest_70b > slowest_8b


def test_a_70b_needs_four_80gb_gpus_and_an_8b_one() -> None:
    assert smallest_tensor_parallel(H100, B70) == 4
    assert smallest_tensor_parallel("H200-SXM-141GB", B70) == 2
    assert smallest_tensor_parallel(H100, B8) == 1
    assert smallest_tensor_parallel(L40S, "llama-3.1-405b") is None


def test_a_multi_model_run_is_summarised_per_model() -> None:
    workload = requests({B70: 1, B8: 2, B1: 1})
    summary = summarize(simulate(MIXED, workload))
    assert set(summary.models) == {B70, B8, B1}
    assert sum(m.requests for m in summary.models.values()) == len(workload)
    assert sum(m.cost_usd for m in summary.models.values()) == pytest.approx(summary.cost_usd)
    # The 70B pool's four H100s cost more than the 1B's one L40S.
    assert summary.models[B70].cost_usd > 10 * summary.models[B1].cost_usd
    for figures in summary.models.values():
        assert figures.interactive_requests > 0
        assert figures.interactive_slo_attainment is not None
        assert 0.0 <= figures.interactive_slo_attainment <= 1.0
    scopes = [row["scope"] for row in summary_rows(summary)]
    assert f"model:{B70}" in scopes


def test_an_unserved_model_is_summarised_with_its_failures() -> None:
    summary = summarize(simulate(homogeneous(L40S, 1), requests({B8: 1, B1: 1})))
    assert summary.models[B1].failed == summary.models[B1].requests > 0
    assert summary.models[B1].interactive_slo_attainment == 0.0
    assert summary.models[B1].cost_usd == 0.0


def test_a_one_model_run_has_no_per_model_figures_nor_rows() -> None:
    summary = summarize(simulate(homogeneous(L40S, 1), poisson(2.0, 5.0, seed=0)))
    assert summary.models == {}
    assert all(not str(row["scope"]).startswith("model:") for row in summary_rows(summary))
    assert "models" not in summary_rows(summary)[0]


def test_model_shares_are_drawn_by_weight_and_keep_the_arrivals() -> None:
    arrivals = poisson(50.0, 20.0, seed=0)
    mixed = assign_models(arrivals, {B70: 0.2, B8: 0.5, B1: 0.3}, seed=1)
    assert [r.arrival_s for r in mixed] == [r.arrival_s for r in arrivals]
    share_8b = sum(1 for r in mixed if r.model == B8) / len(mixed)
    assert 0.45 < share_8b < 0.55
    with pytest.raises(ValueError, match="model shares"):
        assign_models(arrivals, {})


def test_the_searched_mix_puts_each_model_on_its_cheapest_class_in_the_table() -> None:
    table: dict[str, dict[str, ClassFit | None]] = {
        "H200-SXM-141GB": {B70: ClassFit(1, 2, 7.98), B8: ClassFit(1, 1, 3.99), B1: None},
        H100: {B70: ClassFit(2, 4, 27.92), B8: ClassFit(1, 1, 3.49), B1: ClassFit(1, 1, 3.49)},
        L40S: {B70: None, B8: ClassFit(2, 2, 3.96), B1: ClassFit(1, 1, 0.99)},
        # As cheap as the L40S for the 1B: the first class of the table keeps it.
        "L4-24GB": {B70: None, B8: None, B1: ClassFit(1, 2, 0.99)},
    }
    mix = multimodel.searched_mix(table)
    assert mix == {
        B70: ("H200-SXM-141GB", ClassFit(1, 2, 7.98)),
        B8: (H100, ClassFit(1, 1, 3.49)),
        B1: (L40S, ClassFit(1, 1, 0.99)),
    }
    fleet = multimodel.combined_fleet(mix)
    pools = {fleet.pool_model(p): (p.gpu_class, p.replicas, p.tensor_parallel) for p in fleet.pools}
    assert pools == {B70: ("H200-SXM-141GB", 1, 2), B8: (H100, 1, 1), B1: (L40S, 1, 1)}
    assert len({p.name for p in fleet.pools}) == 3


def test_there_is_no_searched_mix_when_a_model_fits_no_class() -> None:
    table: dict[str, dict[str, ClassFit | None]] = {
        H100: {B70: None, B8: ClassFit(1, 1, 3.49)},
        L40S: {B70: None, B8: ClassFit(2, 2, 3.96)},
    }
    assert multimodel.searched_mix(table) is None


def fleet_row(policy: str, overall: float) -> Row:
    return Row("searched", policy, "", 64.75, {B70: overall}, overall, 0)


def test_the_policy_verdict_names_the_best_and_cost_aware_against_the_best_other() -> None:
    rows = [
        fleet_row("cost_aware", 0.97),
        fleet_row("least_load", 0.95),
        fleet_row("llm_d_epp", 0.98),
        fleet_row("dynamo_kv", 0.98),
    ]
    assert multimodel.best_policies(rows) == ["llm_d_epp", "dynamo_kv"]
    line = multimodel.policy_verdict("searched mix", rows)
    assert line.startswith("best policy on the searched mix: llm_d_epp, dynamo_kv (98.00%)")
    assert "cost_aware 97.00% vs the best other, llm_d_epp/dynamo_kv 98.00%: -1.00 points" in line


def test_a_mixed_fleets_shortfall_names_only_the_models_under_the_slo() -> None:
    short_row = Row("searched", "cost_aware", "", 1.0, {B70: 0.985, B8: 1.0, B1: None}, 0.995, 0)
    assert multimodel.shortfalls(short_row) == {B70: 0.985}


@pytest.mark.slow
def test_the_multimodel_bench_runs_quick_at_a_tiny_scale(tmp_path: Path) -> None:
    out = tmp_path / "multimodel.json"
    done = subprocess.run(
        [
            sys.executable,
            "bench/multimodel.py",
            "--quick",
            "--rate",
            "4",
            "--duration",
            "10",
            "--max-gpus",
            "16",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "verdict: planner's mix under cost_aware" in done.stdout
    report = json.loads(out.read_text())
    planner = [row for row in report["rows"] if row["label"] == "planner"]
    assert [row["policy"] for row in planner] == list(POLICIES)
    for row in planner:
        assert set(row["by_model"]) == {B70, B8, B1}
        assert row["usd_per_hour"] > 0

    # The searched mix: each model on the cheapest class of the table the bench printed.
    fits = report["single_class_fits"]
    mix = report["searched_mix"]
    for model in (B70, B8, B1):
        cheapest = min(f["usd_per_hour"] for by_model in fits.values() if (f := by_model[model]))
        chosen = mix[model]
        assert chosen["usd_per_hour"] == cheapest
        assert fits[chosen["gpu_class"]][model] == {
            k: v for k, v in chosen.items() if k != "gpu_class"
        }
    searched = [row for row in report["rows"] if row["label"] == "searched"]
    assert [row["policy"] for row in searched] == list(POLICIES)
    hourly = sum(chosen["usd_per_hour"] for chosen in mix.values())
    for row in searched:
        assert set(row["by_model"]) == {B70, B8, B1}
        assert row["usd_per_hour"] == pytest.approx(hourly)
        assert mix[B70]["gpu_class"] in row["fleet"]
    assert "verdict: searched mix under cost_aware" in done.stdout
    assert set(report["best_policies"]) == {"planner", "searched"}
    best = max(row["overall"] for row in searched)
    assert report["best_policies"]["searched"] == [
        row["policy"] for row in searched if row["overall"] == best
    ]
    assert "best policy on the searched mix: " in done.stdout
