"""Real vLLM (its CPU build, in .venv-vllm) in the loop: the tiny model built offline, and one
fleet for the whole package: the platform's ASGI app in uvicorn (control plane API and /v1
gateway), a real node agent started with --cpu-slots that launches vLLM through the argv
builder, and the control loops on a thread in place of Celery beat.

One replica: a 2-core machine has one core for an engine once the node keeps one back for
itself (the agent's --cpu-reserved-cores, 1 by default). Two engines, one per core, starve
the node: heartbeats and Redis calls stalled for 20 s under load when that was tried.

vLLM takes 25 to 75 s to start on two cores, so the fleet is started once for the package and
its rows are committed for real (a transactional test's flush would delete them): the tests here
are marked `django_db` (each in a transaction that is rolled back, which sees the committed
fleet), and the package ends by flushing the database and Redis it used, as a transactional
test does, then reloading what the data migrations load (the GPU and CPU classes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from django.db import close_old_connections
from django.test import override_settings

from serving.actions.credentials import do_create_join_token, engine_api_key
from serving.actions.gpu_classes import sync_gpu_classes
from serving.demo import TINY_ADAPTER, TINY_MODEL, seed_tiny_model
from serving.models import GpuClass, GpuPool, Replica
from tests.gateway.conftest import GatewayServer, free_port, sample
from tests.live import ControlLoops, eventually
from tests.real_vllm.otlp import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "var" / "test" / "models" / "tiny-llama"
CPU_CLASS = "CPU-X86-2C"
POOL = "cpu-test"
# vLLM's CPU build: start-up to a first token is 25 to 75 s alone on two cores, more with two
# engines loading at once and the suite running beside them.
READY_TIMEOUT_S = 420


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama and its adapters, built (or found up to date) by the vLLM venv."""
    python = Path(settings.VLLM_PYTHON)
    if not python.exists():
        pytest.fail(
            f"vLLM's CPU build is not installed ({python} is missing): `make test` installs it "
            "into .venv-vllm from requirements-cpu-node.txt"
        )
    subprocess.run(
        [str(python), "scripts/build_tiny_model.py", str(MODEL_DIR)],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return MODEL_DIR


@dataclass
class Engine:
    """One replica's vLLM as a test sees it: its address and its own engine key."""

    replica_id: str
    url: str
    key: str
    pid: int

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        return sample(self.metrics(), name, **labels)

    def post(
        self, path: str, body: dict[str, Any], *, key: str | None = None, timeout_s: float = 60
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key if key is not None else self.key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=timeout_s)


@dataclass
class RealFleet:
    gateway: GatewayServer
    redis: redis.Redis
    deployment_id: int
    agent: subprocess.Popen[bytes]
    agent_log: Path
    blocker: Any
    # Where the gateway and vLLM export their spans (both trace throughout the package).
    traces: OtlpReceiver
    keys: dict[str, str] = field(default_factory=dict)
    # Each replica's counters when it first became Ready, before any test traffic.
    at_ready: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def vllm_python(self) -> str:
        return str(settings.VLLM_PYTHON)

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}/v1"

    @contextlib.contextmanager
    def db(self) -> Iterator[None]:
        with self.blocker.unblock():
            yield

    def engines(self) -> list[Engine]:
        """The deployment's Ready replicas, as the control plane knows them."""
        with self.db():
            replicas = list(
                Replica.objects.filter(
                    deployment_id=self.deployment_id,
                    state=Replica.State.READY,
                    pid__isnull=False,
                    port__isnull=False,
                ).order_by("pk")
            )
        return [
            Engine(r.replica_id, f"http://127.0.0.1:{r.port}", engine_api_key(r.pk), int(r.pid))
            for r in replicas
            if r.pid is not None
        ]

    def engine(self, replica_id: str) -> Engine:
        return next(e for e in self.engines() if e.replica_id == replica_id)

    def wait_ready(self, count: int, timeout_s: float = READY_TIMEOUT_S) -> list[Engine]:
        """`count` Ready replicas, each also in the gateway's routing snapshot."""

        def ready() -> list[Engine] | None:
            engines = self.engines()
            snapshot = self.gateway.gateway().routing.snapshot if _gateway_up() else None
            if snapshot is None or len(engines) < count:
                return None
            routed = all(e.replica_id in snapshot.endpoints for e in engines)
            return engines if routed else None

        try:
            return eventually(ready, timeout_s, f"{count} Ready vLLM replicas", step_s=1)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        with self.db():
            rows = list(Replica.objects.filter(deployment_id=self.deployment_id).values())
        tail = self.agent_log.read_text(errors="replace")[-4000:] if self.agent_log.exists() else ""
        return f"replicas: {rows}\nagent log tail:\n{tail}"


