"""Figures of a simulation: latency percentiles, SLO attainment, utilisation, cost; CSV and PNG.

The router's saving against least load is priced as metering prices it (`metering.cost`):
each served request's work (uncached prompt tokens at the prefill weight, output tokens at
the decode weight of the replica's mean batch and context over its ready time) in GPU time
at the pool's price, on the replica it ran on and on the one least load would have sent it
to (`RequestRecord.baseline_replica_id`), by `moved_work_usd_micros`. The same tokens, the
same cached prompt tokens (those the router expected the chosen replica to hold) and the
same batch and context (the chosen replica's) are priced on both: what moves is the
hardware and its price, not the work nor the batch sizes the router's choices made. On a
fixed fleet the bill is the same whichever the policy; this is the price of the hardware
choice, which turns into a smaller bill only when the fleet shrinks.

Disaggregated requests (prefilled on one replica, decoded on another) are left out of that
comparison, which is about colocated placement; their GPU time is counted per phase instead
(`prefill_gpu_hours`, `decode_gpu_hours`: the ready time of the prefill and decode pools),
and the KV transfer's time from hand-off to landing is reported (`transfer_p50_s`, p99).

A run over several models (a request's `model`, or the pools') is also summarised per model
(`Summary.models`): its requests, its interactive requests within both clocks, and the cost
of the pools serving it. A one-model run leaves `models` empty, so its output is unchanged.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from metering.cost import (
    Placement,
    ReplicaWindow,
    ServedRequest,
    mean_context,
    mean_decode_batch,
    moved_work_usd_micros,
    work_cost_usd_micros,
    work_weights,
)
from serving.clustersim.simulator import REFUSED, RequestRecord, SimReplica, SimResult
from serving.router import DEFAULT_SLO_TIERS, SloTier

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True, slots=True)
class TierFigures:
    tier: str
    requests: int
    failed: int
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    tpot_p99_s: float
    # Share of the tier's requests whose TTFT met its objective (failed ones count as misses).
    ttft_attainment: float
    # ... whose TTFT and TPOT both met their objectives.
    slo_attainment: float
    # The router's prediction error on the tier's requests: a tier gathered behind a deep
    # queue (batch) can own the run's p99 alone, which the run's figure would hide.
    prediction: PredictionError | None = None


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    fleet: str
    replicas_started: int
    requests: int
    failed: int
    duration_s: float
    cpu_s: float
    speedup: float
    prompt_tokens: int
    output_tokens: int
    gpu_hours: float
    cost_usd: float
    cost_per_hour: float
    cost_per_million_tokens: float
    cost_per_million_output_tokens: float
    # Busy: the share of replica time an engine had work (decode keeps it near 1 under
    # load). Compute and bandwidth: the roofline's FLOPs and bytes over replica time, as a
    # share of the efficiency-scaled peak, so what the hardware actually did.
    gpu_utilization: float
    compute_utilization: float
    bandwidth_utilization: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    tpot_p99_s: float
    queue_advised: int
    # Requests the gateways held in their admission queues, and those they refused from
    # them (queue full, or waited past its limit: a 429 or 503 to the client).
    held: int
    refused: int
    preemptions: int
    # Served requests' work priced where it ran and where least load would have sent it
    # (module docstring); the saving is the second less the first.
    work_cost_usd: float
    baseline_work_cost_usd: float
    saving_vs_least_load_usd: float
    tiers: dict[str, TierFigures]
    share_by_gpu: dict[str, float]
    # Disaggregated fleets: the share of served requests that went through a prefill
    # replica, GPU-hours of the prefill and decode pools, and hand-off to KV landed.
    disaggregated_share: float = 0.0
    prefill_gpu_hours: float = 0.0
    decode_gpu_hours: float = 0.0
    transfer_p50_s: float = float("nan")
    transfer_p99_s: float = float("nan")
    # The router's prediction error on the requests it predicted (module docstring).
    prediction: PredictionError | None = None
    # Per model, where the run has more than one (module docstring); empty otherwise.
    models: dict[str, ModelFigures] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's share of a multi-model run."""

    model: str
    requests: int
    failed: int
    interactive_requests: int
    # Share of its interactive requests within both TTFT and TPOT objectives (failed ones
    # miss); None when it had no interactive request.
    interactive_slo_attainment: float | None
    # The replica time of the pools serving it, at their prices.
    cost_usd: float
    cost_per_hour: float


