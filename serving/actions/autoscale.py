"""The autoscaler loop's glue: signals from Redis, bounds from the pool, the write through the
registry's `do_scale_deployment`.

It scales fleets of interchangeable replicas: a colocated deployment's, or each phase of a
disaggregated one on its own (prefill replicas on `pool`, counted by `replicas_*`; decode
replicas on `decode_pool`, counted by `decode_replicas_*`), each on its own signals, within its
own bounds and its own pool's free GPUs:
- colocated: load (running + waiting) against the decode batch a replica carries within the
  tier's TPOT objective while prefilling within its TTFT one, KV cache use, and the p95 of
  TTFT against each request's own tier's objective;
- decode: load against the decode batch within TPOT alone, on the decode pool's GPU class, and
  KV cache use (the decode replicas hold every stream's KV). Not TTFT: they never prefill;
- prefill: load, mostly its waiting queue, against the typical prompts whose prefills, one after
  another, fit the TTFT objective, and the deployment's TTFT p95 against the objectives (TTFT
  is the prefill side's clock). Not KV use: what a prefill replica holds is waiting for the
  decode side to pull it.

Per fleet with room to scale (an active deployment's phase whose max exceeds its min), every beat:
1. one sample of its ready replicas, appended to a short Redis list, so the window survives
   worker restarts and any worker can run the next beat. The sample holds
   - running and waiting requests (summed) and KV cache use (averaged), from
     `routing:telemetry`;
   - (colocated and prefill) the p95 of each request's time to first token over its own
     tier's TTFT objective, among the requests the gateways settled since the last reading,
     from the per-deployment histogram the gateway's settle already writes
     (`registry.rollout_metrics`' `ttft_slo:*`, counters in its one settle round trip). One
     deployment serves every tier, and a standard or batch prompt queued for seconds is on
     time: read against one objective it would scale the fleet for nothing. The loop keeps
     a snapshot of that histogram (a mark) and reads the difference; until at least
     `MIN_TTFT_REQUESTS` requests have settled since the mark there is no p95 and the mark
     stays, so a quiet deployment's one long prompt is not read as a missed SLO;
2. a forecast: the most replicas the traffic needed within `FORECAST_SPREAD_S` of this time of
   day plus a cold start (`COLD_START_S`), one period (`AUTOSCALER_FORECAST_PERIOD_S`, a day)
   ago, from a history of the loop's own reactive recommendations kept in Redis one point per
   minute (`serving.capacity.autoscaler.daily_forecast`), so capacity is warm before a known peak;
3. `serving.capacity.autoscaler.recommend` over the sample window, with the forecast as a floor, the
   phase's bounds, its pool's free GPUs, and the raw recommendations of the scale-down
   stabilization window (also in Redis);
4. when the count changes, `registry.actions.do_scale_deployment` for that phase, which requests
   a reconcile.

Redis keys are per fleet: the colocated and prefill phases use `autoscale:*:{deployment_id}`
(the keys from before phases were scaled, so nothing stored is orphaned; a deployment made
disaggregated continues its colocated memory as its prefill memory), the decode phase the same
keys with `:decode` appended. The TTFT mark is the deployment's, read by one phase only.

The history keeps what the signals asked for without the forecast: a forecast fed back into
its own history would hold a past peak up forever.

Level-triggered and idempotent: a second run in the same beat adds one more sample (with no
TTFT: nothing settled since the first) and recommends the same count.

Two phases sharing one pool each count all its free GPUs: in the beat both grow, the reconcile
places what fits and reports the rest unplaceable.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import orjson
import redis
from django.conf import settings

from config.loops import LoopPass
from registry.actions import do_scale_deployment
from registry.models import Deployment
from registry.rollout_metrics import TTFT_OVER_OBJECTIVE, quantile_from_buckets, stats_key
from serving.capacity.autoscaler import (
    AutoscalerConfig,
    FleetSample,
    ReplicaBounds,
    daily_forecast,
    recommend,
)
from serving.capacity.planner import Workload, slo_throughput
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs
from serving.models import Gpu, Replica
from serving.redis_contracts import text as redis_text
from serving.router import DEFAULT_SLO_TIERS, SloTier
from serving.telemetry import read_routing_telemetry

logger = logging.getLogger(__name__)

SAMPLES_KEY = "autoscale:samples:{deployment_id}"
RAW_KEY = "autoscale:raw:{deployment_id}"
# The TTFT-over-objective histogram's counters when the loop last read a p95:
# {"at_s": ..., "counts": {...}}. Not "autoscale:ttft-mark", whose counts were of TTFT itself.
TTFT_MARK_KEY = "autoscale:ttft-slo-mark:{deployment_id}"
# Hash: field = the minute's index within two periods (`history_slot`), value = [minute start,
# highest reactive raw recommendation of that minute]. At most 2 x period / 60 fields,
# whatever runs how often.
HISTORY_KEY = "autoscale:history:{deployment_id}"
KEEP_SAMPLES = 64
# A stored sample is read back by these fields only: one written by an earlier release, with
# a field since renamed (its TTFT p95 in seconds, now a share of the objective), loses it
# rather than stop the loop.
SAMPLE_FIELDS = tuple(field.name for field in fields(FleetSample))
KEEP_RAW = 256
KEY_TTL_S = 3600
# The 95th percentile of fewer requests than this is their maximum (one long prompt).
MIN_TTFT_REQUESTS = 20
HISTORY_STEP_S = 60
# History older than a period by more than this is not "the same time yesterday".
HISTORY_MARGIN_S = 3600
# Decision to ready replica: placement, image and weights load, CUDA graph capture. No setting
# measures it; a few minutes covers an 8B to 70B model loaded from a node's local disk.
COLD_START_S = 300.0
# How far from the same time of day an earlier peak still counts (daily traffic drifts).
FORECAST_SPREAD_S = 900.0
# The request shape the per-replica concurrency target is sized for.
TYPICAL_PROMPT_TOKENS = 1000
TYPICAL_OUTPUT_TOKENS = 250
FALLBACK_TARGET_RUNNING = 32.0
COLOCATED: str = Replica.Phase.COLOCATED.value
PREFILL: str = Replica.Phase.PREFILL.value
DECODE: str = Replica.Phase.DECODE.value


@dataclass(frozen=True, slots=True)
class ScalingOutcome:
    deployment_id: int
    current: int
    desired: int
    reason: str
    phase: str = COLOCATED


@dataclass(frozen=True, slots=True)
class PhaseCounts:
    """A fleet the loop scales: a colocated deployment's replicas, or one phase's of a
    disaggregated one (prefill: `pool`, `replicas_*`; decode: `decode_pool`,
    `decode_replicas_*`)."""

    phase: str
    pool_id: int
    gpu_class: str
    minimum: int
    desired: int
    maximum: int

    @property
    def scalable(self) -> bool:
        return self.maximum > self.minimum


def deployment_phases(deployment: Deployment) -> list[str]:
    return [PREFILL, DECODE] if deployment.disaggregated else [COLOCATED]


def phase_counts(deployment: Deployment, phase: str) -> PhaseCounts:
    if phase == DECODE:
        assert deployment.decode_pool is not None
        return PhaseCounts(
            phase,
            deployment.decode_pool.pk,
            deployment.decode_pool.gpu_class.name,
            deployment.decode_replicas_min,
            deployment.decode_replicas_desired,
            deployment.decode_replicas_max,
        )
    return PhaseCounts(
        phase,
        deployment.pool_id,
        deployment.pool.gpu_class.name,
        deployment.replicas_min,
        deployment.replicas_desired,
        deployment.replicas_max,
    )


def phase_key(template: str, deployment_id: int, phase: str) -> str:
    """A fleet's Redis key: the colocated and prefill phases keep the keys of before phases
    were scaled, the decode phase's get a suffix (see the module docstring)."""
    key = template.format(deployment_id=deployment_id)
    return f"{key}:decode" if phase == DECODE else key


