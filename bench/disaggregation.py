"""Colocated against disaggregated prefill/decode, in the cluster simulator (engine model +
the real router), under the SLO on both clocks.

    .venv/bin/python bench/disaggregation.py --quick      # about 3 minutes on 2 cores
    .venv/bin/python bench/disaggregation.py              # longer windows, wider sweeps

Per workload family (short chat, RAG, long context: Poisson arrivals with log-normal
lengths; the Mooncake trace's first 1,200 requests, copied to bench/data/) and fleet shape
(colocated H100; disaggregated H100 prefill + H100 decode; disaggregated L40S prefill +
H200 decode, over InfiniBand NDR), the smallest fleet on which >= 99 % of interactive
requests meet both the TTFT and the TPOT objective: colocated by doubling then bisecting
(`routing.smallest_size`), disaggregated by growing whichever pool raises attainment more,
one replica at a time. Columns: that fleet, its $/h, goodput per GPU (requests of every
tier within their tier's objectives, per second, per GPU), interactive TTFT p50/p99 and
TPOT p50/p99.

The sweep asks where disaggregation starts to pay: the cheapest fleet of each shape meeting
the SLO by prompt length (one length class, 4 requests/s, interactive TTFT 5 s at every
length so that 16k prompts can meet it), by fleet size (the arrival rate
scaled at 4,096-token prompts) and, for H100 + H100, by link (links.csv).

SLO: the router's default tiers (interactive TTFT 1 s, TPOT 50 ms; standard 3 s, 100 ms),
except an interactive TTFT of 5 s on long context and Mooncake (prompts of 16k tokens and
more cannot prefill within 1 s on an idle L40S, nor the longest on an H100). Tenants as in
bench/routing.py: 60 % interactive, 25 % standard, 15 % batch. Model llama-3.1-8b, bf16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.routing import smallest_size, with_interactive_ttft
from serving.clustersim import (
    LengthClass,
    LengthMix,
    SimConfig,
    SimRequest,
    Summary,
    homogeneous,
    load_mooncake,
    poisson,
    simulate,
    summarize,
)
from serving.clustersim.fleet import FleetSpec, disaggregated
from serving.router import RouterConfig

SLO_SHARE = 0.99
MAX_REPLICAS = 48
MOONCAKE_HEAD = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_head.jsonl"
H100, H200, L40S = "H100-SXM-80GB", "H200-SXM-141GB", "L40S-48GB"
LINK = "infiniband-ndr-400"
# (label, prefill class, decode class); None as the prefill class: colocated.
SHAPES: tuple[tuple[str, str | None, str], ...] = (
    ("colocated H100", None, H100),
    ("disagg H100+H100", H100, H100),
    ("disagg L40S+H200", L40S, H200),
)


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    requests: list[SimRequest]
    router: RouterConfig


@dataclass(frozen=True, slots=True)
class Found:
    fleet: FleetSpec | None
    summary: Summary | None
    runs: int


def run(fleet: FleetSpec, requests: list[SimRequest], router: RouterConfig) -> Summary:
    policy = "disaggregated" if fleet.disaggregated else "cost_aware"
    return summarize(simulate(fleet, requests, SimConfig(policy=policy, router=router)))


def attainment(summary: Summary) -> float:
    tier = summary.tiers.get("interactive")
    return tier.slo_attainment if tier is not None else 1.0


def meets(summary: Summary) -> bool:
    return attainment(summary) >= SLO_SHARE


def goodput_per_gpu(summary: Summary, gpus: int) -> float:
    within = sum(t.slo_attainment * t.requests for t in summary.tiers.values())
    return within / summary.duration_s / gpus


def smallest_colocated(family: Family, gpu: str) -> Found:
    runs = 0

    def evaluate(size: int) -> Summary:
        nonlocal runs
        runs += 1
        return run(homogeneous(gpu, size), family.requests, family.router)

    count, summary = smallest_size(evaluate, meets, attainment, MAX_REPLICAS)
    return Found(homogeneous(gpu, count) if count else None, summary, runs)


def smallest_disaggregated(family: Family, prefill_gpu: str, decode_gpu: str, link: str) -> Found:
    """Grow from one prefill and one decode replica, adding to whichever pool raises
    interactive attainment more (the cheaper on a tie), until the SLO is met."""
    prefills, decodes, runs = 1, 1, 0
    cache: dict[tuple[int, int], Summary] = {}

    def evaluate(p: int, d: int) -> Summary:
        nonlocal runs
        if (p, d) not in cache:
            runs += 1
            fleet = disaggregated(prefill_gpu, p, decode_gpu, d, kv_link=link)
            cache[(p, d)] = run(fleet, family.requests, family.router)
        return cache[(p, d)]

    while prefills + decodes <= MAX_REPLICAS:
        summary = evaluate(prefills, decodes)
        if meets(summary):
            fleet = disaggregated(prefill_gpu, prefills, decode_gpu, decodes, kv_link=link)
            return Found(fleet, summary, runs)
        more_prefill = evaluate(prefills + 1, decodes)
        more_decode = evaluate(prefills, decodes + 1)
        gain_p, gain_d = attainment(more_prefill), attainment(more_decode)
        cheaper_prefill = more_prefill.cost_per_hour <= more_decode.cost_per_hour
        if gain_p > gain_d or (gain_p == gain_d and cheaper_prefill):
            prefills += 1
        else:
            decodes += 1
    return Found(None, None, runs)


def smallest(family: Family, shape: tuple[str, str | None, str], link: str = LINK) -> Found:
    _, prefill_gpu, decode_gpu = shape
    if prefill_gpu is None:
        return smallest_colocated(family, decode_gpu)
    return smallest_disaggregated(family, prefill_gpu, decode_gpu, link)


HEADER = (
    f"{'family':<14} {'shape':<18} {'smallest fleet meeting the SLO':<44} {'$/h':>6} "
    f"{'int T+T':>7} {'goodput/GPU':>11} {'TTFT p50':>8} {'p99':>6} {'TPOT p50':>8} {'p99':>5}"
)


def row(family: str, shape: str, found: Found) -> str:
    if found.fleet is None or found.summary is None:
        return f"{family:<14} {shape:<18} no fleet up to {MAX_REPLICAS} replicas meets it"
    summary, fleet = found.summary, found.fleet
    tier = summary.tiers["interactive"]
    return (
        f"{family:<14} {shape:<18} {fleet.describe():<44} {fleet.hourly_cost:>6.2f} "
        f"{tier.slo_attainment:>7.2%} {goodput_per_gpu(summary, fleet.replicas):>11.2f} "
        f"{tier.ttft_p50_s:>8.3f} {tier.ttft_p99_s:>6.3f} {tier.tpot_p50_s * 1000:>8.1f} "
        f"{tier.tpot_p99_s * 1000:>5.1f}"
    )


def one_class(
    prompt: int, output: int, rate: float, duration: float, seed: int
) -> list[SimRequest]:
    lengths = LengthMix((LengthClass(1.0, prompt, output, sigma=0.3),))
    return poisson(rate, duration, lengths=lengths, seed=seed)


def families(duration: float, mooncake_window: float) -> list[Family]:
    default = RouterConfig()
    long_ttft = with_interactive_ttft(5.0)
    return [
        Family("short chat", one_class(600, 150, 20.0, duration, 1), default),
        Family("RAG", one_class(3000, 250, 6.0, duration, 2), default),
        Family("long context", one_class(16000, 200, 1.5, duration, 3), long_ttft),
        Family(
            "Mooncake",
            load_mooncake(MOONCAKE_HEAD, window_s=mooncake_window),
            long_ttft,
        ),
    ]


Task = tuple[str, Family, tuple[str, str | None, str], str]


def solve(task: Task) -> tuple[str, str, str, Found]:
    label, family, shape, link = task
    return label, shape[0], link, smallest(family, shape, link)


def table(
    tasks: list[Task], pool_map: Callable[..., list[tuple[str, str, str, Found]]]
) -> dict[tuple[str, str, str], Found]:
    return {(label, shape, link): found for label, shape, link, found in pool_map(solve, tasks)}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, narrow sweeps")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print("command: " + " ".join([".venv/bin/python", "bench/disaggregation.py", *sys.argv[1:]]))
    started = time.perf_counter()
    duration = 60.0 if args.quick else 300.0
    mooncake_window = 150.0 if args.quick else 330.0
    lengths = (256, 1024, 4096, 16000) if args.quick else (256, 512, 1024, 2048, 4096, 8192, 16000)
    rates = (1.0, 4.0, 12.0) if args.quick else (1.0, 2.0, 4.0, 8.0, 16.0)
    links = (
        ("nvlink4", "infiniband-ndr-400", "roce-200", "ethernet-25g")
        if args.quick
        else (
            "nvlink4",
            "pcie-gen5-x16",
            "infiniband-ndr-400",
            "pcie-gen4-x16",
            "roce-200",
            "ethernet-100g",
            "ethernet-25g",
        )
    )
    default = RouterConfig()
    workloads = families(duration, mooncake_window)
    # One objective across lengths: the long-context one, which a 16k prompt can meet.
    long_ttft = with_interactive_ttft(5.0)
    sweep_length = [
        Family(f"prompt {n}", one_class(n, 200, 4.0, duration, 10 + n), long_ttft) for n in lengths
    ]
    sweep_rate = [
        Family(f"rate {r:g}/s", one_class(4096, 200, r, duration, 20), default) for r in rates
    ]
    link_family = Family("prompt 8192", one_class(8192, 200, 4.0, duration, 30), default)
    tasks: list[Task] = [
        (f.name, f, shape, LINK) for f in workloads + sweep_length + sweep_rate for shape in SHAPES
    ]
    tasks += [(link_family.name, link_family, SHAPES[1], link) for link in links]
    tasks.append((link_family.name, link_family, SHAPES[0], LINK))
    with get_context("fork").Pool(args.workers) as pool:
        found = table(tasks, pool.map)

    def section(title: str, names: list[str]) -> None:
        print(f"\n== {title} ==\n{HEADER}")
        for name in names:
            for shape in SHAPES:
                print(row(name, shape[0], found[(name, shape[0], LINK)]))

    for family in workloads:
        print(
            f"{family.name}: {len(family.requests)} requests over "
            f"{family.requests[-1].arrival_s:.0f} s"
        )
    section("workload families, link " + LINK, [f.name for f in workloads])
    section(
        "sweep: prompt length (200 output tokens, 4 requests/s, interactive TTFT 5 s)",
        [f.name for f in sweep_length],
    )
    section(
        "sweep: fleet size (4,096-token prompts, arrival rate scaled)", [f.name for f in sweep_rate]
    )
    print(f"\n== sweep: link, {link_family.name} at 4 requests/s, H100 prefill + H100 decode ==")
    print(HEADER)
    print(row(link_family.name, SHAPES[0][0], found[(link_family.name, SHAPES[0][0], LINK)]))
    for link in links:
        print(row(link_family.name, link, found[(link_family.name, SHAPES[1][0], link)]))
    print("\ncheapest disaggregated / colocated $/h (below 1: disaggregation pays):")
    for family in workloads + sweep_length + sweep_rate:
        base = found[(family.name, SHAPES[0][0], LINK)].fleet
        parts = []
        for shape in SHAPES[1:]:
            split = found[(family.name, shape[0], LINK)].fleet
            if base is None or split is None:
                parts.append(f"{shape[0]} n/a")
            else:
                parts.append(f"{shape[0]} {split.hourly_cost / base.hourly_cost:.2f}")
        print(f"  {family.name:<14} " + ", ".join(parts))
    runs = sum(f.runs for f in found.values())
    print(f"\n({runs} simulations, wall {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
