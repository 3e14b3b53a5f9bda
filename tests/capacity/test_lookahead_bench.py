"""bench/lookahead.py: the yardstick router that runs every replica's engine forward. Its
decisions are the ones the simulation follows, it sees the prefix cache exactly, and it
gives up on a fleet as soon as the fleet is sure to fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import lookahead, routing
from serving.clustersim import SimConfig, SimRequest
from serving.clustersim.fleet import homogeneous
from serving.router import RouterConfig

REPO = Path(__file__).resolve().parents[2]
L40S = "L40S-48GB"


def simulator(replicas: int, may_miss: int | None = None) -> lookahead.LookaheadSimulator:
    return lookahead.LookaheadSimulator(
        homogeneous(L40S, replicas), SimConfig(policy="least_load"), may_miss
    )


def test_the_simulation_follows_every_choice_it_makes() -> None:
    # The simulator builds a new gateway at every routing-table version: each must carry
    # the lookahead's choice, or the run silently follows another policy.
    sim = simulator(3)
    chosen: dict[str, str | None] = {}
    choose = sim._choose

    def recording(request: SimRequest) -> str | None:
        chosen[request.request_id] = choose(request)
        return chosen[request.request_id]

    sim._choose = recording  # type: ignore[method-assign]
    result = sim.run(lookahead.spread_stream(rate=6, seconds=10))
    assert len(chosen) == 60
    assert {r.request.request_id: r.replica_id for r in result.records} == chosen


def test_a_prompt_goes_where_its_prefix_is_cached() -> None:
    # A short request takes the first replica, so a 3,000-token prompt goes to the second;
    # when both are idle again, a request sharing its first 2,800 tokens arrives. Only the
    # second replica prefills 200 tokens instead of 3,000, and the copies see it: it wins
    # against the first replica, which a tie would have given.
    shared = tuple(range(175))
    busy = SimRequest("busy", 0.0, 100, 20, "acme", "interactive")
    first = SimRequest("a", 0.01, 3000, 5, "acme", "interactive", (*shared, 9001, 9002))
    second = SimRequest("b", 5.0, 3000, 5, "acme", "interactive", (*shared, 9003, 9004))
    result = simulator(2).run([busy, first, second])
    where = {r.request.request_id: r.replica_id for r in result.records}
    assert where["busy"] != where["a"]
    assert where["b"] == where["a"]
    # And the hit was real: the second TTFT is a fraction of the first.
    ttft = {r.request.request_id: r.ttft_s or 0.0 for r in result.records}
    assert 0.0 < ttft["b"] < ttft["a"] / 3


def test_an_overloaded_fleet_is_given_up_early() -> None:
    routing.REQUESTS[:] = lookahead.spread_stream(rate=20, seconds=20)
    try:
        assert lookahead.run(homogeneous(L40S, 1), lookahead.LOOKAHEAD, RouterConfig()) is None
        # Enough replicas: the run goes to the end and meets the SLO.
        summary = lookahead.run(homogeneous(L40S, 12), lookahead.LOOKAHEAD, RouterConfig())
        assert summary is not None and routing.meets(summary)
        assert summary.requests == 400
    finally:
        routing.REQUESTS.clear()


def test_the_bench_prints_each_policy_beside_the_lookahead_and_the_bound() -> None:
    # A short family on small fleets: the table has one row per class, every policy's
    # fleet found, and the bound no larger than any of them.
    done = subprocess.run(
        [
            sys.executable,
            "bench/lookahead.py",
            "--families",
            "generation",
            "--duration",
            "10",
            "--gpus",
            "H100-SXM-80GB",
            "--policies",
            "least_load",
            "--workers",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| generation |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    bound, least_load, ahead = int(cells[2]), cells[4], cells[5]
    assert float(cells[3]) > 0  # the sustained floor
    assert int(least_load.split()[0]) >= bound
    assert int(ahead.split()[0]) >= bound


def test_it_refuses_an_unknown_family() -> None:
    done = subprocess.run(
        [sys.executable, "bench/lookahead.py", "--families", "nosuch"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "nosuch" in done.stderr
