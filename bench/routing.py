"""The four routing policies on homogeneous fleets and a heterogeneous fleet, on the Azure
conversation trace and the Mooncake trace, in the cluster simulator (engine model + the real
router).

    .venv/bin/python bench/routing.py [--azure-rate 10] [--mooncake-rate 0.5]
        [--mix H100-SXM-80GB:0.5,A100-SXM-80GB:0.25,L40S-48GB:0.25] [--traces azure,mooncake]
        [--gpus <classes of the homogeneous search, default every class in gpus.csv>]

Per trace:
  (h) per GPU class, the smallest homogeneous fleet on which least-load serves >= 99 % of
      interactive requests within the interactive TTFT objective (doubling, then bisecting);
  (a) all four policies on the cheapest of those; the cheapest homogeneous fleet meeting the
      SLO is the lowest $/Mtok of any (h) row and any (a) policy meeting it;
  (b) a heterogeneous fleet of the smallest H100 fleet's hourly budget (the `--mix` shares of
      the budget in whole replicas, never over it), all four policies on it;
  (c) scaled-down heterogeneous fleets under cost-aware; the cheapest one meeting the SLO.
Targets, checked in the same run: cost-aware meets the interactive TTFT SLO for >= 99 % at
>= 30 % below the cheapest homogeneous $/Mtok; its p99 TTFT on (b) is >= 20 % below
least-load's. Tenants: acme and globex interactive (60 % of traffic), initech standard (25 %),
umbrella batch (15 %); router SLO tiers are the defaults (interactive TTFT 1 s, TPOT 50 ms),
except Mooncake's interactive TTFT objective (--mooncake-ttft, 5 s: its prompts average 15k
tokens and a fifth of them cannot prefill within 1 s on an idle H100). Runs are spread over
`--workers` processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from multiprocessing import get_context
from multiprocessing.pool import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.clustersim import (
    SimConfig,
    SimRequest,
    Summary,
    homogeneous,
    load_azure_conversation,
    load_mooncake,
    simulate,
    summarize,
    with_budget,
)
from serving.clustersim.fleet import FleetSpec
from serving.engine.specs import load_gpu_specs
from serving.router import DEFAULT_SLO_TIERS, POLICIES, RouterConfig, SloTier

SLO_SHARE = 0.99
COST_TARGET = 0.30
P99_TARGET = 0.20
H100 = "H100-SXM-80GB"
MAX_REPLICAS = 128

# Set per trace before the worker pool forks, so the requests are never pickled.
REQUESTS: list[SimRequest] = []


def run(fleet: FleetSpec, policy: str, router: RouterConfig) -> Summary:
    return summarize(simulate(fleet, REQUESTS, SimConfig(policy=policy, router=router)))


def run_task(task: tuple[FleetSpec, str, RouterConfig]) -> Summary:
    return run(*task)


def with_interactive_ttft(ttft_s: float) -> RouterConfig:
    tiers = dict(DEFAULT_SLO_TIERS)
    tiers["interactive"] = SloTier("interactive", ttft_s, tiers["interactive"].tpot_s)
    return RouterConfig(slo_tiers=tiers)


def meets(summary: Summary) -> bool:
    tier = summary.tiers.get("interactive")
    return tier is not None and tier.ttft_attainment >= SLO_SHARE


def hopeless(summary: Summary) -> bool:
    """More requests than the SLO allows to miss cannot run at all (prompt over the KV)."""
    return summary.failed > (1 - SLO_SHARE) * summary.requests


def smallest_meeting(task: tuple[str, RouterConfig]) -> tuple[str, int, Summary | None]:
    """The fewest replicas of one GPU class on which least-load meets the SLO: doubling
    up to a fleet that meets it, then bisecting (attainment grows with the fleet)."""
    gpu, router = task
    failing, meeting, found = 0, 0, None
    size = 1
    while size <= MAX_REPLICAS:
        summary = run(homogeneous(gpu, size), "least_load", router)
        if meets(summary):
            meeting, found = size, summary
            break
        if hopeless(summary):
            return gpu, 0, None
        failing, size = size, size * 2
    if found is None:
        return gpu, 0, None
    while meeting - failing > 1:
        middle = (failing + meeting) // 2
        summary = run(homogeneous(gpu, middle), "least_load", router)
        if meets(summary):
            meeting, found = middle, summary
        else:
            failing = middle
    return gpu, meeting, found


def row(label: str, summary: Summary, hourly: float) -> str:
    tier = summary.tiers["interactive"]
    return (
        f"{label:<3} {summary.policy:<16} {summary.fleet:<50} {hourly:>7.2f} "
        f"{tier.ttft_attainment:>8.2%} {tier.ttft_p99_s:>8.3f} {summary.ttft_p99_s:>8.3f} "
        f"{summary.tpot_p99_s * 1000:>7.1f} {summary.cost_per_million_tokens:>8.4f} "
        f"{summary.gpu_utilization:>5.0%}"
    )


HEADER = (
    f"{'':<3} {'policy':<16} {'fleet':<50} {'$/hour':>7} {'int SLO':>8} {'int p99':>8} "
    f"{'all p99':>8} {'TPOTp99':>7} {'$/Mtok':>8} {'util':>5}"
)


def bench_trace(
    name: str, router: RouterConfig, mix: dict[str, float], gpus: list[str], pool: Pool
) -> list[str]:
    verdicts = []
    print(f"\n== {name}: {len(REQUESTS)} requests over {REQUESTS[-1].arrival_s:.0f} s ==")
    print(HEADER)
    specs = load_gpu_specs()
    # (h) per GPU class, the smallest homogeneous fleet meeting the SLO under least-load.
    smallest: dict[str, tuple[int, Summary]] = {}
    for gpu, count, summary in pool.imap(smallest_meeting, [(g, router) for g in gpus]):
        if summary is None:
            print(f"(h) {'least_load':<16} {gpu:<50} no fleet up to {MAX_REPLICAS} meets it")
            continue
        smallest[gpu] = (count, summary)
        print(row("(h)", summary, count * specs[gpu].usd_per_hour))
    if not smallest:
        return [f"{name}: no homogeneous fleet meets the SLO"]
    # (a) all four policies on the cheapest of them; the baseline is the lowest $/Mtok
    # of any policy meeting the SLO on any of the smallest homogeneous fleets.
    cheapest_gpu = min(smallest, key=lambda g: smallest[g][1].cost_per_million_tokens)
    count = smallest[cheapest_gpu][0]
    fleet_a = homogeneous(cheapest_gpu, count)
    results_a = dict(
        zip(POLICIES, pool.map(run_task, [(fleet_a, p, router) for p in POLICIES]), strict=True)
    )
    for summary in results_a.values():
        print(row("(a)", summary, fleet_a.hourly_cost))
    baseline = min(
        [s.cost_per_million_tokens for s in results_a.values() if meets(s)]
        + [summary.cost_per_million_tokens for _, summary in smallest.values()]
    )

    # (b) a heterogeneous fleet of the smallest meeting H100 fleet's hourly budget.
    budget = (
        smallest[H100][0] * specs[H100].usd_per_hour if H100 in smallest else fleet_a.hourly_cost
    )
    fleet_b = with_budget(mix, budget)
    results_b = dict(
        zip(POLICIES, pool.map(run_task, [(fleet_b, p, router) for p in POLICIES]), strict=True)
    )
    for summary in results_b.values():
        print(row("(b)", summary, fleet_b.hourly_cost))

    # (c) scaled-down heterogeneous fleets under cost-aware, two at a time.
    fleets_c: list[FleetSpec] = []
    for scale in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4):
        fleet_c = with_budget(mix, budget * scale)
        if fleet_c.pools and all(f.describe() != fleet_c.describe() for f in fleets_c):
            fleets_c.append(fleet_c)
    cheapest: tuple[FleetSpec, Summary] | None = None
    if meets(results_b["cost_aware"]):
        cheapest = (fleet_b, results_b["cost_aware"])
    for fleet_c, summary in zip(
        fleets_c, pool.map(run_task, [(f, "cost_aware", router) for f in fleets_c]), strict=True
    ):
        print(row("(c)", summary, fleet_c.hourly_cost))
        if meets(summary) and (
            cheapest is None
            or summary.cost_per_million_tokens < cheapest[1].cost_per_million_tokens
        ):
            cheapest = (fleet_c, summary)

    if cheapest is None:
        verdicts.append(
            f"{name}: cost-aware meets the interactive TTFT SLO on no heterogeneous fleet tried: FAIL"
        )
    else:
        saving = 1 - cheapest[1].cost_per_million_tokens / baseline
        verdict = "PASS" if saving >= COST_TARGET else "FAIL"
        verdicts.append(
            f"{name}: cost-aware meets the SLO on {cheapest[0].describe()} at "
            f"${cheapest[1].cost_per_million_tokens:.4f}/Mtok, {saving:+.0%} vs the cheapest "
            f"homogeneous (${baseline:.4f}/Mtok, {count}x {cheapest_gpu}): {verdict} "
            f"(target >= {COST_TARGET:.0%})"
        )
    ca, ll = results_b["cost_aware"].ttft_p99_s, results_b["least_load"].ttft_p99_s
    better = 1 - ca / ll
    verdicts.append(
        f"{name}: p99 TTFT on (b) cost-aware {ca:.3f} s vs least-load {ll:.3f} s: {better:+.0%} "
        f"lower: {'PASS' if better >= P99_TARGET else 'FAIL'} (target >= {P99_TARGET:.0%})"
    )
    return verdicts


def parse_mix(text: str) -> dict[str, float]:
    return {gpu: float(share) for gpu, share in (part.split(":") for part in text.split(","))}


def main() -> int:
    global REQUESTS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default="azure,mooncake")
    parser.add_argument("--azure-rate", type=float, default=10.0)
    parser.add_argument("--mooncake-rate", type=float, default=0.5)
    parser.add_argument(
        "--mooncake-ttft",
        type=float,
        default=5.0,
        help="interactive TTFT objective on Mooncake, s (a fifth of its prompts take over 1 s "
        "to prefill on an idle H100)",
    )
    parser.add_argument("--mix", default="H100-SXM-80GB:0.5,A100-SXM-80GB:0.25,L40S-48GB:0.25")
    parser.add_argument(
        "--gpus", default=",".join(load_gpu_specs()), help="GPU classes of the homogeneous search"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print("command: " + " ".join([".venv/bin/python", "bench/routing.py", *sys.argv[1:]]))
    started = time.perf_counter()
    mix = parse_mix(args.mix)
    gpus = args.gpus.split(",")
    verdicts: list[str] = []
    for trace in args.traces.split(","):
        if trace == "azure":
            router = RouterConfig()
            REQUESTS = load_azure_conversation(rate_multiplier=args.azure_rate)
            label = f"Azure conversation x{args.azure_rate:g}"
        else:
            router = with_interactive_ttft(args.mooncake_ttft)
            REQUESTS = load_mooncake(rate_multiplier=args.mooncake_rate)
            label = f"Mooncake x{args.mooncake_rate:g}, interactive TTFT {args.mooncake_ttft:g} s"
        # Forked after REQUESTS is set: workers inherit it.
        with get_context("fork").Pool(args.workers) as pool:
            verdicts += bench_trace(label, router, mix, gpus, pool)
    print("\n" + "\n".join(verdicts))
    print(f"\n(wall {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
