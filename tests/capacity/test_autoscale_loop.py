"""The autoscaler's Celery loop: telemetry from Redis in, Deployment.replicas_desired out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
import redis

from registry.models import Deployment
from serving.autoscale_actions import do_autoscale, target_running
from serving.gpu_classes import sync_gpu_classes
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from serving.telemetry import ROUTING_TELEMETRY_KEY

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet() -> Callable[..., tuple[Deployment, list[Replica]]]:
    from registry.models import Model, ModelVersion
    from serving.engine.specs import load_model_specs

    def make(ready: int = 2, gpus: int = 8, desired: int = 2) -> tuple[Deployment, list[Replica]]:
        sync_gpu_classes(GpuClass)
        pool = GpuPool.objects.create(
            name="h100-eu", gpu_class=GpuClass.objects.get(name="H100-SXM-80GB"), region="eu"
        )
        node = Node.objects.create(pool=pool, hostname="gpu-1", agent_url="http://gpu-1:9000")
        for index in range(gpus):
            Gpu.objects.create(
                node=node, index=index, uuid=f"GPU-{index}", name="H100", memory_mb=81559
            )
        spec = load_model_specs()["llama-3.1-8b"]
        model = Model.objects.create(
            name="llama-3.1-8b", family="llama", params_b=spec.params_b, layers=spec.layers,
            hidden=spec.hidden, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
            max_context=spec.max_context,
        )  # fmt: skip
        version = ModelVersion.objects.create(
            model=model, version="v1", artifact_uri="hf://org/llama", status="approved"
        )
        deployment = Deployment.objects.create(
            name="llama", model_version=version, pool=pool, replicas_min=1, replicas_max=6,
            replicas_desired=desired, slo_tier="interactive",
        )  # fmt: skip
        replicas = [
            Replica.objects.create(
                deployment=deployment, node=node, gpu_indices=[i], state=Replica.State.READY
            )
            for i in range(ready)
        ]
        return deployment, replicas

    return make


def report(client: redis.Redis, replicas: list[Replica], **numbers: Any) -> None:
    row = {"running": 0, "waiting": 0, "kv": 0.0, "loras": [], "scraped_at": None, **numbers}
    client.hset(ROUTING_TELEMETRY_KEY, mapping={str(r.pk): orjson.dumps(row) for r in replicas})


def test_it_scales_a_busy_deployment_up(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    report(redis_client, replicas, running=int(target_running(deployment) * 2), kv=0.9)
    [outcome] = do_autoscale(redis_client, now_s=1000.0)
    deployment.refresh_from_db()
    assert deployment.replicas_desired == outcome.desired == 4


def test_it_stays_within_the_pools_free_gpus(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet(gpus=3)
    report(redis_client, replicas, running=500, waiting=200, kv=0.99)
    do_autoscale(redis_client, now_s=1000.0)
    deployment.refresh_from_db()
    assert deployment.replicas_desired == 3


def test_a_quiet_deployment_is_not_scaled_down_at_once(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet(ready=4, desired=4)
    report(redis_client, replicas, running=1, kv=0.01)
    do_autoscale(redis_client, now_s=1000.0)
    do_autoscale(redis_client, now_s=1010.0)
    deployment.refresh_from_db()
    assert deployment.replicas_desired == 4


def test_a_deployment_without_telemetry_is_left_alone(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, _ = fleet()
    [outcome] = do_autoscale(redis_client, now_s=1000.0)
    deployment.refresh_from_db()
    assert (deployment.replicas_desired, outcome.reason) == (2, "no telemetry")


def test_the_celery_task_runs_the_loop(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    from serving.autoscale_tasks import autoscale

    deployment, replicas = fleet()
    report(redis_client, replicas, running=int(target_running(deployment) * 2), kv=0.9)
    autoscale.apply()
    deployment.refresh_from_db()
    assert deployment.replicas_desired > 2
