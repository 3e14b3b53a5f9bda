"""A routing policy written outside the project (`module:Class`, `file.py:Class`) runs in the
simulator and the benchmark beside ours, judged as a peer; a bad one is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.clustersim import homogeneous, simulate, summarize
from serving.clustersim.simulator import SimConfig
from serving.clustersim.workloads import poisson
from serving.router import LeastLoad
from serving.router.external import policy_class

REPO = Path(__file__).resolve().parents[2]

# A router someone else wrote: least load's choice, counting its own decisions. It wraps
# least load rather than subclassing it: the router's classes may be compiled (mypyc), and
# a Python class cannot inherit from a compiled one.
MINE = """
from serving.router.policies import LeastLoad


class Mine:
    name = "mine"
    decisions = 0

    def __init__(self, state, config=None):
        self.state = state
        self._least_load = LeastLoad(state, config)

    def choose(self, request, now):
        type(self).decisions += 1
        return self._least_load.choose(request, now)
"""


@pytest.fixture
def mine(tmp_path: Path) -> str:
    path = tmp_path / "my_router.py"
    path.write_text(MINE)
    return f"{path}:Mine"


def test_a_policy_is_found_by_name_or_loaded_from_a_file(mine: str) -> None:
    assert policy_class("least_load") is LeastLoad
    loaded = policy_class(mine)
    assert loaded.__name__ == "Mine" and loaded.name == "mine"
    assert policy_class(mine) is loaded  # loaded once
    assert policy_class("serving.router.policies:RoundRobin").name == "round_robin"


def test_the_simulator_routes_with_a_policy_written_elsewhere(mine: str) -> None:
    requests = poisson(4.0, 20.0, seed=1)
    fleet = homogeneous("L40S-48GB", 2)
    theirs = summarize(simulate(fleet, requests, SimConfig(policy=mine, telemetry_interval_s=2.0)))
    ours = summarize(
        simulate(fleet, requests, SimConfig(policy="least_load", telemetry_interval_s=2.0))
    )
    assert policy_class(mine).decisions == len(requests)
    assert theirs.policy == mine and theirs.requests == len(requests) and theirs.failed == 0
    # The same choices as least load's, which it wraps: the same run.
    assert theirs.ttft_p99_s == ours.ttft_p99_s and theirs.cost_usd == ours.cost_usd


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("fastest", "unknown policy 'fastest': one of round_robin, "),
        ("no/such/file.py:Mine", "no file no/such/file.py"),
        ("serving.router.policies:Nothing", "has no class Nothing with a choose"),
        ("serving.router.policies:POLICIES", "has no class POLICIES with a choose"),
        ("no_such_module_here:Mine", "importing no_such_module_here failed"),
    ],
)
def test_a_policy_that_cannot_be_loaded_is_refused_by_name(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        policy_class(name)
    with pytest.raises(ValueError, match=match):
        SimConfig(policy=name)


def test_a_module_that_fails_on_import_is_refused_with_its_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('not today')\n")
    with pytest.raises(ValueError, match=r"importing .*broken\.py failed: RuntimeError"):
        policy_class(f"{broken}:Mine")


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_the_benchmark_judges_a_policy_written_elsewhere_as_a_peer(
    mine: str, tmp_path: Path
) -> None:
    out = tmp_path / "search.json"
    done = run_script(
        "bench/routing.py", "--families", "chat", "--rate", "4", "--duration", "5",
        "--max-replicas", "2", "--gpus", "L40S-48GB", "--mixes", "L40S-48GB:1",
        "--policies", f"cost_aware,{mine}", "--workers", "1", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"best faithful peer ({mine} 1x L40S-48GB" in done.stdout
    policies = {entry["policy"] for entry in json.loads(out.read_text())["smallest"]}
    assert policies == {"cost_aware", mine}


def test_the_cli_refuses_a_policy_it_cannot_load_with_status_2() -> None:
    done = run_script("bench/routing.py", "--families", "chat", "--policies", "nowhere.py:X")
    assert done.returncode == 2
    assert "--policies: policy 'nowhere.py:X': no file nowhere.py" in done.stderr
    done = run_script("-m", "serving.clustersim", "--policy", "nowhere.py:X")
    assert done.returncode == 2
    assert "policy 'nowhere.py:X': no file nowhere.py" in done.stderr
