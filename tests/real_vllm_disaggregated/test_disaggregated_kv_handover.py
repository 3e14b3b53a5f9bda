"""A disaggregated deployment of the tiny model on two real vLLM CPU engines, end to end: the
registry holds it (prefill pool and decode pool, the shared-storage connector), reconcile places
one replica of each phase, two nodes register and heartbeat over the agent API as agents do, the
engines are launched from the specs the heartbeat answers through the agent's argv builder
(kv_producer and kv_consumer), the control plane publishes the routing table, and the official
`openai` client streams through the gateway: prefilled on one engine, decoded on the other from
the KV it left.

Its own package: the real_vllm package's fleet (one engine on this 2-core machine) is torn down
before this starts, so the pair has the machine's two cores, one each. No agent process runs
them: two engines and an agent starve a 2-core node (the real_vllm package's note), so the test
does the agent's three calls itself (register, heartbeat, launch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import close_old_connections
from django.test import override_settings

from registry.actions import do_update_deployment
from serving.actions.credentials import do_create_join_token
from serving.actions.gpu_classes import sync_gpu_classes
from serving.actions.reconcile import do_reconcile
from serving.actions.routing_table import publish_routing_table
from serving.agent.launch import LaunchSettings, build_launch_command, engine_environment
from serving.agent.specs import ReplicaSpec, parse_replica_spec, with_port
from serving.demo import TINY_MODEL, seed_tiny_model
from serving.models import GpuClass, GpuPool
from tenants.actions import do_create_api_key, do_create_tenant
from tests.gateway.conftest import GatewayServer, free_port, sample
from tests.live import eventually
from tests.metering.helpers import stream_events

# django_db: the test database is set up only for the aliases marked tests ask for; the
# fixture's rows are committed for real and flushed at the end, as the real_vllm package does.
pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.django_db]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "var" / "test" / "models" / "tiny-llama"
CPU_CLASS = "CPU-X86-2C"
BLOCK = 128  # the CPU backend's KV block, in tokens (REAL_VLLM.md)
READY_TIMEOUT_S = 420
EXTERNAL = {"source": "external_kv_transfer"}
# Each phase's pool, and the core its one engine is pinned to.
PHASES = (("prefill", 0), ("decode", 1))
PROMPT = " ".join(f"clause {i} of the hand-over test says nothing new." for i in range(30))


@dataclass
class Phase:
    spec: ReplicaSpec
    process: subprocess.Popen[bytes]

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def key(self) -> str:
        assert self.spec.api_key is not None
        return self.spec.api_key

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        reply = httpx.post(
            f"{self.url}/v1/completions",
            json={"model": TINY_MODEL, "prompt": prompt, "max_tokens": max_tokens},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        return answer

    def metric(self, name: str, **labels: str) -> float:
        return sample(httpx.get(f"{self.url}/metrics", timeout=30).text, name, **labels)


@dataclass
class Deployed:
    prefill: Phase
    decode: Phase
    gateway: GatewayServer
    secret: str  # a tenant's inference key
    redis: redis.Redis


class Agent:
    """What a node agent says to the control plane, over its HTTP API."""

    def __init__(self, base_url: str, join_secret: str, hostname: str) -> None:
        self.base_url = base_url
        reply = httpx.post(
            f"{base_url}/api/agent/v1/register",
            json={
                "join_token": join_secret,
                "hostname": hostname,
                "agent_url": "http://127.0.0.1:9100",
                "gpus": [
                    {"index": 0, "uuid": f"CPU-{hostname}-0", "name": "cpu", "memory_mb": 8192}
                ],
            },
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        self.node_id = reply.json()["node_id"]
        self.token = reply.json()["node_token"]

    def heartbeat(self, replicas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Report `replicas`; the specs of what this node should run."""
        reply = httpx.post(
            f"{self.base_url}/api/agent/v1/heartbeat",
            json={
                "node_id": self.node_id,
                "sent_at": 0,
                "gpus": [],
                "replicas": replicas,
                "events": [],
            },
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        desired: list[dict[str, Any]] = reply.json()["desired_replicas"]
        return desired


def _ready(phase: Phase) -> dict[str, Any]:
    """The agent's report of a replica whose engine answers /health."""
    return {
        "replica_id": phase.replica_id,
        "state": "Ready",
        "pid": phase.process.pid,
        "port": phase.spec.port,
        "restarts": 0,
        "last_error": "",
        "started_at": 1_700_000_000.0,
        "ready_at": 1_700_000_005.0,
    }


def _registry() -> tuple[dict[str, str], str]:
    """The pools, their join tokens, the disaggregated deployment and a tenant; returns each
    phase's join secret and the tenant's inference key."""
    sync_gpu_classes(GpuClass)
    cpu = GpuClass.objects.get(name=CPU_CLASS)
    pools = {
        phase: GpuPool.objects.create(name=f"cpu-{phase}", gpu_class=cpu, region="local")
        for phase, _ in PHASES
    }
    joins = {phase: do_create_join_token(pool, name=phase)[1] for phase, pool in pools.items()}
    with override_settings(PLATFORM_MODEL_ROOT=MODEL_DIR.parent):
        deployment = seed_tiny_model(MODEL_DIR, "cpu-prefill")
    do_update_deployment(
        deployment,
        decode_pool=pools["decode"],
        kv_connector="shared_storage",
        decode_replicas_min=1,
        decode_replicas_max=1,
        decode_replicas_desired=1,
    )
    admin = get_user_model().objects.create_user("disagg-admin", is_staff=True)
    tenant = do_create_tenant("acme", "Acme")
    _, secret = do_create_api_key(tenant, "acme key", admin, ("inference",))
    return joins, secret


@pytest.fixture(scope="module")
def deployed(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployed]:
    python = Path(settings.VLLM_PYTHON)
    if not python.exists():
        pytest.fail(f"vLLM's CPU build is not installed ({python} is missing)")
    subprocess.run(
        [str(python), "scripts/build_tiny_model.py", str(MODEL_DIR)],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    client.flushdb()
    shared = tmp_path_factory.mktemp("kv")
    logs = tmp_path_factory.mktemp("engines")
    gateway = GatewayServer(free_port())
    phases: dict[str, Phase] = {}
    try:
        with django_db_blocker.unblock():
            joins, secret = _registry()
            close_old_connections()
            gateway.start()
            # The gateway starts on its first /v1 request.
            httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
            agents = {
                phase: Agent(gateway.url, joins[phase], f"cpu-{phase}-1") for phase, _ in PHASES
            }
            do_reconcile()
            for phase, core in PHASES:
                (raw,) = agents[phase].heartbeat([])
                spec = with_port(parse_replica_spec(raw), free_port())
                node = LaunchSettings(
                    simulated=False,
                    device="cpu",
                    vllm_python=str(python),
                    cpu_slots=((core,),),
                    kv_shared_dir=str(shared),
                )
                argv, extra = build_launch_command(spec, node)
                assert "--kv-transfer-config" in argv
                with (logs / f"{phase}.log").open("wb") as out:
                    process = subprocess.Popen(
                        argv,
                        cwd=ROOT,
                        env=engine_environment(os.environ, extra),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                phases[phase] = Phase(spec, process)
            for phase, _ in PHASES:
                try:
                    eventually(
                        partial(_healthy, phases[phase]), READY_TIMEOUT_S, f"{phase} up", step_s=2
                    )
                except AssertionError:
                    tail = (logs / f"{phase}.log").read_text(errors="replace")[-3000:]
                    raise AssertionError(f"the {phase} engine did not come up:\n{tail}") from None
                agents[phase].heartbeat([_ready(phases[phase])])
            publish_routing_table()
            eventually(
                lambda: all(
                    p.replica_id in gateway.gateway().routing.snapshot.endpoints
                    for p in phases.values()
                ),
                60,
                "both phases in the gateway's routing table",
            )
        yield Deployed(phases["prefill"], phases["decode"], gateway, secret, client)
    finally:
        # Each engine leads its own process group (its engine core is a child): the whole
        # group goes, so no busy-polling engine core outlives the test.
        for engine in phases.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.process.pid, signal.SIGTERM)
        for engine in phases.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                engine.process.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.process.pid, signal.SIGKILL)
        with django_db_blocker.unblock():
            gateway.stop()
            close_old_connections()
            call_command("flush", "--noinput", verbosity=0)
            # What the data migrations loaded, which the tests after these expect as found.
            sync_gpu_classes(GpuClass)
        client.flushdb()
        client.close()


def _healthy(phase: Phase) -> bool:
    if phase.process.poll() is not None:
        raise AssertionError(f"the engine exited with {phase.process.returncode}")
    try:
        return httpx.get(f"{phase.url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_openai_client_streams_through_the_gateway_a_decode_of_a_prompt_prefilled_elsewhere(
    deployed: Deployed,
) -> None:
    prefill, decode = deployed.prefill, deployed.decode
    handed_before = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
    prefilled_before = prefill.metric("vllm:generation_tokens_total")
    api = openai.OpenAI(
        base_url=f"{deployed.gateway.url}/v1", api_key=deployed.secret, max_retries=0, timeout=300
    )

    stream = api.completions.create(
        model=TINY_MODEL,
        prompt=PROMPT,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.prompt_tokens > BLOCK  # at least one whole block to hand over
    # The prefill engine generated its one token; the decode engine loaded the prompt's every
    # whole block from the prefill's KV and streamed the answer.
    assert prefill.metric("vllm:generation_tokens_total") - prefilled_before == 1
    handed = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) - handed_before
    assert handed == (usage.prompt_tokens // BLOCK) * BLOCK
    assert eventually(lambda: stream_events(deployed.redis), 30, "the usage event")
    [event] = stream_events(deployed.redis)
    assert (event.prefill_replica_id, event.prefill_pool) == (prefill.replica_id, "cpu-prefill")
    assert (event.replica_id, event.pool) == (decode.replica_id, "cpu-decode")
    assert (event.status, event.prompt_tokens) == ("ok", usage.prompt_tokens)
    assert event.completion_tokens == usage.completion_tokens


def test_disaggregated_decode_reads_the_whole_blocks_the_prefill_left(deployed: Deployed) -> None:
    """The engines' own hand-over, called directly: whole blocks, and nothing for a prompt the
    producer never saw."""
    prefill, decode = deployed.prefill, deployed.decode
    prompt = "Another prompt: " + PROMPT
    before = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
    first = prefill.complete(prompt, max_tokens=1)
    prompt_tokens = int(first["usage"]["prompt_tokens"])
    assert prompt_tokens > BLOCK  # at least one whole block to hand over
    answer = decode.complete(prompt, max_tokens=4)
    assert answer["usage"]["prompt_tokens"] == prompt_tokens
    assert answer["usage"]["completion_tokens"] >= 1
    handed = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) - before
    # The consumer loaded every whole block from the producer's KV and computed the rest.
    assert handed == (prompt_tokens // BLOCK) * BLOCK
    computed = decode.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
    assert computed >= prompt_tokens - handed
    # A prompt the producer never saw has nothing to load.
    other = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
    decode.complete("A different prompt entirely, " * 40, max_tokens=1)
    assert decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) == other