@dataclass(frozen=True, slots=True)
class PredictionError:
    """Simulated minus predicted, over served requests the policy predicted for: p50 and
    p99 of the absolute error, the median signed error (negative: the router expected
    worse than happened), and the share of requests whose outcome was worse than predicted.
    TPOT is compared where the request decoded more than one token."""

    requests: int
    ttft_abs_p50_s: float
    ttft_abs_p99_s: float
    ttft_signed_p50_s: float
    ttft_under_share: float
    tpot_abs_p50_s: float
    tpot_abs_p99_s: float
    tpot_signed_p50_s: float
    tpot_under_share: float


def prediction_error(records: list[RequestRecord]) -> PredictionError | None:
    """How far the router's predicted TTFT and TPOT were from the simulated ones."""
    ttft = [
        actual - predicted
        for r in records
        if (predicted := r.predicted_ttft_s) is not None and (actual := r.sent_ttft_s) is not None
    ]
    tpot = [
        actual - predicted
        for r in records
        if (predicted := r.predicted_tpot_s) is not None and (actual := r.tpot_s) is not None
    ]
    if not ttft:
        return None
    ttft_abs, tpot_abs = _percentiles([abs(e) for e in ttft]), _percentiles([abs(e) for e in tpot])
    return PredictionError(
        requests=len(ttft),
        ttft_abs_p50_s=ttft_abs[0],
        ttft_abs_p99_s=ttft_abs[2],
        ttft_signed_p50_s=_percentiles(ttft)[0],
        ttft_under_share=sum(1 for e in ttft if e > 0) / len(ttft),
        tpot_abs_p50_s=tpot_abs[0],
        tpot_abs_p99_s=tpot_abs[2],
        tpot_signed_p50_s=_percentiles(tpot)[0] if tpot else float("nan"),
        tpot_under_share=sum(1 for e in tpot if e > 0) / len(tpot) if tpot else float("nan"),
    )


def _percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (float("nan"),) * 3
    p50, p95, p99 = np.percentile(np.asarray(values), PERCENTILES)
    return float(p50), float(p95), float(p99)


def _meets_ttft(record: RequestRecord, tier: SloTier) -> bool:
    ttft = record.ttft_s
    return ttft is not None and (tier.ttft_s is None or ttft <= tier.ttft_s)


def _meets_both(record: RequestRecord, tier: SloTier) -> bool:
    """Served in full with a first token, and within both clocks (`SloTier.missed`, the
    rule the gateway and the usage records judge by)."""
    served = record.finished_s is not None and record.ttft_s is not None
    return served and tier.missed(record.ttft_s, record.tpot_s) is None


def tier_figures(name: str, records: list[RequestRecord], tier: SloTier) -> TierFigures:
    ttfts = [t for r in records if (t := r.ttft_s) is not None]
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    met_ttft = sum(1 for r in records if _meets_ttft(r, tier))
    met_both = sum(1 for r in records if _meets_both(r, tier))
    count = len(records)
    return TierFigures(
        name,
        count,
        sum(1 for r in records if r.failed),
        *_percentiles(ttfts),
        *_percentiles(tpots),
        met_ttft / count if count else 1.0,
        met_both / count if count else 1.0,
        prediction_error([r for r in records if r.finished_s is not None]),
    )


@dataclass(frozen=True, slots=True)
class WorkCost:
    """One served request's work priced on the replica it ran on and on least load's pick."""

    request_id: str
    replica_id: str
    baseline_replica_id: str
    usd_micros: int
    baseline_usd_micros: int