def autoscaled_deployments() -> list[Deployment]:
    """Active deployments, colocated or disaggregated (each phase is scaled on its own)."""
    return list(
        Deployment.objects.filter(status=Deployment.Status.ACTIVE)
        .select_related("pool__gpu_class", "decode_pool__gpu_class", "model_version__model")
        .order_by("pk")
    )


def target_running(deployment: Deployment, phase: str = COLOCATED) -> float:
    """Running plus waiting requests one replica of the phase carries within its tier's
    objectives (engine model, on the GPU class of the phase's pool): colocated, the decode
    batch within TPOT whose step plus a prefill fits TTFT; decode, the batch within TPOT alone
    (its replicas never prefill); prefill, see `prefill_target`."""
    tier = DEFAULT_SLO_TIERS.get(deployment.slo_tier)
    perf = _perf_model(deployment, phase_counts(deployment, phase).gpu_class)
    if perf is None:
        return FALLBACK_TARGET_RUNNING
    max_num_seqs = int(deployment.effective_engine_args()["max_num_seqs"])  # type: ignore[call-overload]
    if phase == PREFILL:
        return prefill_target(perf, tier, max_num_seqs)
    workload = Workload(
        1,
        1.0,
        TYPICAL_PROMPT_TOKENS,
        TYPICAL_OUTPUT_TOKENS,
        ttft_slo_s=tier.ttft_s if tier and phase == COLOCATED else None,
        tpot_slo_s=tier.tpot_s if tier else None,
    )
    result = slo_throughput(perf, workload, max_num_seqs)
    return float(result.batch) if not isinstance(result, str) else FALLBACK_TARGET_RUNNING