def _gateway_up() -> bool:
    from serving.gateway import service

    return service._gateway is not None


# The package's scope: the fleet (its control loops publish routing tables, its agent runs an
# engine) must be gone before the rest of the suite runs against the same database and Redis.
@pytest.fixture(scope="package")
def real_fleet(
    tiny_model: Path, django_db_setup: None, django_db_blocker: Any, tmp_path_factory: Any
) -> Iterator[RealFleet]:
    from django.contrib.auth import get_user_model

    from tenants.actions import do_create_api_key, do_create_tenant, do_update_quota
    from tenants.models import Tenant

    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    client.flushdb()
    state = tmp_path_factory.mktemp("cpu-agent")
    with django_db_blocker.unblock():
        sync_gpu_classes(GpuClass)
        pool = GpuPool.objects.create(
            name=POOL, gpu_class=GpuClass.objects.get(name=CPU_CLASS), region="local"
        )
        _, join_token = do_create_join_token(pool, name="test")
        # built under var/test/models, not the default root: let registration accept it
        with override_settings(PLATFORM_MODEL_ROOT=MODEL_DIR.parent):
            deployment = seed_tiny_model(tiny_model, POOL)
        admin = get_user_model().objects.create_user("real-vllm-admin", is_staff=True)
        keys = {}
        for slug in ("acme", "globex", "initech"):
            tenant = do_create_tenant(slug, slug.title())
            _, keys[slug] = do_create_api_key(tenant, f"{slug} key", admin, ("inference",))
        # One stream at a time: a lease a cut stream failed to free would refuse the next.
        do_update_quota(Tenant.objects.get(slug="initech").quota, concurrent_streams=1)
        close_old_connections()
    gateway = GatewayServer(free_port())
    loops = ControlLoops()
    log = state / "agent.log"
    agent: subprocess.Popen[bytes] | None = None
    traces = OtlpReceiver()
    traces.start()
    with django_db_blocker.unblock():
        gateway.start()
        # The gateway starts on its first /v1 request, tracing to the receiver; the fleet
        # waits on its routing view.
        with override_settings(OTEL_TRACES_ENDPOINT=traces.url):
            httpx.get(
                f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {keys['acme']}"}
            )
        loops.start()
        try:
            with log.open("wb") as out:
                agent = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "serving.agent",
                        "--control-plane",
                        gateway.url,
                        "--token",
                        join_token,
                        "--cpu-slots",
                        "1",
                        "--node-name",
                        "cpu-test-1",
                        "--vllm-python",
                        settings.VLLM_PYTHON,
                        "--state-dir",
                        str(state),
                        "--ready-timeout",
                        str(READY_TIMEOUT_S),
                        "--restart-backoff-cap",
                        "1",
                        "--stop-grace",
                        "5",
                        "--cpu-kv-cache-gib",
                        "1",
                        "--otlp-traces-endpoint",
                        traces.url,
                    ],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            fleet = RealFleet(
                gateway, client, deployment.pk, agent, log, django_db_blocker, traces, keys
            )
            for engine in fleet.wait_ready(1):
                text = engine.metrics()
                fleet.at_ready[engine.replica_id] = {
                    name: sample(text, name)
                    for name in ("vllm:request_success_total", "vllm:generation_tokens_total")
                }
            yield fleet
        finally:
            loops.stop()
            if agent is not None:
                _stop(agent)
            gateway.stop()
            traces.stop()
            close_old_connections()
            call_command("flush", "--noinput", verbosity=0)
            # What the data migrations loaded, which the tests after these expect as they found it.
            sync_gpu_classes(GpuClass)
            client.flushdb()
            client.close()


def _stop(agent: subprocess.Popen[bytes]) -> None:
    """SIGTERM the agent (it stops its engines), then make sure no engine outlives it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGTERM)
    try:
        agent.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.kill()
    for pid in Replica.objects.exclude(pid=None).values_list("pid", flat=True):
        assert pid is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


__all__ = ["TINY_ADAPTER", "TINY_MODEL", "Engine", "RealFleet", "sample"]
