"""Telemetry freshness and gateway count: every policy in serving.router.POLICIES (peers
included once registered) on a fixed fleet, with telemetry scraped every 0.05, 0.5 or 2 s
and the arrivals dealt round robin to 1, 4 or 16 gateways (SimConfig.gateways): a peer's
gateways each know only their own requests in flight and their own prefix index, as they
ship; ours tell each other of both through Redis, the counts arriving 5 ms late
(SimConfig.inflight_sync_delay_s; `--sync-delays` adds rows at other delays). Then what
scraping costs at scale, gateways scraping engines directly against node agents publishing
to Redis.

    .venv/bin/python bench/freshness.py [--quick] [--workers N] [--replicas 8]
        [--azure-rate 104] [--prefix-rate 70] [--window 120]

Workloads, on --replicas H100-SXM-80GB replicas of llama-3.1-8b (8 by default: least load
at 2 s, one gateway, is near the SLO on both):
  azure   the shipped Azure 2023 conversation trace, rescaled to --azure-rate requests/s on
          average, its first --window seconds;
  prefix  Poisson arrivals at --prefix-rate requests/s; each tenant has 4 system prompts of
          3072 tokens (one drawn per request, the first twice as often as the next) followed
          by 128 to 1024 tokens of its own, 64 to 384 output tokens: prefix affinity pays,
          and a gateway's prefix index holds only what it routed itself.
Per run: interactive both-clock attainment (share of interactive requests whose TTFT and
TPOT both met the tier: TierFigures.slo_attainment), fleet TTFT p99 and TPOT p99, and each
against the same policy at 0.05 s with one gateway (attainment in points, latencies in %).
--quick runs 25 s of each workload (under 3 minutes on one CPU for eight policies).
One artefact to read past: a round-robin policy starts its rotation at the first replica on
every gateway and every routing-table version, so N gateways dealt consecutive arrivals send
them to the same replica, more a model of synchronised restarts than of steady state.

The scrape table: N gateways x R replicas / interval scrapes per second if every gateway
scraped every engine's /metrics itself, the bytes that moves (the size of serving.enginesim's
/metrics, measured here; real vLLM's is larger: more histograms, process metrics) and the
CPU to parse it (prometheus_client's parser, measured here), against the current design: one
node agent per node scrapes its engines (R / interval scrapes in all, local), writes one
compact JSON row per replica into the `routing:telemetry` hash, and each gateway reads the
hash (HGETALL: N / interval reads of R rows, measured row size, orjson parse measured).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson
from prometheus_client.parser import text_string_to_metric_families

from serving.clustersim import SimConfig, SimRequest, homogeneous, poisson, simulate, summarize
from serving.clustersim.report import Summary
from serving.clustersim.workloads import (
    AZURE_CONV_CSV,
    DEFAULT_TENANTS,
    LengthClass,
    LengthMix,
    load_trace,
    salted_blocks,
)
from serving.engine.core import Engine, EngineRequest
from serving.enginesim.metrics import EngineMetrics
from serving.router import OWN_POLICIES, POLICIES
from serving.telemetry import compact

H100 = "H100-SXM-80GB"
INTERVALS_S = (0.05, 0.5, 2.0)
GATEWAYS = (1, 4, 16)
BASELINE = (0.05, 1)
SCALE_REPLICAS = (100, 1_000, 10_000)
SCALE_GATEWAYS = (4, 16)
DEFAULT_SYNC_DELAY_S = SimConfig().inflight_sync_delay_s
SYSTEM_PROMPT_BLOCKS = 6  # of 512 tokens: 3072
SYSTEM_PROMPTS_PER_TENANT = 4

# Set before the worker pool forks, so the requests are never pickled.
WORKLOADS: dict[str, list[SimRequest]] = {}
REPLICAS = 8


@dataclass(frozen=True, slots=True)
class Cell:
    workload: str
    policy: str
    interval_s: float
    gateways: int
    sync_delay_s: float = DEFAULT_SYNC_DELAY_S
    attainment: float | None = None
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    cpu_s: float = 0.0
    error: str | None = None


def run_cell(task: tuple[str, str, float, int, float]) -> Cell:
    workload, policy, interval_s, gateways, sync_delay_s = task
    config = SimConfig(
        policy=policy,
        gateways=gateways,
        telemetry_interval_s=interval_s,
        inflight_sync_delay_s=sync_delay_s,
    )
    started = time.process_time()
    try:
        summary: Summary = summarize(
            simulate(homogeneous(H100, REPLICAS), WORKLOADS[workload], config)
        )
    except Exception as error:  # a peer policy that cannot run here is reported, not fatal
        return Cell(*task, error=f"{type(error).__name__}: {error}")
    tier = summary.tiers.get("interactive")
    return Cell(
        *task,
        attainment=tier.slo_attainment if tier is not None else None,
        ttft_p99_s=summary.ttft_p99_s,
        tpot_p99_s=summary.tpot_p99_s,
        cpu_s=time.process_time() - started,
    )


def shared_prefix(rate_per_s: float, duration_s: float, seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals, each prompt a tenant's system prompt then a suffix of its own."""
    rng = random.Random(seed)
    lengths = LengthMix((LengthClass(1.0, 128, 64), LengthClass(1.0, 1024, 384)))
    base = poisson(rate_per_s, duration_s, lengths=lengths, tenants=DEFAULT_TENANTS, seed=seed)
    weights = [2.0] + [1.0] * (SYSTEM_PROMPTS_PER_TENANT - 1)
    system_tokens = SYSTEM_PROMPT_BLOCKS * 512
    out = []
    for index, request in enumerate(base):
        prompt = rng.choices(range(SYSTEM_PROMPTS_PER_TENANT), weights)[0]
        system = [prompt * 1000 + b for b in range(SYSTEM_PROMPT_BLOCKS)]
        # Ids past every system prompt's: the suffix is this request's alone.
        own = [10**9 + index * 4 + b for b in range(4)]
        tokens = system_tokens + request.prompt_tokens
        hashes = salted_blocks(request.tenant, system + own, tokens)
        out.append(replace(request, prompt_tokens=tokens, block_hashes=hashes))
    return out


