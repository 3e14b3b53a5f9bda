"""A running gateway in front of real engine simulators, for end-to-end tests.

The gateway runs in uvicorn on a thread of the test process (so it shares the test
database), the engine simulators are real subprocesses speaking vLLM's interface, and the
routing table, catalog and price book are published to the real test Redis the way the
control plane publishes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import uvicorn
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.db import connections
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway import service
from serving.redis_contracts import (
    ROUTING_TABLE_KEY,
    ROUTING_TELEMETRY_KEY,
    ROUTING_UPDATES_CHANNEL,
    VISIBILITY_HASH,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-8b"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_http(
    url: str, timeout_s: float = 30, process: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"process exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered 200")


@dataclass
class EngineSim:
    port: int
    process: subprocess.Popen[bytes]
    gpu_class: str
    replica_id: str
    pool: str
    region: str
    price_per_hour: float
    max_loras: int = 0
    adapters: list[str] = field(default_factory=list)
    # A disaggregated deployment's phase ("prefill" or "decode") and its end of the KV link.
    phase: str = "colocated"
    kv_link: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def load_adapter(self, name: str) -> None:
        reply = httpx.post(
            f"{self.url}/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": f"/adapters/{name}"},
        )
        assert reply.status_code == 200, reply.text
        self.adapters.append(name)

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@dataclass
class Fleet:
    """Engine simulators, published as one deployment of MODEL in the routing table."""

    redis: redis.Redis
    sims: list[EngineSim] = field(default_factory=list)
    version: int = 0

    def start(
        self,
        gpu_class: str = "H100-SXM-80GB",
        *,
        pool: str = "h100",
        region: str = "us-east",
        price_per_hour: float = 3.49,
        time_scale: float = 20,
        extra: tuple[str, ...] = (),
        phase: str = "colocated",
        kv_link: str | None = None,
    ) -> EngineSim:
        port = free_port()
        argv = [sys.executable, "-m", "serving.enginesim", MODEL, "--served-model-name", MODEL]
        argv += ["--port", str(port), "--host", "127.0.0.1", "--sim-gpu-class", gpu_class]
        argv += ["--sim-time-scale", str(time_scale), "--max-model-len", "8192", *extra]
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        max_loras = int(extra[extra.index("--max-loras") + 1]) if "--max-loras" in extra else 0
        sim = EngineSim(
            port,
            process,
            gpu_class,
            f"r-{len(self.sims) + 1}-{port}",
            pool,
            region,
            price_per_hour,
            max_loras,
            phase=phase,
            kv_link=kv_link,
        )
        wait_http(f"{sim.url}/health", process=process)
        self.sims.append(sim)
        return sim

    def table(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "models": {
                MODEL: {
                    "deployments": [
                        {
                            "deployment_id": "1",
                            "version": "v1",
                            "version_id": None,
                            "weight": 100,
                            "slo_tier": "standard",
                            "replicas": [
                                {
                                    "replica_id": sim.replica_id,
                                    "endpoint": sim.url,
                                    "pool": sim.pool,
                                    "region": sim.region,
                                    "gpu_class": sim.gpu_class,
                                    "model_spec": MODEL,
                                    "price_per_hour": sim.price_per_hour,
                                    "tensor_parallel": 1,
                                    "max_num_seqs": 256,
                                    "max_loras": sim.max_loras,
                                    "adapters": sim.adapters,
                                    "phase": sim.phase,
                                    "kv_link": sim.kv_link,
                                }
                                for sim in self.sims
                            ],
                        }
                    ]
                }
            },
        }

    def publish(self) -> None:
        self.version += 1
        self.redis.set(ROUTING_TABLE_KEY, orjson.dumps(self.table()))
        now = time.time()
        for sim in self.sims:
            self.redis.hset(
                ROUTING_TELEMETRY_KEY,
                sim.replica_id,
                orjson.dumps({"running": 0, "waiting": 0, "kv": 0.0, "scraped_at": now}),
            )
        self.redis.publish(ROUTING_UPDATES_CHANNEL, str(self.version))

    def stop(self) -> None:
        for sim in self.sims:
            sim.stop()


@pytest.fixture
def fleet(redis_client: redis.Redis) -> Iterator[Fleet]:
    fleet = Fleet(redis_client)
    yield fleet
    fleet.stop()


def publish_catalog(
    client: redis.Redis,
    *,
    public: bool = True,
    tenants: tuple[int, ...] = (),
    adapters: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """What registry.actions.publish_visibility writes: MODEL and, optionally, adapters of it
    (name -> tenants granted; an empty tuple makes the adapter public)."""
    entry = {
        "kind": "model",
        "base_model": MODEL,
        "public": public,
        "tenants": list(tenants),
        "max_context": 131072,
        "created": 1_700_000_000,
    }
    client.hset(VISIBILITY_HASH, MODEL, orjson.dumps(entry))
    for name, granted in (adapters or {}).items():
        adapter = {
            "kind": "adapter",
            "base_model": MODEL,
            "public": not granted,
            "tenants": list(granted),
            "created": 1_700_000_000,
        }
        client.hset(VISIBILITY_HASH, name, orjson.dumps(adapter))


class GatewayServer:
    def __init__(self, port: int) -> None:
        self.port = port
        from config.asgi import application

        config = uvicorn.Config(
            application, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        service._gateway = None
        service._gateway_lock = None
        try:
            await self.server.serve()
        finally:
            if service._gateway is not None:
                with contextlib.suppress(Exception):
                    await service._gateway.close()
            # The key loader's database connection lives on sync_to_async's thread.
            await sync_to_async(connections.close_all)()
            service._gateway = None
            service._gateway_lock = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        wait_http(f"{self.url}/healthz")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def gateway(self) -> service.Gateway:
        assert service._gateway is not None
        return service._gateway


@pytest.fixture
def gateway_server(transactional_db: None, redis_client: redis.Redis) -> Iterator[GatewayServer]:
    server = GatewayServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def ready(gateway_server: GatewayServer, fleet: Fleet, make_key, redis_client: redis.Redis):
    """A gateway with one engine simulator published, the catalog, and an acme key's client:
    (server, key, httpx client)."""
    fleet.start()
    fleet.publish()
    publish_catalog(redis_client)
    key = make_key("acme")
    http = httpx.Client(
        base_url=gateway_server.url, headers={"Authorization": f"Bearer {key.secret}"}, timeout=30
    )
    yield gateway_server, key, http
    http.close()


@dataclass
class TenantKey:
    tenant: Any
    key: Any
    secret: str


@pytest.fixture
def make_key(transactional_db: None) -> Callable[..., TenantKey]:
    from tenants.actions import do_create_api_key, do_create_tenant, do_update_quota

    admin = get_user_model().objects.create_user("platform-admin", is_staff=True)
    tenants: dict[str, Any] = {}

    def make(
        slug: str = "acme",
        *,
        scopes: tuple[str, ...] = ("inference",),
        allowlist: tuple[str, ...] = (),
        **quota: Any,
    ) -> TenantKey:
        tenant = tenants.get(slug) or do_create_tenant(slug, slug.title())
        tenants[slug] = tenant
        if quota:
            do_update_quota(tenant.quota, **quota)
        key, secret = do_create_api_key(tenant, f"{slug} key", admin, scopes, allowlist)
        return TenantKey(tenant, key, secret)

    return make


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` (with these labels) in a Prometheus exposition."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for item in family.samples:
            if item.name == name and all(item.labels.get(k) == v for k, v in labels.items()):
                total += item.value
    return total


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()
