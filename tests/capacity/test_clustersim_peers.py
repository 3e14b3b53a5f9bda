"""Each peer router reproduces, in the cluster simulator, the result its project publishes:
prefix-aware routing beats round robin at equal fleet when tenants share long system prompts
that do not all fit in every replica's KV cache."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from serving.clustersim import SimConfig, SimRequest, Summary, homogeneous, simulate, summarize
from serving.clustersim.fleet import FleetSpec
from serving.clustersim.workloads import salted_blocks
from serving.router import POLICIES

# 64 tenants x 8,192-token system prompts: 512k tokens of prefix, more than one H100's KV
# (about 400k tokens of an 8B model), so round robin keeps evicting what it needs. The
# engines run vLLM's own 8192-token steps, as the projects' published benchmarks ran them.
# On the platform's 1024-token steps round robin's re-prefills stall decodes less, and it
# keeps 94 % of the SLO against the prefix-aware peers' 98-100 % (the last test).
TENANTS = 64
SYSTEM_TOKENS = 8192
FLEET = replace(homogeneous("H100-SXM-80GB", 4), max_num_batched_tokens="vllm")


def shared_prefix_workload(rate: float, duration_s: float, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    system_blocks = list(range(SYSTEM_TOKENS // 512))
    requests: list[SimRequest] = []
    at = 0.0
    while (at := at + rng.expovariate(rate)) < duration_s:
        n = len(requests)
        tenant = f"tenant-{rng.randrange(TENANTS)}"
        prompt = SYSTEM_TOKENS + rng.randint(128, 512)
        blocks = salted_blocks(tenant, [*system_blocks, 10_000 + n], prompt)
        requests.append(SimRequest(f"r{n}", at, prompt, 128, tenant, "interactive", blocks))
    return requests


def run(
    policy: str,
    requests: list[SimRequest],
    interval_s: float | None = None,
    fleet: FleetSpec = FLEET,
) -> Summary:
    """The policy with its own metrics refresh (`refresh_interval_s`) unless told otherwise."""
    if interval_s is None:
        interval_s = getattr(POLICIES[policy], "refresh_interval_s", None) or 2.0
    config = SimConfig(policy=policy, telemetry_interval_s=interval_s)
    return summarize(simulate(fleet, requests, config))


@pytest.fixture(scope="module")
def workload() -> list[SimRequest]:
    return shared_prefix_workload(rate=20.0, duration_s=30.0)


@pytest.fixture(scope="module")
def round_robin(workload: list[SimRequest]) -> Summary:
    return run("round_robin", workload)


def slo(summary: Summary) -> float:
    return summary.tiers["interactive"].slo_attainment


@pytest.mark.parametrize("peer", ["llm_d_epp", "dynamo_kv", "production_stack_prefix"])
def test_a_prefix_aware_peer_beats_round_robin_on_a_shared_prefix_workload(
    peer: str, workload: list[SimRequest], round_robin: Summary
) -> None:
    figures = run(peer, workload)
    assert figures.failed == round_robin.failed == 0
    assert slo(figures) >= slo(round_robin) + 0.15
    assert figures.ttft_p50_s <= round_robin.ttft_p50_s / 2


def test_production_stacks_default_round_robin_is_plain_round_robin(
    workload: list[SimRequest], round_robin: Summary
) -> None:
    figures = run("production_stack_roundrobin", workload)
    assert slo(figures) == pytest.approx(slo(round_robin), abs=0.05)


def test_llm_d_herds_when_its_metrics_are_as_stale_as_the_default_scrape() -> None:
    # Twice the load: the queue scorer's 50 ms view keeps the fleet level, a 2 s view
    # sends each burst to the endpoint that looked idle at the last scrape.
    busy = shared_prefix_workload(rate=40.0, duration_s=30.0, seed=0)
    fresh = run("llm_d_epp", busy)
    stale = run("llm_d_epp", busy, interval_s=2.0)
    assert slo(fresh) >= slo(stale) + 0.1


@pytest.mark.parametrize("peer", ["llm_d_epp", "dynamo_kv", "production_stack_prefix"])
def test_prefix_awareness_still_pays_on_the_platforms_engines(
    peer: str, workload: list[SimRequest]
) -> None:
    platform = replace(FLEET, max_num_batched_tokens="platform")
    assert platform.batched_tokens(platform.pools[0]) == 1024
    spread = run("round_robin", workload, fleet=platform)
    figures = run(peer, workload, fleet=platform)
    assert slo(figures) >= slo(spread) + 0.03
    assert figures.ttft_p50_s <= spread.ttft_p50_s / 2
