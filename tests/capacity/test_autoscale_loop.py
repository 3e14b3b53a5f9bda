"""The autoscaler's Celery loop: telemetry from Redis in, Deployment.replicas_desired out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
import redis

from registry.models import Deployment
from registry.rollout_metrics import add_request
from serving.actions.autoscale import (
    COLD_START_S,
    MIN_TTFT_REQUESTS,
    do_autoscale,
    history_slot,
    observed_ttft_p95,
    target_running,
)
from serving.actions.gpu_classes import sync_gpu_classes
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from serving.redis_contracts import ROUTING_TELEMETRY_KEY

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
            name="llama-3.1-8b",
            family="llama",
            params_b=spec.params_b,
            layers=spec.layers,
            hidden=spec.hidden,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            max_context=spec.max_context,
        )
        version = ModelVersion.objects.create(
            model=model, version="v1", artifact_uri="hf://org/llama", status="approved"
        )
        deployment = Deployment.objects.create(
            name="llama",
            model_version=version,
            pool=pool,
            replicas_min=1,
            replicas_max=6,
            replicas_desired=desired,
            slo_tier="interactive",
        )
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


def test_a_disaggregated_deployment_keeps_the_counts_staff_set(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    Deployment.objects.filter(pk=deployment.pk).update(
        decode_pool=deployment.pool, kv_connector="nixl"
    )
    report(redis_client, replicas, running=int(target_running(deployment) * 2), kv=0.9)
    assert do_autoscale(redis_client, now_s=1000.0) == []
    deployment.refresh_from_db()
    assert deployment.replicas_desired == 2


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
    from serving.tasks import autoscale

    deployment, replicas = fleet()
    report(redis_client, replicas, running=int(target_running(deployment) * 2), kv=0.9)
    autoscale.apply()
    deployment.refresh_from_db()
    assert deployment.replicas_desired > 2


def settle(client: redis.Redis, deployment: Deployment, count: int, ttft_s: float) -> None:
    """What the gateway's settle pipeline records per request (registry.rollout_metrics)."""
    pipe = client.pipeline(transaction=False)
    for _ in range(count):
        add_request(
            pipe, deployment.pk, ok=True, ttft_s=ttft_s, output_tokens=50, finish_reason="stop"
        )
    pipe.execute()


