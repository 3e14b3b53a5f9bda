"""Mixed fleets of equal budget over several seeds, with one gateway and with sixteen.

    .venv/bin/python bench/mixed_gateways.py [--families all|code,chat,...|BLEND] [--seeds 5]
        [--gateways 1,16] [--policies cost_aware] [--h100 code=3,chat=4,...]
        [--mix H100-SXM-80GB:1+L40S-48GB:1] [--duration S] [--rate R] [--workers 2]
        [--json FILE]

`bench/routing.py`'s fleet (b) for each family: the budget of the smallest H100 fleet on
which any policy met the SLO (`--h100`, by default the counts of the search in
bench/RESULTS.md, "Router 782aa31"), spent half on H100 and half on L40S (`--mix`, whole
replicas, never over budget: `with_budget`). Every policy is run on it with the arrivals
dealt to each `--gateways` count, at `SimConfig.seed` 0 to `--seeds` - 1 (the router's and
the simulator's draws; the family's own arrivals stay those of its seed, as the search
runs them). Seed 0 with one gateway is the search's own run, figure for figure. A blend
(`code:48+generation:24`, `serving.clustersim.families.Blend`) takes its H100 count from
`--h100 'code:48+generation:24=4'`.

Why seeds: these fleets have about three quarters of the capacity their traffic needs, and
a run can tip into a worse state and stay there (bench/RESULTS.md, "Router 782aa31"), so a
single seed's move between one gateway and sixteen measures where a run tipped as much as
what the gateways changed. The table gives, per family, policy and gateway count, the
share of interactive requests within both clocks (TTFT and TPOT), mean over the seeds with
its least and greatest, the standard tier's mean beside it, and each count's mean against
the first count's (the must-show: at most 5 %).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.routing import H100, attainment, parse_mixes
from serving.clustersim import SimConfig, SimRequest, simulate, summarize
from serving.clustersim.families import FamilyError, family, parse_families
from serving.clustersim.fleet import FleetSpec, with_budget
from serving.engine.specs import load_gpu_specs
from serving.router import POLICIES, RouterConfig

# The smallest H100 fleet any policy met the SLO on, per family (bench/RESULTS.md).
DEFAULT_H100 = {"code": 3, "generation": 5, "chat": 4, "rag": 5, "bursty": 5, "diurnal": 9}
MOVE_LIMIT = 0.05

# Set per family before the pool forks, so the requests are never pickled.
REQUESTS: list[SimRequest] = []


@dataclass(frozen=True, slots=True)
class Run:
    policy: str
    gateways: int
    seed: int
    interactive: float  # share within both clocks, 0-1
    standard: float | None


def run(task: tuple[FleetSpec, str, int, int]) -> Run:
    fleet, policy, gateways, seed = task
    config = SimConfig(
        policy=policy,
        router=RouterConfig(),
        gateways=gateways,
        telemetry_interval_s=None,
        seed=seed,
    )
    summary = summarize(simulate(fleet, REQUESTS, config))
    standard = summary.tiers.get("standard")
    return Run(
        policy,
        gateways,
        seed,
        attainment(summary),
        None if standard is None else standard.slo_attainment,
    )


def table(family: str, fleet: FleetSpec, runs: list[Run], counts: list[int]) -> list[str]:
    """The family's rows (printed) and its verdict lines (returned)."""
    print(f"\n{family}: {fleet.describe()} (${fleet.hourly_cost:.2f}/h)")
    print(
        f"{'policy':26s} {'gateways':>8s} {'interactive mean':>16s} {'min':>7s} {'max':>7s} "
        f"{'standard mean':>13s} {'move':>7s}"
    )
    verdicts = []
    for policy in dict.fromkeys(r.policy for r in runs):
        first: float | None = None
        for count in counts:
            mine = [r for r in runs if r.policy == policy and r.gateways == count]
            shares = [100 * r.interactive for r in mine]
            standard = [100 * r.standard for r in mine if r.standard is not None]
            mean = statistics.fmean(shares)
            first = mean if first is None else first
            move = (mean - first) / first if first else 0.0
            print(
                f"{policy:26s} {count:8d} {mean:16.2f} {min(shares):7.2f} {max(shares):7.2f} "
                f"{statistics.fmean(standard) if standard else float('nan'):13.2f} "
                f"{100 * move:+6.1f}%"
            )
            if count != counts[0]:
                within = "within" if abs(move) <= MOVE_LIMIT else "NOT within"
                verdicts.append(
                    f"{family}, {policy}: {counts[0]} -> {count} gateways moves the mean of "
                    f"{len(mine)} seeds by {100 * move:+.1f}% ({within} 5 %)"
                )
    return verdicts


