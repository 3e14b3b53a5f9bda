"""Run the cluster simulator from the command line.

    python -m serving.clustersim --workload azure --fleet H100-SXM-80GB:64
    python -m serving.clustersim --workload mooncake --rate-multiplier 0.5 \\
        --fleet H100-SXM-80GB:4,L40S-48GB:4 --policy cost_aware --out var/sim
    python -m serving.clustersim --workload diurnal --rate 30 --duration 14400 --period 14400 \\
        --fleet H100-SXM-80GB:2 --autoscale 1:16 --compare-static
    python -m serving.clustersim --trace my_trace.jsonl --format mooncake --rate 2 \\
        --fleet H100-SXM-80GB:4
    python -m serving.clustersim --family chat --rate 64 --duration 120 --seed 3 \\
        --fleet H100-SXM-80GB:4

--workload azure and mooncake replay the shipped traces (serving/clustersim/data/traces/);
--trace PATH --format azure|mooncake replays any file in one of those formats instead. A trace
replays at its own pace, or --rate-multiplier times faster, or rescaled to --rate requests/s
on average. --family NAME generates one of the workload families
(serving/clustersim/families.py: code, generation, chat, rag, bursty, diurnal) at its own
rate, window and seed, or at --rate, --duration and --seed.

With --autoscale MIN:MAX every pool starts at its count and the autoscaler policy sets it
within MIN..MAX (or MIN:MAX,MIN:MAX: one pair per pool, in --fleet's order);
--compare-static also runs a static fleet sized for the peak (the most replicas the
autoscaled run used) and prints both.

--gateways N deals the arrivals round robin to N gateways, each knowing only its own requests
in flight and its own prefix index; --telemetry-interval S scrapes every S seconds (0: the
policy's own refresh interval; default 2).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from serving.capacity.autoscaler import AutoscalerConfig
from serving.clustersim.families import FAMILIES, FamilyError, family
from serving.clustersim.fleet import (
    AutoscaleBounds,
    FleetSpec,
    PoolSpec,
    parse_engine_budget,
    pool_name,
)
from serving.clustersim.report import format_summary, plot, summarize, write_csv
from serving.clustersim.simulator import SimConfig, SimResult, simulate
from serving.clustersim.workloads import (
    AZURE_CONV_CSV,
    MOONCAKE_JSONL,
    TRACE_FORMATS,
    SimRequest,
    TraceError,
    bursty,
    diurnal,
    load_trace,
    poisson,
)
from serving.router import POLICIES
from serving.router.external import policy_class

SYNTHETIC_RATE = 10.0  # requests/s of a synthetic workload when --rate is not given


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


def policy_name(text: str) -> str:
    try:
        policy_class(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def family_name(text: str) -> str:
    try:
        family(text)
    except FamilyError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def build_workload(args: argparse.Namespace) -> list[SimRequest]:
    if args.family is not None:
        return family(args.family).generate(
            seed=args.seed, rate=args.rate, duration_s=args.duration
        )
    if args.trace is not None or args.workload in TRACE_FORMATS:
        return build_replay(args)
    rate = args.rate if args.rate is not None else SYNTHETIC_RATE
    duration = args.duration or 3600.0
    if args.workload == "poisson":
        return poisson(rate, duration, seed=args.seed or 0)
    if args.workload == "diurnal":
        return diurnal(
            rate,
            duration,
            period_s=args.period,
            peak_to_trough=args.peak_to_trough,
            seed=args.seed or 0,
        )
    return bursty(rate, duration, burst_rate_per_s=rate * 4, seed=args.seed or 0)


def build_replay(args: argparse.Namespace) -> list[SimRequest]:
    """The shipped trace --workload names, or the file --trace names in --format."""
    if args.rate is not None and args.rate_multiplier is not None:
        raise TraceError("give --rate or --rate-multiplier, not both")
    if args.trace is not None and args.format is None:
        raise TraceError(f"--trace needs --format {'|'.join(TRACE_FORMATS)}")
    if args.trace is not None:
        path, trace_format = args.trace, args.format
    else:
        path = AZURE_CONV_CSV if args.workload == "azure" else MOONCAKE_JSONL
        trace_format = args.workload
    return load_trace(
        path,
        trace_format,
        rate_multiplier=args.rate_multiplier or 1.0,
        rate_per_s=args.rate,
        seed=args.seed or 0,
        window_s=args.duration,
    )


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
    parser.add_argument(
        "--family",
        type=family_name,
        default=None,
        help=f"generate this workload family instead of --workload: {', '.join(FAMILIES)}, or "
        "a blend of them on one fleet, FAMILY:RATE+FAMILY:RATE (its own rate, window and seed "
        "unless --rate, --duration, --seed say; a blend's --seed offsets each part's own)",
    )
    parser.add_argument(
        "--trace", type=Path, default=None, help="replay this trace file (give --format)"
    )
    parser.add_argument("--format", choices=TRACE_FORMATS, default=None, help="--trace's format")
    parser.add_argument(
        "--rate-multiplier",
        type=positive,
        default=None,
        help="trace replay speed: inter-arrival times divided by this (default 1)",
    )
    parser.add_argument(
        "--rate",
        type=positive,
        default=None,
        help=f"mean requests/s: of a synthetic workload (default {SYNTHETIC_RATE:g}), or a "
        "trace rescaled to this many on average (inter-arrival times scaled alike)",
    )
    parser.add_argument("--duration", type=float, default=None, help="seconds of workload")
    parser.add_argument("--period", type=float, default=86400.0, help="diurnal period, s")
    parser.add_argument("--peak-to-trough", type=float, default=4.0)
    parser.add_argument("--fleet", default="H100-SXM-80GB:64", help="GPU:count,GPU:count")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument(
        "--policy",
        type=policy_name,
        default="cost_aware",
        help=f"{', '.join(POLICIES)}, or one written elsewhere as module:Class or "
        "file.py:Class (serving/router/external.py)",
    )
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
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="workload and simulation seed (default 0, or a --family's own)",
    )
    parser.add_argument(
        "--gateways", type=at_least_one, default=1, help="gateway processes (default 1)"
    )
    parser.add_argument(
        "--telemetry-interval",
        type=non_negative,
        default=2.0,
        help="seconds between telemetry scrapes; 0: the policy's own refresh interval",
    )
    parser.add_argument(
        "--engine-budget",
        type=parse_engine_budget,
        default="platform",
        help="every engine's prefill budget per step: platform (what the platform launches "
        "an interactive deployment with), vllm (vLLM's default for the GPU) or a number of "
        "tokens",
    )


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number of at least 1")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of at least 0")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        requests = build_workload(args)
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    fleet = parse_fleet(args.fleet, args.autoscale, args.model)
    try:
        fleet = replace(fleet, max_num_batched_tokens=args.engine_budget)
    except ValueError as error:
        print(f"error: --engine-budget: {error}", file=sys.stderr)
        return 2
    config = SimConfig(
        policy=args.policy,
        autoscaler=AutoscalerConfig() if args.autoscale else None,
        cold_start_s=args.cold_start,
        forecast_period_s=args.period if args.forecast else None,
        seed=args.seed or 0,
        gateways=args.gateways,
        telemetry_interval_s=args.telemetry_interval or None,
    )
    result = simulate(fleet, requests, config)
    summary = summarize(result)
    print(format_summary(summary))
    steps = ", ".join(f"{pool.gpu_class} {fleet.batched_tokens(pool)}" for pool in fleet.pools)
    print(f"  prompt tokens per engine step: {steps} (--engine-budget {args.engine_budget})")
    if args.autoscale:
        print(f"  scaling decisions: {len(result.scaling_events)}")
        for at_s, pool, replicas, reason in result.scaling_events:
            print(f"    {at_s:7.0f} s  {pool} -> {replicas} ({reason})")
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
