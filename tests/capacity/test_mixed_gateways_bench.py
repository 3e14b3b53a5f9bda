"""bench/mixed_gateways.py: the mixed fleet of equal budget over seeds and gateway counts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from serving.clustersim import FAMILIES, SimConfig, simulate, summarize
from serving.clustersim.fleet import with_budget
from serving.router import RouterConfig

REPO = Path(__file__).resolve().parents[2]
TINY = ("--families", "chat", "--rate", "4", "--duration", "8", "--workers", "1")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "bench/mixed_gateways.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_bench_runs_every_seed_and_count_and_seed_0_is_the_searchs_own_run(
    tmp_path: Path,
) -> None:
    out = tmp_path / "runs.json"
    done = bench(*TINY, "--seeds", "2", "--gateways", "1,4", "--h100", "chat=2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["gateways"], r["seed"]) for r in runs) == [(1, 0), (1, 1), (4, 0), (4, 1)]
    assert {r["fleet"] for r in runs} == {"1x H100-SXM-80GB + 3x L40S-48GB"}  # $6.98 of H100
    assert "chat, cost_aware: 1 -> 4 gateways moves the mean of 2 seeds by" in done.stdout
    # Seed 0 with one gateway is what bench/routing.py's (b) runs on that fleet.
    spec = FAMILIES["chat"]
    requests = spec.generate(seed=spec.seed, rate=4, duration_s=8)
    fleet = with_budget({"H100-SXM-80GB": 1, "L40S-48GB": 1}, 2 * 3.49)
    summary = summarize(
        simulate(
            replace(fleet, max_num_batched_tokens="platform"),
            requests,
            SimConfig(policy="cost_aware", router=RouterConfig(), telemetry_interval_s=None),
        )
    )
    (base,) = [r for r in runs if r["gateways"] == 1 and r["seed"] == 0]
    assert base["interactive"] == summary.tiers["interactive"].slo_attainment
    assert 0.0 <= base["interactive"] <= 1.0


def test_a_blend_gets_the_budget_of_the_h100_fleet_named_for_it(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    blend = "chat:3+rag:2"
    done = bench(
        "--families", blend, "--duration", "6", "--workers", "1", "--seeds", "1",
        "--gateways", "1,2", "--h100", f"{blend}=2", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert {(r["family"], r["fleet"]) for r in runs} == {(blend, "1x H100-SXM-80GB + 3x L40S-48GB")}
    assert f"{blend}, cost_aware: 1 -> 2 gateways moves the mean of 1 seeds by" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--families", "nope"), "unknown workload family 'nope'"),
        (("--policies", "fastest"), "unknown policy: fastest"),
        (("--families", "chat:4+rag:2"), "--h100 chat:4+rag:2=N"),  # a blend's budget
        (("--h100", "nope=2"), "unknown workload family 'nope'"),
        (("--gateways", "1,x"), "--gateways takes a comma list of counts"),
        (("--seeds", "0"), "must be at least 1"),
        (("--h100", "chat=0"), "'chat=0' is not FAMILY=COUNT"),
        (("--rate", "-1"), "--duration and --rate must be positive"),
    ],
)
def test_the_bench_refuses_bad_arguments_with_status_2(args: tuple[str, ...], message: str) -> None:
    done = bench(*args)
    assert done.returncode == 2
    assert message in done.stderr