def served_request(record: RequestRecord) -> ServedRequest:
    """A finished record as metering sees a request: tokens, expected cache hit, decode time."""
    assert record.finished_s is not None and record.first_token_s is not None
    return ServedRequest(
        request_id=record.request.request_id,
        prompt_tokens=record.request.prompt_tokens,
        cached_prompt_tokens=record.request.prompt_tokens - record.prefill_tokens,
        completion_tokens=record.output_tokens,
        decode_ms=(record.finished_s - record.first_token_s) * 1000,
    )


def replica_window(replica: SimReplica, ended_s: float) -> ReplicaWindow:
    """The replica's ready time over the run, from ready (cold start done) to stopped."""
    stopped = replica.stopped_s if replica.stopped_s is not None else ended_s
    return ReplicaWindow(
        replica_id=replica.replica_id,
        ready_us=max(0, round((stopped - replica.ready_s) * 1e6)),
        gpus=replica.gpus,
        usd_micros_per_gpu_hour=round(replica.pool.price_per_gpu_hour * 1e6),
    )


def work_costs(result: SimResult) -> list[WorkCost]:
    """Each served request's work cost where it ran and where least load would have sent it,
    both at the batch and context of the replica it ran on (module docstring)."""
    perfs = {pool.name: result.fleet.perf(pool) for pool in result.fleet.pools}
    placements = {
        replica.replica_id: Placement(
            perfs[replica.pool.name], replica.gpus, round(replica.pool.price_per_gpu_hour * 1e6)
        )
        for replica in result.replicas
    }
    served: dict[str, list[tuple[RequestRecord, ServedRequest]]] = {}
    for record in result.records:
        if (
            record.finished_s is not None
            and record.replica_id is not None
            and record.prefill_replica_id is None
        ):
            served.setdefault(record.replica_id, []).append((record, served_request(record)))
    replicas = {replica.replica_id: replica for replica in result.replicas}
    costs = []
    for rid, members in served.items():
        requests = [request for _, request in members]
        window = replica_window(replicas[rid], result.ended_s)
        batch, context = mean_decode_batch(window, requests), mean_context(requests)
        here = placements[rid]
        weights = work_weights(here.perf, batch, context)
        for record, request in members:
            baseline_id = record.baseline_replica_id
            assert baseline_id is not None, "a routed request always has a baseline"
            usd_micros = work_cost_usd_micros(
                weights, here.gpus, here.usd_micros_per_gpu_hour, request
            )
            moved = moved_work_usd_micros(request, here, placements[baseline_id], batch, context)
            costs.append(
                WorkCost(request.request_id, rid, baseline_id, usd_micros, usd_micros + moved)
            )
    return costs


def alive_s(replica: SimReplica, result: SimResult) -> float:
    """Seconds the replica was paid for: from its start to its stop, or the run's end."""
    return (replica.stopped_s or result.ended_s) - replica.started_s


