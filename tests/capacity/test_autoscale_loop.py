"""The autoscaler's Celery loop: telemetry from Redis in, Deployment.replicas_desired out (and,
for a disaggregated deployment, each phase's count on its own signals)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
import redis
from django.core.exceptions import ValidationError

from config.jobs import Enqueue
from registry.actions import do_scale_deployment
from registry.models import Deployment
from registry.rollout_metrics import add_request
from serving.actions.autoscale import (
    COLD_START_S,
    DECODE,
    MIN_TTFT_REQUESTS,
    PREFILL,
    SAMPLES_KEY,
    TYPICAL_PROMPT_TOKENS,
    do_autoscale,
    history_slot,
    observed_ttft_p95_of_objective,
    target_running,
)
from serving.actions.gpu_classes import sync_gpu_classes
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from serving.redis_contracts import ROUTING_TELEMETRY_KEY

pytestmark = pytest.mark.django_db


def gpu_node(pool: GpuPool, hostname: str, gpus: int, memory_mb: int) -> Node:
    node = Node.objects.create(pool=pool, hostname=hostname, agent_url=f"http://{hostname}:9000")
    for index in range(gpus):
        Gpu.objects.create(
            node=node,
            index=index,
            uuid=f"{hostname}-GPU-{index}",
            name=pool.gpu_class.name,
            memory_mb=memory_mb,
        )
    return node


@pytest.fixture
def fleet() -> Callable[..., tuple[Deployment, list[Replica]]]:
    from registry.models import Model, ModelVersion
    from serving.engine.specs import load_model_specs

    def make(ready: int = 2, gpus: int = 8, desired: int = 2) -> tuple[Deployment, list[Replica]]:
        sync_gpu_classes(GpuClass)
        pool = GpuPool.objects.create(
            name="h100-eu", gpu_class=GpuClass.objects.get(name="H100-SXM-80GB"), region="eu"
        )
        node = gpu_node(pool, "gpu-1", gpus, memory_mb=81559)
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


def settle(
    client: redis.Redis,
    deployment: Deployment,
    count: int,
    ttft_s: float,
    objective_s: float | None = 1.0,
) -> None:
    """What the gateway's settle pipeline records per request (registry.rollout_metrics);
    `objective_s`: the request's tier's TTFT objective (interactive's by default)."""
    pipe = client.pipeline(transaction=False)
    for _ in range(count):
        add_request(
            pipe,
            deployment.pk,
            ok=True,
            ttft_s=ttft_s,
            output_tokens=50,
            finish_reason="stop",
            ttft_objective_s=objective_s,
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


def test_looser_tiers_waiting_within_their_own_objectives_scale_nothing(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    # A standard prompt queued 2.5 s (objective 3 s) and a batch one 20 s (none) are on time,
    # though either is past the interactive tier's 1 s.
    deployment, replicas = fleet()
    report(redis_client, replicas, running=2, kv=0.1)
    do_autoscale(redis_client, now_s=1000.0)
    settle(redis_client, deployment, 40, ttft_s=2.5, objective_s=3.0)
    settle(redis_client, deployment, 40, ttft_s=20.0, objective_s=None)
    settle(redis_client, deployment, 40, ttft_s=0.3)
    [outcome] = do_autoscale(redis_client, now_s=1010.0)
    assert (outcome.desired, outcome.reason) == (2, "hold")
    settle(redis_client, deployment, 40, ttft_s=4.0, objective_s=3.0)  # now standard is late
    [outcome] = do_autoscale(redis_client, now_s=1020.0)
    assert (outcome.desired, outcome.reason) == (3, "up on ttft")


def test_a_sample_stored_by_an_earlier_release_does_not_stop_the_loop(
    fleet: Callable[..., Any], redis_client: redis.Redis
) -> None:
    # Before the TTFT signal was per tier, samples held the p95 in seconds as `ttft_p95_s`.
    deployment, replicas = fleet()
    legacy = {
        "at_s": 995.0,
        "replicas": 2,
        "running": 4,
        "waiting": 0,
        "kv_usage": 0.1,
        "ttft_p95_s": 9.0,
    }
    redis_client.rpush(SAMPLES_KEY.format(deployment_id=deployment.pk), orjson.dumps(legacy))
    report(redis_client, replicas, running=2, kv=0.1)
    [outcome] = do_autoscale(redis_client, now_s=1000.0)
    assert (outcome.desired, outcome.reason) == (2, "hold")  # its 9 s read as nothing


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
    observed_ttft_p95_of_objective(redis_client, deployment.pk, now_s=1000.0, window_s=45.0)
    settle(redis_client, deployment, 90, ttft_s=0.2)
    settle(redis_client, deployment, 10, ttft_s=6.0, objective_s=3.0)  # twice its objective
    p95 = observed_ttft_p95_of_objective(redis_client, deployment.pk, now_s=1010.0, window_s=45.0)
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


# --- a disaggregated deployment: each phase on its own signals, bounds and pool ---------------

Disaggregated = tuple[Deployment, list[Replica], list[Replica]]


@pytest.fixture
def disaggregated(fleet: Callable[..., tuple[Deployment, list[Replica]]]) -> Callable[..., Any]:
    """The fleet's deployment made disaggregated: its replicas prefill on the H100 pool, its
    decode replicas (`decode_ready` of them, all ready) run on an H200 pool of `decode_gpus`."""

    def make(
        decode_ready: int = 2, decode_gpus: int = 8, decode_max: int = 6, **prefill: int
    ) -> Disaggregated:
        deployment, prefill_replicas = fleet(**prefill)
        pool = GpuPool.objects.create(
            name="h200-eu", gpu_class=GpuClass.objects.get(name="H200-SXM-141GB"), region="eu"
        )
        node = gpu_node(pool, "gpu-2", decode_gpus, memory_mb=143771)
        Deployment.objects.filter(pk=deployment.pk).update(
            decode_pool=pool,
            kv_connector="nixl",
            decode_replicas_min=1,
            decode_replicas_desired=decode_ready,
            decode_replicas_max=decode_max,
        )
        Replica.objects.filter(deployment=deployment).update(phase=PREFILL)
        decode_replicas = [
            Replica.objects.create(
                deployment=deployment,
                node=node,
                phase=DECODE,
                gpu_indices=[i],
                state=Replica.State.READY,
            )
            for i in range(decode_ready)
        ]
        deployment = Deployment.objects.select_related(
            "pool__gpu_class", "decode_pool__gpu_class", "model_version__model"
        ).get(pk=deployment.pk)
        return deployment, prefill_replicas, decode_replicas

    return make


def counts(deployment: Deployment) -> tuple[int, int]:
    deployment.refresh_from_db()
    return deployment.replicas_desired, deployment.decode_replicas_desired


def reasons(outcomes: list[Any]) -> dict[str, str]:
    return {outcome.phase: outcome.reason for outcome in outcomes}


def test_busy_decode_replicas_scale_the_decode_phase_and_leave_prefill_alone(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated()
    report(redis_client, prefill, running=2)
    report(redis_client, decode, running=int(target_running(deployment, DECODE) * 2), kv=0.5)
    outcomes = do_autoscale(redis_client, now_s=1000.0)
    assert counts(deployment) == (2, 4)
    assert reasons(outcomes) == {"prefill": "hold", "decode": "up on load"}


def test_kv_pressure_scales_the_decode_phase_but_not_the_prefill_phase(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated()
    report(redis_client, [*prefill, *decode], running=2, kv=0.95)
    outcomes = do_autoscale(redis_client, now_s=1000.0)
    assert counts(deployment) == (2, 3)
    assert reasons(outcomes) == {"prefill": "hold", "decode": "up on kv"}


def test_a_long_prefill_queue_scales_the_prefill_phase(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated()
    report(redis_client, prefill, running=1, waiting=int(target_running(deployment, PREFILL) * 2))
    report(redis_client, decode, running=2, kv=0.1)
    outcomes = do_autoscale(redis_client, now_s=1000.0)
    assert counts(deployment) == (4, 2)
    assert reasons(outcomes) == {"prefill": "up on load", "decode": "hold"}


def test_a_missed_ttft_objective_scales_the_prefill_phase_not_the_decode_phase(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated()
    report(redis_client, [*prefill, *decode], running=2, kv=0.1)
    do_autoscale(redis_client, now_s=1000.0)
    settle(redis_client, deployment, 40, ttft_s=3.0)  # the interactive tier's objective: 1 s
    outcomes = do_autoscale(redis_client, now_s=1010.0)
    assert counts(deployment) == (4, 2)
    assert reasons(outcomes) == {"prefill": "up on ttft", "decode": "hold"}


def test_each_phase_stops_at_its_own_maximum(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated(decode_max=3)
    report(redis_client, prefill, waiting=int(target_running(deployment, PREFILL) * 2))
    report(redis_client, decode, running=int(target_running(deployment, DECODE) * 2))
    do_autoscale(redis_client, now_s=1000.0)
    assert counts(deployment) == (4, 3)


def test_the_decode_phase_stays_within_its_own_pools_free_gpus(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated(decode_gpus=3)  # the prefill pool has 8
    report(redis_client, prefill, running=2)
    report(redis_client, decode, running=500, waiting=200, kv=0.99)
    do_autoscale(redis_client, now_s=1000.0)
    assert counts(deployment) == (2, 3)


def test_a_phase_whose_bounds_leave_no_room_is_not_scaled(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated()
    Deployment.objects.filter(pk=deployment.pk).update(decode_replicas_min=2, decode_replicas_max=2)
    report(redis_client, [*prefill, *decode], waiting=500, kv=0.99)
    outcomes = do_autoscale(redis_client, now_s=1000.0)
    assert [outcome.phase for outcome in outcomes] == ["prefill"]
    assert counts(deployment) == (4, 2)


def test_yesterdays_decode_peak_warms_the_decode_phase_only(
    disaggregated: Callable[..., Disaggregated], redis_client: redis.Redis
) -> None:
    deployment, prefill, decode = disaggregated()
    peak = 10 * DAY + 9 * 3600
    report(redis_client, prefill, running=2)
    report(redis_client, decode, running=int(target_running(deployment, DECODE) * 2))
    do_autoscale(redis_client, now_s=peak)
    Deployment.objects.filter(pk=deployment.pk).update(decode_replicas_desired=2)
    report(redis_client, decode, running=2)
    outcomes = do_autoscale(redis_client, now_s=peak + DAY - COLD_START_S)
    # The prefill phase's quiet day-old window lets it shrink; decode's peak is not its floor.
    assert reasons(outcomes) == {"prefill": "down on load", "decode": "up on forecast"}
    assert redis_client.exists(f"autoscale:history:{deployment.pk}:decode")


def test_a_prefill_replica_holds_the_prompts_whose_prefills_fit_the_ttft_objective(
    disaggregated: Callable[..., Disaggregated],
) -> None:
    deployment, _, _ = disaggregated()
    prefill_s = PerfModel(
        load_gpu_specs()["H100-SXM-80GB"], deployment.model_version.model.spec(), "bf16", 1
    ).ttft_s(TYPICAL_PROMPT_TOKENS)
    prompts = target_running(deployment, PREFILL)
    assert prompts * prefill_s <= 1.0 < (prompts + 1) * prefill_s


def test_the_decode_target_follows_the_decode_pools_gpu_class(
    disaggregated: Callable[..., Disaggregated],
) -> None:
    deployment, _, _ = disaggregated()
    on_h200 = target_running(deployment, DECODE)
    GpuPool.objects.filter(decode_deployments=deployment).update(
        gpu_class=GpuClass.objects.get(name="L40S-48GB")
    )
    deployment = Deployment.objects.select_related("decode_pool__gpu_class").get(pk=deployment.pk)
    assert target_running(deployment, DECODE) < on_h200


# --- do_scale_deployment per phase -------------------------------------------------------------


@pytest.mark.parametrize(("requested", "written"), [(10, 3), (0, 1)])
def test_scaling_the_decode_phase_writes_its_count_within_its_bounds_and_reconciles(
    disaggregated: Callable[..., Disaggregated],
    django_capture_on_commit_callbacks: Callable[..., Any],
    requested: int,
    written: int,
) -> None:
    deployment, _, _ = disaggregated(decode_max=3)
    with django_capture_on_commit_callbacks() as callbacks:
        do_scale_deployment(deployment, requested, phase=DECODE)
    assert counts(deployment) == (2, written)
    assert callbacks == [Enqueue("serving.reconcile")]


def test_a_count_that_does_not_change_requests_no_reconcile(
    fleet: Callable[..., tuple[Deployment, list[Replica]]],
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    deployment, _ = fleet()
    with django_capture_on_commit_callbacks() as callbacks:
        do_scale_deployment(deployment, 2)
    assert callbacks == []


def test_a_colocated_deployment_has_no_decode_phase_to_scale(
    fleet: Callable[..., tuple[Deployment, list[Replica]]],
) -> None:
    deployment, _ = fleet()
    with pytest.raises(ValidationError, match="no decode phase"):
        do_scale_deployment(deployment, 3, phase=DECODE)
    assert counts(deployment) == (2, 1)


def test_bounds_staff_moved_since_the_row_was_read_are_not_overrun(
    fleet: Callable[..., tuple[Deployment, list[Replica]]],
) -> None:
    deployment, _ = fleet()  # read with replicas_max 6
    Deployment.objects.filter(pk=deployment.pk).update(replicas_max=3)
    do_scale_deployment(deployment, 5)
    assert counts(deployment) == (2, 1)