def test_a_missed_ttft_objective_scales_up_when_queue_and_kv_look_fine(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    report(redis_client, replicas, running=2, kv=0.1)
    [before] = do_autoscale(redis_client, now_s=1000.0)
    settle(redis_client, deployment, 40, ttft_s=3.0)  # the interactive tier's objective: 1 s
    [after] = do_autoscale(redis_client, now_s=1010.0)
    deployment.refresh_from_db()
    assert (before.desired, before.reason) == (2, "hold")
    assert (deployment.replicas_desired, after.reason) == (4, "up on ttft")


def test_a_handful_of_slow_requests_is_not_a_missed_objective(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    report(redis_client, replicas, running=2, kv=0.1)
    do_autoscale(redis_client, now_s=1000.0)
    settle(redis_client, deployment, MIN_TTFT_REQUESTS - 1, ttft_s=3.0)
    [outcome] = do_autoscale(redis_client, now_s=1010.0)
    assert (outcome.desired, outcome.reason) == (2, "hold")


def test_slow_requests_count_once_enough_have_settled_over_several_beats(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    report(redis_client, replicas, running=2, kv=0.1)
    do_autoscale(redis_client, now_s=1000.0)
    settle(redis_client, deployment, MIN_TTFT_REQUESTS // 2, ttft_s=3.0)
    do_autoscale(redis_client, now_s=1010.0)
    settle(redis_client, deployment, MIN_TTFT_REQUESTS // 2, ttft_s=3.0)
    [outcome] = do_autoscale(redis_client, now_s=1020.0)
    assert (outcome.desired, outcome.reason) == (4, "up on ttft")


def test_the_p95_reads_the_gateways_ttft_histogram_within_a_bucket(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, _ = fleet()
    observed_ttft_p95(redis_client, deployment.pk, now_s=1000.0, window_s=45.0)
    settle(redis_client, deployment, 90, ttft_s=0.2)
    settle(redis_client, deployment, 10, ttft_s=2.0)
    p95 = observed_ttft_p95(redis_client, deployment.pk, now_s=1010.0, window_s=45.0)
    assert p95 is not None and 1.8 < p95 <= 2.0 * 1.1


def seed_history(
    client: redis.Redis, deployment: Deployment, at_s: float, raw: int, period_s: float = 86400
) -> None:
    """One point of the loop's history: field = the minute's slot, value = [minute, raw]."""
    minute = at_s - at_s % 60
    field = history_slot(minute, period_s)
    client.hset(f"autoscale:history:{deployment.pk}", field, orjson.dumps([minute, raw]))


DAY = 86400.0


def test_the_forecast_warms_replicas_ahead_of_yesterdays_peak(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    now = 10 * DAY + 9 * 3600  # 09:00; yesterday's peak began at 09:05
    for minute in range(5, 65):
        seed_history(redis_client, deployment, now - DAY + minute * 60, raw=6)
    report(redis_client, replicas, running=2, kv=0.1)
    [outcome] = do_autoscale(redis_client, now_s=now)
    deployment.refresh_from_db()
    assert (deployment.replicas_desired, outcome.reason) == (4, "up on forecast")


def test_todays_quiet_minutes_do_not_erase_yesterdays_peak_at_that_time(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    now = 10 * DAY + 9 * 3600
    # Yesterday was busy from 08:50 to 09:00; today those minutes were quiet and the loop
    # wrote its own points for them before 09:00.
    for minute in range(-10, 1):
        seed_history(redis_client, deployment, now - DAY + minute * 60, raw=6)
    report(redis_client, replicas, running=2, kv=0.1)
    for minute in range(-10, 0):
        do_autoscale(redis_client, now_s=now + minute * 60)
    history = redis_client.hgetall(f"autoscale:history:{deployment.pk}")
    yesterday = [
        orjson.loads(history[history_slot(now - DAY + m * 60, DAY).encode()]) for m in range(-10, 1)
    ]
    assert [raw for _, raw in yesterday] == [6] * 11
    Deployment.objects.filter(pk=deployment.pk).update(replicas_desired=2)
    [outcome] = do_autoscale(redis_client, now_s=now)
    assert (outcome.desired, outcome.reason) == (4, "up on forecast")


def test_a_peak_at_another_time_of_day_is_not_forecast(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    now = 10 * DAY + 9 * 3600
    seed_history(redis_client, deployment, now - DAY + 3 * 3600, raw=6)  # 12:00 yesterday
    report(redis_client, replicas, running=2, kv=0.1)
    [outcome] = do_autoscale(redis_client, now_s=now)
    assert (outcome.desired, outcome.reason) == (2, "hold")


def test_a_peak_the_loop_saw_yesterday_is_warmed_for_today(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    peak = 10 * DAY + 9 * 3600
    report(redis_client, replicas, running=int(target_running(deployment) * 2), kv=0.9)
    do_autoscale(redis_client, now_s=peak)
    Deployment.objects.filter(pk=deployment.pk).update(replicas_desired=2)
    report(redis_client, replicas, running=2, kv=0.1)
    [outcome] = do_autoscale(redis_client, now_s=peak + DAY - COLD_START_S)
    assert (outcome.desired, outcome.reason) == (4, "up on forecast")


def test_the_history_keeps_one_point_a_minute(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    report(redis_client, replicas, running=2, kv=0.1)
    for second in range(0, 120, 10):
        do_autoscale(redis_client, now_s=DAY + second)
    history = redis_client.hgetall(f"autoscale:history:{deployment.pk}")
    assert {orjson.loads(point)[0] for point in history.values()} == {DAY, DAY + 60}


def test_no_forecast_when_the_setting_turns_it_off(
    fleet: Callable[..., Any], redis_client: redis.Redis, settings: Any
) -> None:
    settings.AUTOSCALER_FORECAST_PERIOD_S = 0
    deployment, replicas = fleet()
    now = 10 * DAY + 9 * 3600
    seed_history(redis_client, deployment, now - DAY + 5 * 60, raw=6)
    report(redis_client, replicas, running=2, kv=0.1)
    [outcome] = do_autoscale(redis_client, now_s=now)
    assert (outcome.desired, outcome.reason) == (2, "hold")


def test_the_history_keeps_what_the_traffic_needed_not_the_forecast(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    deployment, replicas = fleet()
    now = 10 * DAY + 9 * 3600
    seed_history(redis_client, deployment, now - DAY + 5 * 60, raw=6)
    report(redis_client, replicas, running=2, kv=0.1)
    [outcome] = do_autoscale(redis_client, now_s=now)
    field = str(int(now % DAY // 60))
    stored = orjson.loads(redis_client.hget(f"autoscale:history:{deployment.pk}", field) or b"")
    assert outcome.reason == "up on forecast"
    assert stored == [now, 1]  # a forecast fed back would hold yesterday's peak up for ever