def prefill_target(perf: PerfModel, tier: SloTier | None, max_num_seqs: int) -> float:
    """Typical prompts a prefill replica holds (running and waiting) whose prefills, one after
    another, all fit the TTFT objective: prefill is compute-bound, so batching prompts saves
    little beyond a step's overhead. The KV hand-over and the first decode step are left out;
    the TTFT signal sees what they add. A tier without a TTFT objective fills the batch."""
    if tier is None or tier.ttft_s is None:
        return float(max_num_seqs)
    prompts = int(tier.ttft_s // perf.ttft_s(TYPICAL_PROMPT_TOKENS))
    return float(max(1, min(max_num_seqs, prompts)))


def _perf_model(deployment: Deployment, gpu_class: str) -> PerfModel | None:
    gpu = load_gpu_specs().get(gpu_class)
    if gpu is None:
        return None
    try:
        return PerfModel(
            gpu,
            deployment.model_version.model.spec(),
            deployment.model_version.quantization,
            deployment.tensor_parallel,
        )
    except ValueError:
        return None


def phase_config(deployment: Deployment, phase: str) -> AutoscalerConfig:
    """The signals each fleet scales on (module docstring)."""
    target = target_running(deployment, phase)
    if phase == DECODE:
        return AutoscalerConfig(target_running_per_replica=target, ttft_signal=False)
    if phase == PREFILL:
        return AutoscalerConfig(target_running_per_replica=target, kv_target=None)
    return AutoscalerConfig(target_running_per_replica=target)


def pool_capacity(deployment: Deployment, phase: str = COLOCATED) -> int:
    """Replicas the phase could have: its desired count plus what its pool's free GPUs hold
    (GPUs on schedulable nodes not held by any replica)."""
    counts = phase_counts(deployment, phase)
    gpus = Gpu.objects.filter(
        node__pool_id=counts.pool_id, node__health="ready", node__scheduling="active"
    ).count()
    held = sum(
        len(indices)
        for indices in Replica.objects.filter(
            node__pool_id=counts.pool_id, state__in=Replica.HOLDING_STATES
        ).values_list("gpu_indices", flat=True)
    )
    mine = Replica.objects.filter(
        deployment=deployment, phase=phase, state__in=Replica.DESIRED_STATES
    ).count()
    free = max(0, gpus - held)
    return max(mine, counts.desired) + free // max(1, deployment.tensor_parallel)


def sample(
    deployment: Deployment,
    telemetry: dict[str, dict[str, Any]],
    now_s: float,
    ttft_p95_of_objective: float | None = None,
    phase: str = COLOCATED,
) -> FleetSample:
    ready = Replica.objects.filter(deployment=deployment, phase=phase, state=Replica.State.READY)
    rows = [telemetry[str(pk)] for pk in ready.values_list("pk", flat=True) if str(pk) in telemetry]
    return FleetSample(
        at_s=now_s,
        replicas=len(rows),
        running=sum(int(row.get("running") or 0) for row in rows),
        waiting=sum(int(row.get("waiting") or 0) for row in rows),
        kv_usage=sum(float(row.get("kv") or 0.0) for row in rows) / len(rows) if rows else 0.0,
        ttft_p95_of_objective=ttft_p95_of_objective,
    )


def observed_ttft_p95_of_objective(
    client: redis.Redis, deployment_id: int, now_s: float, window_s: float
) -> float | None:
    """The p95 of TTFT over each request's own tier's objective, among the deployment's
    requests settled since the last reading, from the gateway's histogram
    (`registry.rollout_metrics`' `ttft_slo:*`; buckets of 9%, interpolated). None until
    `MIN_TTFT_REQUESTS` with an objective have settled since the mark; a mark older than
    `window_s` (the loop stopped, or traffic is thin) starts over."""
    mark_key = TTFT_MARK_KEY.format(deployment_id=deployment_id)
    pipe = client.pipeline(transaction=False)
    pipe.get(mark_key)
    pipe.hgetall(stats_key(deployment_id))
    stored, counters = pipe.execute()
    counts = {
        name: int(value)
        for name, value in ((redis_text(n), v) for n, v in counters.items())
        if name.startswith(f"{TTFT_OVER_OBJECTIVE}:")
    }
    p95 = None
    mark = orjson.loads(stored) if stored else None
    if mark is not None and now_s - mark["at_s"] <= window_s:
        since: dict[str, int] = mark["counts"]
        # A counter below its mark: the hash expired and restarted, so it counts from zero.
        window = {
            int(name.removeprefix(f"{TTFT_OVER_OBJECTIVE}:")): n - since.get(name, 0)
            if n >= since.get(name, 0)
            else n
            for name, n in counts.items()
        }
        if sum(window.values()) < MIN_TTFT_REQUESTS:
            return None  # the mark stays: the next beat reads a longer window
        p95 = quantile_from_buckets(window, 0.95)
    client.set(mark_key, orjson.dumps({"at_s": now_s, "counts": counts}), ex=KEY_TTL_S)
    return p95


def history_slot(at_s: float, period_s: float) -> str:
    """A minute's field: minutes of two periods, so that writing today's minutes never
    overwrites yesterday's around the same time of day before the forecast has read them."""
    return str(int(at_s % (2 * period_s) // HISTORY_STEP_S))


def history_fields(now_s: float, period_s: float) -> list[str]:
    """The history's fields a beat reads: this minute's, then those one period ago near this
    time of day plus a cold start (one extra step each way: a period of no whole minutes
    shifts by one)."""
    target = now_s + COLD_START_S - period_s
    steps = int(FORECAST_SPREAD_S // HISTORY_STEP_S) + 1
    near = (history_slot(target + k * HISTORY_STEP_S, period_s) for k in range(-steps, steps + 1))
    return list(dict.fromkeys([history_slot(now_s, period_s), *near]))


def forecast_from(history: dict[str, list[float]], now_s: float, period_s: float) -> int | None:
    """Replicas needed around this time of day plus a cold start, one period ago."""
    return daily_forecast(
        [
            (at, int(raw))
            for at, raw in history.values()
            if at >= now_s - period_s - HISTORY_MARGIN_S
        ],
        now_s=now_s,
        period_s=period_s,
        lead_s=COLD_START_S,
        spread_s=FORECAST_SPREAD_S,
    )


def _read_memory(
    client: redis.Redis, deployment_id: int, phase: str, now_s: float, period_s: float | None
) -> tuple[list[tuple[float, int]], dict[str, list[float]]]:
    """The stabilization window's raw recommendations, and the history's points near now
    (field -> [minute start, raw]). One round trip."""
    fields = history_fields(now_s, period_s) if period_s else []
    pipe = client.pipeline(transaction=False)
    pipe.lrange(phase_key(RAW_KEY, deployment_id, phase), 0, -1)
    if fields:
        pipe.hmget(phase_key(HISTORY_KEY, deployment_id, phase), fields)
    stored_raw, *stored_history = pipe.execute()
    recent = [(at, raw) for at, raw in (orjson.loads(row) for row in stored_raw)]
    points = stored_history[0] if stored_history else []
    history = {
        field: orjson.loads(point)
        for field, point in zip(fields, points, strict=True)
        if point is not None
    }
    return recent, history


def _write_memory(
    client: redis.Redis,
    deployment_id: int,
    phase: str,
    now_s: float,
    raw: int,
    reactive_raw: int,
    history: dict[str, list[float]],
    period_s: float | None,
) -> None:
    """Append the raw recommendation to the stabilization window, and keep the minute's
    highest reactive one in the history. One round trip."""
    raw_key = phase_key(RAW_KEY, deployment_id, phase)
    pipe = client.pipeline(transaction=False)
    pipe.rpush(raw_key, orjson.dumps([now_s, raw]))
    pipe.ltrim(raw_key, -KEEP_RAW, -1)
    pipe.expire(raw_key, KEY_TTL_S)
    if period_s:
        history_key = phase_key(HISTORY_KEY, deployment_id, phase)
        field = history_slot(now_s, period_s)
        minute = now_s - now_s % HISTORY_STEP_S
        known = history.get(field)
        if known is None or known[0] != minute or known[1] < reactive_raw:
            pipe.hset(history_key, field, orjson.dumps([minute, reactive_raw]))
        pipe.expire(history_key, int(2 * period_s + HISTORY_MARGIN_S))
    pipe.execute()


def _remember(client: redis.Redis, key: str, value: Any, keep: int) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    pipe.rpush(key, orjson.dumps(value))
    pipe.ltrim(key, -keep, -1)
    pipe.expire(key, KEY_TTL_S)
    pipe.lrange(key, 0, -1)
    return [orjson.loads(raw) for raw in pipe.execute()[-1]]


def do_autoscale_deployment(
    deployment: Deployment,
    client: redis.Redis,
    telemetry: dict[str, dict[str, Any]],
    now_s: float,
    config: AutoscalerConfig | None = None,
    forecast_period_s: float | None = None,
    phase: str = COLOCATED,
) -> ScalingOutcome:
    """One beat for one fleet: the deployment's `phase` (colocated, or prefill or decode of a
    disaggregated one). `forecast_period_s`: the traffic pattern's period; None or 0: no
    forecast."""
    config = config or phase_config(deployment, phase)
    counts = phase_counts(deployment, phase)
    current = counts.desired
    # The TTFT mark is the deployment's: only the phase that TTFT measures reads it.
    ttft_p95 = (
        observed_ttft_p95_of_objective(client, deployment.pk, now_s, config.window_s)
        if phase != DECODE
        else None
    )
    point = sample(deployment, telemetry, now_s, ttft_p95, phase)
    samples = [
        FleetSample(**{name: row[name] for name in SAMPLE_FIELDS if name in row})
        for row in _remember(
            client, phase_key(SAMPLES_KEY, deployment.pk, phase), asdict(point), KEEP_SAMPLES
        )
    ]
    if point.replicas == 0:
        # Nothing ready reports yet (a cold start, or telemetry lost): no evidence to act on.
        return ScalingOutcome(deployment.pk, current, current, "no telemetry", phase)
    recent, history = _read_memory(client, deployment.pk, phase, now_s, forecast_period_s)
    bounds = ReplicaBounds(counts.minimum, counts.maximum, pool_capacity(deployment, phase))
    forecast = forecast_from(history, now_s, forecast_period_s) if forecast_period_s else None
    starting = Replica.objects.filter(
        deployment=deployment,
        phase=phase,
        state__in=(Replica.State.PENDING, Replica.State.STARTING),
    ).count()
    decision = recommend(
        samples,
        now_s=now_s,
        current=current,
        bounds=bounds,
        config=config,
        recent_raw=recent,
        forecast=forecast,
        starting=starting,
    )
    _write_memory(
        client,
        deployment.pk,
        phase,
        now_s,
        decision.raw,
        decision.reactive,
        history,
        forecast_period_s,
    )
    if decision.desired != current:
        do_scale_deployment(deployment, decision.desired, phase=phase)
        logger.info(
            "autoscaler: deployment %s %s %d -> %d (%s)",
            deployment.name,
            phase,
            current,
            phase_counts(deployment, phase).desired,
            decision.reason,
        )
    return ScalingOutcome(
        deployment.pk, current, phase_counts(deployment, phase).desired, decision.reason, phase
    )


def do_autoscale(client: redis.Redis, now_s: float | None = None) -> list[ScalingOutcome]:
    """One beat for every fleet with room to scale (module docstring)."""
    now_s = time.time() if now_s is None else now_s
    telemetry = read_routing_telemetry(client)
    period_s = float(settings.AUTOSCALER_FORECAST_PERIOD_S)
    this_pass = LoopPass("autoscale", "deployment")
    outcomes: list[ScalingOutcome] = []
    for deployment in autoscaled_deployments():
        with this_pass.item(deployment.pk):
            # Both phases of a disaggregated one, or neither: a failure rolls back its writes.
            phases = [
                do_autoscale_deployment(
                    deployment, client, telemetry, now_s, forecast_period_s=period_s, phase=phase
                )
                for phase in deployment_phases(deployment)
                if phase_counts(deployment, phase).scalable
            ]
            outcomes.extend(phases)
    this_pass.record(client)
    return outcomes
