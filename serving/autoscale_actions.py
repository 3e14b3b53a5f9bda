"""The autoscaler loop's glue: signals from Redis, bounds from the pool, the write through the
registry's `do_scale_deployment`.

Per deployment with room to scale (active, replicas_max > replicas_min), every beat:
1. one sample of its ready replicas from `routing:telemetry` (running, waiting summed, KV use
   averaged), appended to a short Redis list, so the window survives worker restarts and any
   worker can run the next beat;
2. `serving.autoscaler.recommend` over the window, with the deployment's bounds, the pool's
   free GPUs, and the raw recommendations of the scale-down stabilization window (also in
   Redis);
3. when the count changes, `registry.actions.do_scale_deployment`, then a reconcile.

Level-triggered and idempotent: a second run in the same beat adds one more sample and
recommends the same count.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import redis

from registry.models import Deployment
from serving.autoscaler import AutoscalerConfig, FleetSample, ReplicaBounds, recommend
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs
from serving.models import Gpu, Replica
from serving.planner import Workload, slo_throughput
from serving.router import DEFAULT_SLO_TIERS
from serving.telemetry import read_routing_telemetry

logger = logging.getLogger(__name__)

SAMPLES_KEY = "autoscale:samples:{deployment_id}"
RAW_KEY = "autoscale:raw:{deployment_id}"
KEEP_SAMPLES = 64
KEEP_RAW = 256
KEY_TTL_S = 3600
# The request shape the per-replica concurrency target is sized for.
TYPICAL_PROMPT_TOKENS = 1000
TYPICAL_OUTPUT_TOKENS = 250
FALLBACK_TARGET_RUNNING = 32.0


@dataclass(frozen=True, slots=True)
class ScalingOutcome:
    deployment_id: int
    current: int
    desired: int
    reason: str


def autoscaled_deployments() -> list[Deployment]:
    return list(
        Deployment.objects.filter(status=Deployment.Status.ACTIVE)
        .select_related("pool__gpu_class", "model_version__model")
        .order_by("pk")
    )


def target_running(deployment: Deployment) -> float:
    """Concurrency one replica carries within its tier's TPOT objective (engine model)."""
    tier = DEFAULT_SLO_TIERS.get(deployment.slo_tier)
    gpu = load_gpu_specs().get(deployment.pool.gpu_class.name)
    if gpu is None:
        return FALLBACK_TARGET_RUNNING
    try:
        perf = PerfModel(
            gpu,
            deployment.model_version.model.spec(),
            deployment.model_version.quantization,
            deployment.tensor_parallel,
        )
    except ValueError:
        return FALLBACK_TARGET_RUNNING
    workload = Workload(
        1,
        1.0,
        TYPICAL_PROMPT_TOKENS,
        TYPICAL_OUTPUT_TOKENS,
        ttft_slo_s=tier.ttft_s if tier else None,
        tpot_slo_s=tier.tpot_s if tier else None,
    )
    result = slo_throughput(perf, workload, int(deployment.effective_engine_args()["max_num_seqs"]))  # type: ignore[call-overload]
    return float(result.batch) if not isinstance(result, str) else FALLBACK_TARGET_RUNNING


def pool_capacity(deployment: Deployment) -> int:
    """Replicas the deployment could have: its desired count plus what the pool's free GPUs
    hold (GPUs on schedulable nodes not held by any replica)."""
    gpus = Gpu.objects.filter(
        node__pool=deployment.pool, node__health="ready", node__scheduling="active"
    ).count()
    held = sum(
        len(indices)
        for indices in Replica.objects.filter(
            node__pool=deployment.pool, state__in=Replica.HOLDING_STATES
        ).values_list("gpu_indices", flat=True)
    )
    mine = Replica.objects.filter(deployment=deployment, state__in=Replica.DESIRED_STATES).count()
    free = max(0, gpus - held)
    return max(mine, deployment.replicas_desired) + free // max(1, deployment.tensor_parallel)


def sample(
    deployment: Deployment, telemetry: dict[str, dict[str, Any]], now_s: float
) -> FleetSample:
    ready = Replica.objects.filter(deployment=deployment, state=Replica.State.READY)
    rows = [telemetry[str(pk)] for pk in ready.values_list("pk", flat=True) if str(pk) in telemetry]
    return FleetSample(
        at_s=now_s,
        replicas=len(rows),
        running=sum(int(row.get("running") or 0) for row in rows),
        waiting=sum(int(row.get("waiting") or 0) for row in rows),
        kv_usage=sum(float(row.get("kv") or 0.0) for row in rows) / len(rows) if rows else 0.0,
    )


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
) -> ScalingOutcome:
    from registry.actions import do_scale_deployment
    from serving.actions import request_reconcile

    tier = DEFAULT_SLO_TIERS.get(deployment.slo_tier)
    config = config or AutoscalerConfig(
        target_running_per_replica=target_running(deployment),
        ttft_slo_s=tier.ttft_s if tier else None,
    )
    current = deployment.replicas_desired
    point = sample(deployment, telemetry, now_s)
    samples = [
        FleetSample(**row)
        for row in _remember(
            client, SAMPLES_KEY.format(deployment_id=deployment.pk), asdict(point), KEEP_SAMPLES
        )
    ]
    if point.replicas == 0:
        # Nothing ready reports yet (a cold start, or telemetry lost): no evidence to act on.
        return ScalingOutcome(deployment.pk, current, current, "no telemetry")
    raw_key = RAW_KEY.format(deployment_id=deployment.pk)
    recent = [(at, raw) for at, raw in (orjson.loads(r) for r in client.lrange(raw_key, 0, -1))]
    decision = recommend(
        samples,
        now_s=now_s,
        current=current,
        bounds=ReplicaBounds(
            deployment.replicas_min, deployment.replicas_max, pool_capacity(deployment)
        ),
        config=config,
        recent_raw=recent,
    )
    _remember(client, raw_key, [now_s, decision.raw], KEEP_RAW)
    if decision.desired != current:
        do_scale_deployment(deployment, decision.desired)
        logger.info(
            "autoscaler: deployment %s %d -> %d (%s)",
            deployment.name,
            current,
            deployment.replicas_desired,
            decision.reason,
        )
        request_reconcile()
    return ScalingOutcome(deployment.pk, current, deployment.replicas_desired, decision.reason)


def do_autoscale(client: redis.Redis, now_s: float | None = None) -> list[ScalingOutcome]:
    now_s = time.time() if now_s is None else now_s
    telemetry = read_routing_telemetry(client)
    return [
        do_autoscale_deployment(deployment, client, telemetry, now_s)
        for deployment in autoscaled_deployments()
        if deployment.replicas_max > deployment.replicas_min
    ]