def parse_counts(text: str) -> dict[str, int]:
    counts = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        try:
            family(name)
        except FamilyError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not FAMILY=COUNT")
        counts[name] = int(count)
    return counts


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="all", help="all, or a comma list")
    parser.add_argument("--seeds", type=int, default=5, help="SimConfig seeds 0..N-1")
    parser.add_argument("--gateways", default="1,16", help="gateway counts, the first the base")
    parser.add_argument("--policies", default="cost_aware", help="all, or a comma list")
    parser.add_argument("--h100", type=parse_counts, default={}, help="FAMILY=COUNT,...")
    parser.add_argument("--mix", default=f"{H100}:1+L40S-48GB:1")
    parser.add_argument("--duration", type=float, default=None, help="seconds (family's own)")
    parser.add_argument("--rate", type=float, default=None, help="requests/s (family's own)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        families = parse_families(args.families)
    except FamilyError as error:
        parser.error(str(error))
    policies = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policy: {', '.join(unknown)}")
    unsized = [f for f in families if f not in {**DEFAULT_H100, **args.h100}]
    if unsized:
        parser.error(f"name the H100 fleet whose budget a blend gets: --h100 {unsized[0]}=N")
    try:
        args.gateways = [int(n) for n in args.gateways.split(",")]
    except ValueError:
        parser.error(f"--gateways takes a comma list of counts, not {args.gateways!r}")
    if args.seeds < 1 or args.workers < 1 or any(n < 1 for n in args.gateways):
        parser.error("--seeds, --workers and every gateway count must be at least 1")
    if any(value is not None and not value > 0 for value in (args.duration, args.rate)):
        parser.error("--duration and --rate must be positive")
    args.families, args.policies = families, policies
    args.mix = parse_mixes(args.mix)[0]
    return args


def main() -> int:
    global REQUESTS
    args = parse_arguments()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # rows as they come
    print("command: " + " ".join([".venv/bin/python", "bench/mixed_gateways.py", *sys.argv[1:]]))
    h100_price = load_gpu_specs()[H100].usd_per_hour
    started = time.perf_counter()
    verdicts: list[str] = []
    entries: list[dict[str, object]] = []
    for name in args.families:
        spec = family(name)
        duration = args.duration or spec.duration_s
        rate = args.rate or spec.rate_per_s
        REQUESTS = spec.generate(seed=spec.seed, rate=rate, duration_s=duration)
        budget = {**DEFAULT_H100, **args.h100}[name] * h100_price
        fleet = replace(with_budget(args.mix, budget), max_num_batched_tokens="platform")
        tasks = [
            (fleet, policy, count, seed)
            for policy in args.policies
            for count in args.gateways
            for seed in range(args.seeds)
        ]
        with get_context("fork").Pool(args.workers) as pool:  # forked after REQUESTS is set
            runs = pool.map(run, tasks)
        verdicts += table(name, fleet, runs, args.gateways)
        entries += [{"family": name, "fleet": fleet.describe(), **asdict(r)} for r in runs]
    print(f"\nverdicts ({time.perf_counter() - started:.0f} s):")
    for line in verdicts:
        print("  " + line)
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": entries}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