def summarize(result: SimResult, slo_tiers: dict[str, SloTier] | None = None) -> Summary:
    tiers = slo_tiers or result.config.router.slo_tiers or DEFAULT_SLO_TIERS
    records = result.records
    by_tier: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_tier.setdefault(record.request.tier, []).append(record)
    served = [r for r in records if r.finished_s is not None]
    prompt = sum(r.request.prompt_tokens for r in served)
    output = sum(r.output_tokens for r in served)
    replica_s = sum(alive_s(r, result) for r in result.replicas)
    gpu_s = sum(r.gpus * alive_s(r, result) for r in result.replicas)
    cost = sum(r.pool.price_per_replica_hour * alive_s(r, result) / 3600 for r in result.replicas)
    busy = sum(r.busy_s for r in result.replicas)
    by_gpu: dict[str, int] = {}
    for record in served:
        by_gpu[record.gpu_class or "?"] = by_gpu.get(record.gpu_class or "?", 0) + 1
    duration = result.ended_s
    priced = work_costs(result)
    work_micros = sum(cost.usd_micros for cost in priced)
    baseline_micros = sum(cost.baseline_usd_micros for cost in priced)
    return Summary(
        policy=result.config.policy,
        fleet=result.fleet.describe(),
        replicas_started=len(result.replicas),
        requests=len(records),
        failed=sum(1 for r in records if r.failed),
        duration_s=duration,
        cpu_s=result.cpu_s,
        speedup=duration / result.cpu_s if result.cpu_s else float("inf"),
        prompt_tokens=prompt,
        output_tokens=output,
        gpu_hours=gpu_s / 3600,
        cost_usd=cost,
        cost_per_hour=cost / (duration / 3600) if duration else 0.0,
        cost_per_million_tokens=cost / ((prompt + output) / 1e6) if prompt + output else 0.0,
        cost_per_million_output_tokens=cost / (output / 1e6) if output else 0.0,
        gpu_utilization=busy / replica_s if replica_s else 0.0,
        compute_utilization=(
            sum(r.engine.compute_s_total for r in result.replicas) / replica_s if replica_s else 0.0
        ),
        bandwidth_utilization=(
            sum(r.engine.memory_s_total for r in result.replicas) / replica_s if replica_s else 0.0
        ),
        ttft_p50_s=(ttft := _percentiles([t for r in records if (t := r.ttft_s) is not None]))[0],
        ttft_p95_s=ttft[1],
        ttft_p99_s=ttft[2],
        tpot_p50_s=(tpot := _percentiles([t for r in records if (t := r.tpot_s) is not None]))[0],
        tpot_p95_s=tpot[1],
        tpot_p99_s=tpot[2],
        queue_advised=result.queue_advised,
        held=sum(1 for r in records if r.queued_s is not None),
        refused=sum(1 for r in records if r.failed in REFUSED),
        preemptions=sum(r.preemptions for r in records),
        work_cost_usd=work_micros / 1e6,
        baseline_work_cost_usd=baseline_micros / 1e6,
        saving_vs_least_load_usd=(baseline_micros - work_micros) / 1e6,
        tiers={
            name: tier_figures(name, members, tiers.get(name) or SloTier(name, None, None))
            for name, members in sorted(by_tier.items())
        },
        share_by_gpu={gpu: n / len(served) for gpu, n in sorted(by_gpu.items())} if served else {},
        prediction=prediction_error(served),
        models=model_figures(
            result, tiers.get("interactive") or SloTier("interactive", None, None)
        ),
        **_phase_figures(result, served),
    )


def model_figures(result: SimResult, interactive: SloTier) -> dict[str, ModelFigures]:
    """Per model, when the fleet or the requests name more than one; {} otherwise."""
    fleet = result.fleet
    by_model: dict[str, list[RequestRecord]] = {model: [] for model in fleet.models}
    for record in result.records:
        by_model.setdefault(record.request.model or fleet.model, []).append(record)
    if len(by_model) < 2:
        return {}
    cost = dict.fromkeys(by_model, 0.0)
    for replica in result.replicas:
        hours = alive_s(replica, result) / 3600
        cost[fleet.pool_model(replica.pool)] += replica.pool.price_per_replica_hour * hours
    duration_h = result.ended_s / 3600
    figures = {}
    for model, records in by_model.items():
        asked = [r for r in records if r.request.tier == "interactive"]
        figures[model] = ModelFigures(
            model=model,
            requests=len(records),
            failed=sum(1 for r in records if r.failed),
            interactive_requests=len(asked),
            interactive_slo_attainment=(
                tier_figures("interactive", asked, interactive).slo_attainment if asked else None
            ),
            cost_usd=cost[model],
            cost_per_hour=cost[model] / duration_h if duration_h else 0.0,
        )
    return figures


