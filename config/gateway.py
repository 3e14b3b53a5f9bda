"""The data plane's composition root: the gateway built from the project's settings.

The gateway, the router and the engine model import nothing from Django; this module is
where Django's settings and the PostgreSQL key lookup (`tenants.actions`) are handed to them.
Imported by `config.asgi` once Django is set up.
"""

from __future__ import annotations

import os

from django.conf import settings

from serving.gateway.service import Gateway, GatewayConfig, process_gateway
from serving.gateway.tracing import TracingConfig
from serving.gateway.upstream import UpstreamTimeouts
from tenants.actions import load_principal_from_database


def gateway_config() -> GatewayConfig:
    # One spool per process (gateway workers must not share one), under PLATFORM_VAR_DIR
    # unless GATEWAY_SPOOL_PATH names a file.
    spool_path = settings.GATEWAY_SPOOL_PATH or str(
        settings.PLATFORM_VAR_DIR / f"usage-spool-{os.getpid()}.jsonl"
    )
    return GatewayConfig(
        redis_url=settings.REDIS_URL,
        redis_cluster=settings.REDIS_CLUSTER,
        redis_timeout_s=settings.REDIS_SOCKET_TIMEOUT_S,
        policy=settings.GATEWAY_ROUTER_POLICY,
        defer_looser_after=settings.GATEWAY_DEFER_LOOSER_AFTER,
        upstream=UpstreamTimeouts(
            connect_s=settings.GATEWAY_CONNECT_TIMEOUT_S, read_s=settings.GATEWAY_READ_TIMEOUT_S
        ),
        spool_path=spool_path,
        guardrails=tuple(settings.GATEWAY_GUARDRAILS),
        stream_lease_ttl_s=settings.GATEWAY_STREAM_LEASE_TTL_S,
        tracing=TracingConfig(
            endpoint=settings.OTEL_TRACES_ENDPOINT,
            sample_ratio=settings.OTEL_TRACES_SAMPLE_RATIO,
            service_name=settings.OTEL_SERVICE_NAME,
        ),
    )


def build_gateway() -> Gateway:
    return Gateway(gateway_config(), load_principal=load_principal_from_database)


async def get_gateway() -> Gateway:
    """This process's gateway, started on the first request."""
    return await process_gateway(build_gateway)