def relative(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "-"
    return f"{(value - base) / base:+.0%}"


def policy_label(policy: str) -> str:
    own = getattr(POLICIES[policy], "refresh_interval_s", None)
    return policy + (f" (own {own:g} s)" if own else "")


def print_table(cells: list[Cell]) -> None:
    by_key = {
        (c.workload, c.policy, c.interval_s, c.gateways): c
        for c in cells
        if c.sync_delay_s == DEFAULT_SYNC_DELAY_S
    }
    width = max(len(policy_label(c.policy)) for c in cells)
    print(
        f"{'workload':<8} {'policy':<{width}} {'stale':>5} {'gw':>3} {'sync':>5} "
        f"{'int T+T':>8} {'Δ pt':>6} "
        f"{'TTFT p99':>9} {'Δ':>6} {'TPOT p99':>9} {'Δ':>6} {'cpu s':>6}"
    )
    for cell in cells:
        base = by_key.get((cell.workload, cell.policy, *BASELINE))
        label = policy_label(cell.policy)
        lead = f"{cell.workload:<8} {label:<{width}} {cell.interval_s:>5g} {cell.gateways:>3}"
        shared = cell.gateways > 1 and cell.policy in OWN_POLICIES
        lead += f" {f'{cell.sync_delay_s * 1000:g}ms' if shared else '-':>5}"
        if cell.error is not None:
            print(f"{lead} error: {cell.error}")
            continue
        attained = f"{cell.attainment:.2%}" if cell.attainment is not None else "-"
        delta = "-"
        if base is not None and cell.attainment is not None and base.attainment is not None:
            delta = f"{100 * (cell.attainment - base.attainment):+.1f}"
        ttft = cell.ttft_p99_s or 0.0
        tpot = cell.tpot_p99_s or 0.0
        print(
            f"{lead} {attained:>8} {delta:>6} {ttft:>8.3f}s "
            f"{relative(cell.ttft_p99_s, base.ttft_p99_s if base else None):>6} "
            f"{tpot * 1000:>7.1f}ms "
            f"{relative(cell.tpot_p99_s, base.tpot_p99_s if base else None):>6} "
            f"{cell.cpu_s:>6.1f}"
        )


# --- what scraping costs ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScrapeCosts:
    metrics_bytes: int  # one engine's /metrics
    metrics_parse_s: float  # one parse of it
    row_bytes: int  # one replica's row in routing:telemetry
    row_parse_s: float  # one orjson parse of a row


def measure_scrape_costs() -> ScrapeCosts:
    """An engine simulator's /metrics after some traffic, and a routing:telemetry row."""
    fleet = homogeneous(H100, 1)
    engine = Engine(fleet.perf(fleet.pools[0]), max_model_len=8192)
    for index in range(40):
        engine.add_request(EngineRequest(f"r{index}", 800, 120, index * 0.05))
    engine.advance(5.0)
    metrics = EngineMetrics("llama-3.1-8b", max_loras=2)
    metrics.sync_engine(engine)
    for ttft in (0.05, 0.2, 0.9):
        metrics.observe_first_token(ttft)
        metrics.observe_token_gap(ttft / 10)
        metrics.observe_queue(ttft / 2)
        metrics.observe_finish("stop", ttft * 20)
    text = metrics.exposition().decode()
    parses = 50
    started = time.perf_counter()
    for _ in range(parses):
        for family in text_string_to_metric_families(text):
            for _sample in family.samples:
                pass
    parse_s = (time.perf_counter() - started) / parses
    row = orjson.dumps(
        compact(
            {
                "num_requests_running": 37,
                "num_requests_waiting": 4,
                "kv_cache_usage_perc": 0.6180339887,
                "loaded_lora_adapters": ["acme-support-v3"],
                "scraped_at": "2026-12-03T08:00:00.123456+00:00",
            }
        )
    )
    replica_id = b"replica-00000000-0000-0000-0000-000000000000"
    rows = 20_000
    started = time.perf_counter()
    for _ in range(rows):
        orjson.loads(row)
    row_parse_s = (time.perf_counter() - started) / rows
    return ScrapeCosts(len(text.encode()), parse_s, len(row) + len(replica_id), row_parse_s)


def megabytes(value: float) -> str:
    return f"{value / 1e6:,.1f}" if value < 1e9 else f"{value / 1e9:,.1f}G"


def print_scrape_table(costs: ScrapeCosts) -> None:
    print(
        f"\none engine's /metrics (serving.enginesim): {costs.metrics_bytes / 1000:.1f} kB, "
        f"parsed in {costs.metrics_parse_s * 1000:.2f} ms (prometheus_client); one "
        f"routing:telemetry row {costs.row_bytes} B with its field name, parsed in "
        f"{costs.row_parse_s * 1e6:.1f} µs (orjson)"
    )
    print(
        "direct: every gateway scrapes every engine; agents: a node agent scrapes its "
        "engines once and writes Redis, each gateway reads the hash once per interval"
    )
    header = f"{'replicas':>8} {'every':>5}"
    for n in SCALE_GATEWAYS:
        header += f" | {'direct N=' + str(n) + ' req/s':>18} {'MB/s':>8} {'parse cores':>11}"
    header += f" | {'agents scr/s':>12}"
    for n in SCALE_GATEWAYS:
        header += f" {'Redis N=' + str(n) + ' MB/s':>15} {'cores/gw':>8}"
    print(header)
    for replicas in SCALE_REPLICAS:
        for interval in INTERVALS_S:
            line = f"{replicas:>8,} {interval:>4g}s"
            for n in SCALE_GATEWAYS:
                per_s = n * replicas / interval
                line += (
                    f" | {per_s:>18,.0f} {megabytes(per_s * costs.metrics_bytes):>8} "
                    f"{per_s * costs.metrics_parse_s:>11,.1f}"
                )
            line += f" | {replicas / interval:>12,.0f}"
            for n in SCALE_GATEWAYS:
                read_bytes = n / interval * replicas * costs.row_bytes
                gateway_cores = replicas / interval * costs.row_parse_s
                line += f" {megabytes(read_bytes):>15} {gateway_cores:>8.2f}"
            print(line)
    print(
        "parse cores: CPU cores the gateways spend, all together, only parsing /metrics; "
        "cores/gw: one gateway's cores decoding the hash's rows; Redis N=: what the one "
        "hash sends to all N gateways (G: GB/s)"
    )
    replica_id = "replica-00000000-0000-0000-0000-000000000000"
    events = [
        ["s", replica_id, 2048, 3072, 0.05],
        ["f", replica_id, 2048],
        ["x", replica_id, 2048, 3072, 0.05, True],
    ]
    event_bytes = sum(len(orjson.dumps(event)) + 1 for event in events)
    print(
        f"in-flight sync (serving/gateway/inflight_sync.py): a request's start, first token "
        f"and finish take {event_bytes} B of events; per 1,000 requests/s through the "
        "gateways, Redis takes in and sends out to N subscribing gateways (batched: a "
        "publish carries what queued while the last one was out):"
    )
    for n in (1, *SCALE_GATEWAYS):
        print(
            f"  N={n:<2} {megabytes(1000 * event_bytes)} MB/s in, "
            f"{megabytes(1000 * event_bytes * n)} MB/s out"
        )


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="25 s of each workload")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--azure-rate", type=float, default=104.0)
    parser.add_argument("--prefix-rate", type=float, default=70.0)
    parser.add_argument("--window", type=float, default=120.0, help="seconds of each workload")
    parser.add_argument("--scrape-table-only", action="store_true")
    parser.add_argument(
        "--sync-delays",
        default="",
        help="comma-separated seconds: more rows for our policies with 16 gateways at 2 s "
        "telemetry, the in-flight counts reaching the other gateways this late",
    )
    args = parser.parse_args()
    if args.workers < 1 or args.replicas < 1 or args.window <= 0:
        parser.error("--workers, --replicas and --window take positive values")
    if args.quick:
        args.window = 25.0
    return args