def _phase_figures(result: SimResult, served: list[RequestRecord]) -> dict[str, float]:
    """Summary's disaggregated fields (their defaults for a colocated fleet)."""
    if not result.fleet.disaggregated:
        return {}
    split = [r for r in served if r.prefill_replica_id is not None]
    hours = {"prefill": 0.0, "decode": 0.0}
    for replica in result.replicas:
        if replica.pool.role in hours:
            hours[replica.pool.role] += replica.gpus * alive_s(replica, result) / 3600
    transfers = [
        r.kv_ready_s - r.handoff_s
        for r in split
        if r.kv_ready_s is not None and r.handoff_s is not None
    ]
    p50, _, p99 = _percentiles(transfers)
    return {
        "disaggregated_share": len(split) / len(served) if served else 0.0,
        "prefill_gpu_hours": hours["prefill"],
        "decode_gpu_hours": hours["decode"],
        "transfer_p50_s": p50,
        "transfer_p99_s": p99,
    }


def summary_rows(summary: Summary) -> list[dict[str, object]]:
    """One row for the whole run, one per tier and, in a multi-model run, one per model,
    for a CSV."""
    nested = ("tiers", "share_by_gpu", "prediction", "models")
    head = {k: v for k, v in asdict(summary).items() if k not in nested}
    rows: list[dict[str, object]] = [
        {"scope": "all", **head, **_prediction_columns(summary.prediction)}
    ]
    for figures in summary.tiers.values():
        row = {k: v for k, v in asdict(figures).items() if k != "prediction"}
        rows.append(
            {"scope": f"tier:{figures.tier}", **row, **_prediction_columns(figures.prediction)}
        )
    for model in summary.models.values():
        rows.append({"scope": f"model:{model.model}", **asdict(model)})
    return rows


def _prediction_columns(error: PredictionError | None) -> dict[str, object]:
    """A prediction error as a CSV row's `prediction_*` columns (none without one)."""
    if error is None:
        return {}
    return {f"prediction_{k}": v for k, v in asdict(error).items()}


def write_csv(result: SimResult, summary: Summary, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    requests_path = out_dir / "requests.csv"
    with requests_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "request_id",
                "tenant",
                "tier",
                "arrival_s",
                "prompt_tokens",
                "output_tokens",
                "replica",
                "baseline_replica",
                "gpu_class",
                "ttft_s",
                "tpot_s",
                "finished_s",
                "preemptions",
                "failed",
            ]
        )
        for r in result.records:
            writer.writerow(
                [
                    r.request.request_id,
                    r.request.tenant,
                    r.request.tier,
                    f"{r.request.arrival_s:.4f}",
                    r.request.prompt_tokens,
                    r.output_tokens,
                    r.replica_id or "",
                    r.baseline_replica_id or "",
                    r.gpu_class or "",
                    _fmt(r.ttft_s),
                    _fmt(r.tpot_s),
                    _fmt(r.finished_s),
                    r.preemptions,
                    r.failed or "",
                ]
            )
    summary_path = out_dir / "summary.csv"
    rows = summary_rows(summary)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with summary_path.open("w", newline="") as f:
        summary_writer = csv.DictWriter(f, fieldnames=fields)
        summary_writer.writeheader()
        summary_writer.writerows(rows)
    timeline_path = out_dir / "timeline.csv"
    pools = [p.name for p in result.fleet.pools]
    with timeline_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["at_s", "running", "waiting", "kv_usage", *(f"ready_{p}" for p in pools)])
        for point in result.timeline:
            writer.writerow(
                [
                    f"{point.at_s:.1f}",
                    point.running,
                    point.waiting,
                    f"{point.kv_usage:.4f}",
                    *(point.ready.get(p, 0) for p in pools),
                ]
            )
    return [requests_path, summary_path, timeline_path]


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.5f}"


