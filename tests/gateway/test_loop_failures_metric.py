"""The gateways count the control loops' standing failures (config/loops.py) into
`platform_control_loop_failures`, which the ControlLoopFailing alert reads, and export when
each loop's last pass ended, which ControlLoopStalled reads: the Celery workers serve no
/metrics of their own."""

from __future__ import annotations

import time

import redis
from django.conf import settings
from prometheus_client import REGISTRY

from config.loops import LoopPass
from serving.gateway.service import Gateway, GatewayConfig
from tenants.keys import KeyPrincipal


def _reported(loop: str) -> float | None:
    return REGISTRY.get_sample_value("platform_control_loop_failures", {"loop": loop})


async def test_each_loops_failures_are_counted_and_go_back_to_zero(
    redis_client: redis.Redis,
) -> None:
    gateway = Gateway(GatewayConfig(redis_url=settings.REDIS_URL), load_principal=no_principal)
    reconcile, rollouts = LoopPass("reconcile", "deployment"), LoopPass("rollout_tick", "rollout")
    try:
        await gateway.read_control_loops()
        assert [_reported(loop) for loop in ("reconcile", "autoscale", "rollout_tick")] == [0, 0, 0]

        reconcile.failed = {3: "ZeroDivisionError: float division by zero", 5: "KeyError: 'x'"}
        rollouts.failed = {9: "ValueError: broken gate"}
        reconcile.record(redis_client)
        rollouts.record(redis_client)
        await gateway.read_control_loops()
        assert (_reported("reconcile"), _reported("rollout_tick")) == (2, 1)
        assert _reported("autoscale") == 0

        reconcile.failed = {}
        reconcile.record(redis_client)
        await gateway.read_control_loops()
        assert (_reported("reconcile"), _reported("rollout_tick")) == (0, 1)
    finally:
        await gateway.redis.aclose()


async def no_principal(_: str) -> KeyPrincipal | None:
    return None


async def test_when_each_loops_last_pass_ended_is_exported(redis_client: redis.Redis) -> None:
    gateway = Gateway(GatewayConfig(redis_url=settings.REDIS_URL), load_principal=no_principal)
    try:
        before = time.time()
        LoopPass("autoscale", "deployment").record(redis_client)
        after = time.time()
        await gateway.read_control_loops()
        ended = REGISTRY.get_sample_value(
            "platform_control_loop_last_pass_timestamp_seconds", {"loop": "autoscale"}
        )
        assert ended is not None and before <= ended <= after
    finally:
        await gateway.redis.aclose()
