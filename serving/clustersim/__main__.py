"""Run the cluster simulator from the command line.

    python -m serving.clustersim --workload azure --fleet H100-SXM-80GB:64
    python -m serving.clustersim --workload mooncake --rate-multiplier 0.5 \\
        --fleet H100-SXM-80GB:4,L40S-48GB:4 --policy cost_aware --out var/sim
    python -m serving.clustersim --workload diurnal --rate 30 --duration 14400 --period 14400 \\
        --fleet H100-SXM-80GB:2 --autoscale 1:16 --compare-static

With --autoscale MIN:MAX every pool starts at its count and the autoscaler policy sets it
within MIN..MAX (or MIN:MAX,MIN:MAX: one pair per pool, in --fleet's order);
--compare-static also runs a static fleet sized for the peak (the most replicas the
autoscaled run used) and prints both.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from serving.capacity.autoscaler import AutoscalerConfig
from serving.clustersim.fleet import AutoscaleBounds, FleetSpec, PoolSpec, pool_name
from serving.clustersim.report import format_summary, plot, summarize, write_csv
from serving.clustersim.simulator import SimConfig, SimResult, simulate
from serving.clustersim.workloads import (
    SimRequest,
    bursty,
    diurnal,
    load_azure_conversation,
    load_mooncake,
    poisson,
)
from serving.router import POLICIES


def parse_fleet(text: str, autoscale: str | None, model: str) -> FleetSpec:
    parts = text.split(",")
    bounds: list[AutoscaleBounds | None] = [None] * len(parts)
    if autoscale:
        given: list[AutoscaleBounds | None] = [parse_bounds(i) for i in autoscale.split(",")]
        if len(given) not in (1, len(parts)):
            raise ValueError(
                f"--autoscale gives {len(given)} MIN:MAX, --fleet {len(parts)} pools: "
                "give one for every pool or one for all"
            )
        bounds = given * len(parts) if len(given) == 1 else given
    pools = []
    for part, pool_bounds in zip(parts, bounds, strict=True):
        gpu, _, count = part.partition(":")
        pools.append(PoolSpec(pool_name(gpu), gpu, int(count or 1), autoscale=pool_bounds))
    return FleetSpec(pools=tuple(pools), model=model)


def parse_bounds(text: str) -> AutoscaleBounds:
    low, _, high = text.partition(":")
    return AutoscaleBounds(int(low), int(high))


def build_workload(args: argparse.Namespace) -> list[SimRequest]:
    if args.workload == "azure":
        return load_azure_conversation(
            rate_multiplier=args.rate_multiplier, seed=args.seed, window_s=args.duration
        )
    if args.workload == "mooncake":
        return load_mooncake(rate_multiplier=args.rate_multiplier, window_s=args.duration)
    duration = args.duration or 3600.0
    if args.workload == "poisson":
        return poisson(args.rate, duration, seed=args.seed)
    if args.workload == "diurnal":
        return diurnal(
            args.rate,
            duration,
            period_s=args.period,
            peak_to_trough=args.peak_to_trough,
            seed=args.seed,
        )
    return bursty(args.rate, duration, burst_rate_per_s=args.rate * 4, seed=args.seed)


def peak_static(result: SimResult) -> FleetSpec:
    peak = {
        pool.name: max((point.ready.get(pool.name, 0) for point in result.timeline), default=0)
        for pool in result.fleet.pools
    }
    pools = tuple(
        replace(pool, replicas=max(1, peak[pool.name]), autoscale=None)
        for pool in result.fleet.pools
    )
    return replace(result.fleet, pools=pools)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serving.clustersim", description=(__doc__ or "").split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload", choices=["azure", "mooncake", "poisson", "diurnal", "bursty"], default="azure"
    )
    parser.add_argument("--rate-multiplier", type=float, default=1.0, help="trace replay speed")
    parser.add_argument("--rate", type=float, default=10.0, help="synthetic mean requests/s")
    parser.add_argument("--duration", type=float, default=None, help="seconds of workload")
    parser.add_argument("--period", type=float, default=86400.0, help="diurnal period, s")
    parser.add_argument("--peak-to-trough", type=float, default=4.0)
    parser.add_argument("--fleet", default="H100-SXM-80GB:64", help="GPU:count,GPU:count")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--policy", choices=list(POLICIES), default="cost_aware")
    parser.add_argument(
        "--autoscale",
        default=None,
        help="MIN:MAX replicas per pool, or MIN:MAX,MIN:MAX one per --fleet pool",
    )
    parser.add_argument(
        "--forecast", action="store_true", help="autoscaler forecast from the daily pattern"
    )
    parser.add_argument("--cold-start", type=float, default=90.0)
    parser.add_argument("--compare-static", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write CSV and PNG here")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:

    requests = build_workload(args)
    fleet = parse_fleet(args.fleet, args.autoscale, args.model)
    config = SimConfig(
        policy=args.policy,
        autoscaler=AutoscalerConfig() if args.autoscale else None,
        cold_start_s=args.cold_start,
        forecast_period_s=args.period if args.forecast else None,
        seed=args.seed,
    )
    result = simulate(fleet, requests, config)
    summary = summarize(result)
    print(format_summary(summary))
    if args.autoscale:
        print(f"  scaling decisions: {len(result.scaling_events)}")
    if args.out:
        paths = write_csv(result, summary, args.out) + plot(result, summary, args.out)
        print("  wrote " + ", ".join(str(p) for p in paths))
    if args.autoscale and args.compare_static:
        static = peak_static(result)
        static_summary = summarize(simulate(static, requests, replace(config, autoscaler=None)))
        print("static provisioning for the peak:")
        print(format_summary(static_summary))
        saved = 1 - summary.gpu_hours / static_summary.gpu_hours
        print(
            f"autoscaled {summary.gpu_hours:.1f} GPU-hours vs static {static_summary.gpu_hours:.1f} "
            f"({saved:.0%} fewer)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