def plot(result: SimResult, summary: Summary, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; the simulator never opens a window
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for tier in summary.tiers:
        ttfts = np.sort(
            [t for r in result.records if r.request.tier == tier and (t := r.ttft_s) is not None]
        )
        if len(ttfts):
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=tier)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT by tier: {summary.policy} on {summary.fleet}")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(out_dir / "ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    times = [p.at_s for p in result.timeline]
    for pool in result.fleet.pools:
        top.step(times, [p.ready.get(pool.name, 0) for p in result.timeline], label=pool.name)
    top.set_ylabel("ready replicas")
    top.legend()
    bottom.plot(times, [p.running for p in result.timeline], label="running")
    bottom.plot(times, [p.waiting for p in result.timeline], label="waiting")
    bottom.set_ylabel("requests")
    bottom.set_xlabel("simulated time (s)")
    bottom.legend()
    paths.append(out_dir / "timeline.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def format_summary(summary: Summary) -> str:
    lines = [
        f"{summary.policy} on {summary.fleet}: {summary.requests} requests "
        f"({summary.failed} failed) over {summary.duration_s:.0f} s simulated "
        f"in {summary.cpu_s:.1f} CPU s ({summary.speedup:.0f}x real time)",
        f"  TTFT p50/p95/p99 {summary.ttft_p50_s:.3f}/{summary.ttft_p95_s:.3f}/"
        f"{summary.ttft_p99_s:.3f} s   TPOT p50/p95/p99 {summary.tpot_p50_s * 1000:.1f}/"
        f"{summary.tpot_p95_s * 1000:.1f}/{summary.tpot_p99_s * 1000:.1f} ms",
        f"  GPU-hours {summary.gpu_hours:.2f}  busy {summary.gpu_utilization:.0%}  "
        f"compute {summary.compute_utilization:.0%}  bandwidth "
        f"{summary.bandwidth_utilization:.0%}  "
        f"cost ${summary.cost_usd:.2f} (${summary.cost_per_hour:.2f}/h, "
        f"${summary.cost_per_million_tokens:.3f} per M tokens)",
        f"  gateways held {summary.held} requests in their admission queues, refused "
        f"{summary.refused}; the router advised waiting {summary.queue_advised} times",
        f"  work ${summary.work_cost_usd:.4f} where it ran, "
        f"${summary.baseline_work_cost_usd:.4f} where least load would have sent it: "
        f"saving vs least load ${summary.saving_vs_least_load_usd:.4f}",
    ]
    if summary.prefill_gpu_hours or summary.decode_gpu_hours:
        lines.append(
            f"  disaggregated {summary.disaggregated_share:.0%} of requests; GPU-hours prefill "
            f"{summary.prefill_gpu_hours:.2f}, decode {summary.decode_gpu_hours:.2f}; KV "
            f"transfer p50/p99 {summary.transfer_p50_s * 1000:.1f}/"
            f"{summary.transfer_p99_s * 1000:.1f} ms"
        )
    error = summary.prediction
    if error is not None:
        lines.append(
            f"  router's prediction error (simulated - predicted, {error.requests} requests): "
            f"TTFT |err| p50/p99 {error.ttft_abs_p50_s * 1000:.0f}/"
            f"{error.ttft_abs_p99_s * 1000:.0f} ms, worse than predicted "
            f"{error.ttft_under_share:.0%}; TPOT |err| p50/p99 "
            f"{error.tpot_abs_p50_s * 1000:.1f}/{error.tpot_abs_p99_s * 1000:.1f} ms, worse "
            f"than predicted {error.tpot_under_share:.0%}"
        )
    for t in summary.tiers.values():
        predicted = t.prediction
        lines.append(
            f"  {t.tier:<12} n={t.requests:<6} TTFT p99 {t.ttft_p99_s:.3f} s  "
            f"TTFT SLO {t.ttft_attainment:.2%}  TTFT+TPOT SLO {t.slo_attainment:.2%}"
            + (
                f"  TTFT |err| p50/p99 {predicted.ttft_abs_p50_s * 1000:.0f}/"
                f"{predicted.ttft_abs_p99_s * 1000:.0f} ms"
                if predicted is not None
                else ""
            )
        )
    for m in summary.models.values():
        both = m.interactive_slo_attainment
        lines.append(
            f"  {m.model:<14} n={m.requests:<6} failed {m.failed:<4} interactive TTFT+TPOT SLO "
            + (f"{both:.2%}" if both is not None else "-")
            + f"  cost ${m.cost_usd:.2f} (${m.cost_per_hour:.2f}/h)"
        )
    return "\n".join(lines)