def main() -> int:
    global REPLICAS
    args = parse_arguments()
    print("command: " + " ".join([".venv/bin/python", "bench/freshness.py", *sys.argv[1:]]))
    started = time.perf_counter()
    if not args.scrape_table_only:
        REPLICAS = args.replicas
        WORKLOADS["azure"] = load_trace(
            AZURE_CONV_CSV, "azure", rate_per_s=args.azure_rate, window_s=args.window
        )
        WORKLOADS["prefix"] = shared_prefix(args.prefix_rate, args.window)
        policies = list(POLICIES)
        print(
            f"fleet {REPLICAS}x {H100}; azure: {len(WORKLOADS['azure'])} requests "
            f"({args.azure_rate:g}/s, {args.window:g} s); prefix: {len(WORKLOADS['prefix'])} "
            f"requests ({args.prefix_rate:g}/s); policies: {', '.join(policies)}"
        )
        tasks = [
            (workload, policy, interval, gateways, DEFAULT_SYNC_DELAY_S)
            for workload in WORKLOADS
            for policy in policies
            for interval in INTERVALS_S
            for gateways in GATEWAYS
        ]
        delays = [float(d) for d in args.sync_delays.split(",") if d.strip()]
        tasks += [
            (workload, policy, 2.0, GATEWAYS[-1], delay)
            for workload in WORKLOADS
            for policy in policies
            if policy in OWN_POLICIES
            for delay in delays
            if delay != DEFAULT_SYNC_DELAY_S
        ]
        # Forked after WORKLOADS is set: workers inherit it.
        with get_context("fork").Pool(args.workers) as pool:
            cells = pool.map(run_cell, tasks, chunksize=1)
        print_table(cells)
    print_scrape_table(measure_scrape_costs())
    print(f"\n(wall {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
