"""The fleet with real processes: the Django server (pytest-django `live_server`), real node
agents (`python -m serving.agent`) that run real engine simulators, real PostgreSQL and Redis.

The control loops (node health, reconcile, publish) are called directly, once a second, from a
thread of the test process, in place of Celery beat and a worker: the same functions the tasks
call, on a clock the test controls.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from django.db import close_old_connections
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from pytest_django.live_server_helper import LiveServer

from metering.models import ReplicaHour
from metering.rollups import hour_floor, recompute_hour
from registry.models import Deployment
from serving import telemetry
from serving.actions.credentials import engine_api_key
from serving.models import Node, Replica, ReplicaEvent
from tests.fleet.conftest import MakeDeployment, MakePool
from tests.live import ControlLoops, eventually

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


class Agents:
    def __init__(self, url: str, state_root: Path) -> None:
        self.url, self.state_root = url, state_root
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, join_token: str, gpus: str = "L4-24GB:1") -> None:
        self.processes[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "serving.agent",
                "--control-plane",
                self.url,
                "--token",
                join_token,
                "--simulate-gpus",
                gpus,
                "--node-name",
                name,
                "--state-dir",
                str(self.state_root / name),
                "--sim-time-scale",
                "1",
                "--restart-backoff-cap",
                "1",
                "--stop-grace",
                "2",
                "--log-level",
                "WARNING",
            ],
            cwd=ROOT,
            start_new_session=True,
        )

    def kill(self, name: str) -> None:
        """SIGKILL the agent alone: its replicas keep running, as when an agent hangs."""
        self.processes[name].kill()
        self.processes[name].wait()

    def stop_all(self) -> None:
        for process in self.processes.values():
            # The agent's own group; simulators it started have their own groups too.
            with _quiet():
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is ProcessLookupError or exc[0] is PermissionError


# The agents, the deployment they serve and the pool's join token.
Fleet = tuple[Agents, Deployment, str]


def _kill_replica_processes() -> None:
    for pid in Replica.objects.exclude(pid=None).values_list("pid", flat=True):
        assert pid is not None
        with _quiet():
            os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def fleet(
    live_server: LiveServer,
    make_pool: MakePool,
    make_deployment: MakeDeployment,
    tmp_path: Path,
    redis_client: redis.Redis,
) -> Iterator[Fleet]:
    pool, secret = make_pool("l4-live", "L4-24GB")
    deployment = make_deployment(pool, model="llama-3.2-1b", max_model_len=2048, max_num_seqs=32)
    agents = Agents(live_server.url, tmp_path)
    loops = ControlLoops()
    loops.start()
    try:
        yield agents, deployment, secret
    finally:
        loops.halt.set()
        loops.join(timeout=10)
        agents.stop_all()
        _kill_replica_processes()
        close_old_connections()


def _ready_replica(deployment: Deployment, timeout_s: float = 60) -> Replica:
    """A Ready replica of the deployment with a process (`pid` set)."""
    return eventually(
        lambda: deployment.replicas.filter(state=Replica.State.READY, pid__isnull=False).first(),
        timeout_s,
        "a Ready replica",
    )


def test_a_killed_replica_is_restarted_by_the_agent_and_the_event_recorded(fleet: Fleet) -> None:
    agents, deployment, secret = fleet
    agents.start("live-1", secret)
    replica = _ready_replica(deployment)
    assert replica.pid is not None
    os.kill(replica.pid, signal.SIGKILL)

    eventually(
        lambda: ReplicaEvent.objects.filter(replica=replica, kind="crashed").exists(),
        30,
        "the crash recorded",
    )

    def restarted() -> Replica | None:
        replica.refresh_from_db()
        return replica if replica.restarts >= 1 and replica.state == Replica.State.READY else None

    eventually(restarted, 60, "the replica Ready again after a restart")
    assert replica.events.filter(kind="restarted", source="agent").exists()


def test_a_stopped_agents_node_is_not_ready_within_15_s_and_its_replicas_run_elsewhere(
    fleet: Fleet,
) -> None:
    agents, deployment, secret = fleet
    agents.start("live-1", secret)
    first = _ready_replica(deployment)
    agents.start("live-2", secret)
    eventually(lambda: Node.objects.filter(hostname="live-2").exists(), 30, "the second node")
    lost_node = first.node
    agents.kill(lost_node.hostname)
    stopped_at = time.monotonic()

    eventually(
        lambda: Node.objects.get(pk=lost_node.pk).health == Node.Health.NOT_READY,
        15,
        "the node NotReady",
    )
    assert time.monotonic() - stopped_at <= 15
    moved = eventually(
        lambda: (
            deployment.replicas.filter(state=Replica.State.READY).exclude(node=lost_node).first()
        ),
        60,
        "a replica Ready on the other node",
    )
    assert moved.node.hostname != lost_node.hostname


def _sim_metrics(endpoint: str) -> dict[str, float]:
    text = httpx.get(f"{endpoint}/metrics", timeout=5).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in {
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
            }:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def _load(endpoint: str, key: str, model: str, streams: int, max_tokens: int) -> None:
    # The engine's own key, as the gateway sends it: the engine refuses callers without it.
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        body = {
            "model": model,
            "prompt": "tell me a long story " * 20,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        await asyncio.gather(
            *(client.post(f"{endpoint}/v1/completions", json=body) for _ in range(streams))
        )


def test_telemetry_in_redis_matches_the_simulators_own_state_under_load(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    agents, deployment, secret = fleet
    agents.start("live-1", secret)
    replica = _ready_replica(deployment)
    endpoint = f"http://127.0.0.1:{replica.port}"
    streams = 12
    before = _sim_metrics(endpoint)["vllm:generation_tokens_total"]  # the readiness probe's
    load = threading.Thread(
        target=asyncio.run,
        args=(_load(endpoint, engine_api_key(replica.pk), "llama-3.2-1b", streams, 1500),),
    )
    load.start()

    # Under load: the numbers the control plane holds are the simulator's, within one scrape.
    def busy() -> dict[str, Any] | None:
        latest = telemetry.read_replica(redis_client, replica.replica_id)
        held = latest and latest.get("num_requests_running", 0) + latest.get(
            "num_requests_waiting", 0
        )
        return latest if held == streams else None

    latest = eventually(busy, 30, "the load visible in Redis")
    own = _sim_metrics(endpoint)
    assert own["vllm:num_requests_running"] + own["vllm:num_requests_waiting"] == streams
    assert latest["num_requests_running"] == own["vllm:num_requests_running"]
    load.join(timeout=120)

    # After it: the counters agree exactly once the next scrape has landed.
    own = _sim_metrics(endpoint)

    def caught_up() -> dict[str, Any] | None:
        latest = telemetry.read_replica(redis_client, replica.replica_id) or {}
        return (
            latest
            if latest.get("generation_tokens_total") == own["vllm:generation_tokens_total"]
            else None
        )

    latest = eventually(caught_up, 10, "the final counters in Redis")
    assert latest["prompt_tokens_total"] == own["vllm:prompt_tokens_total"]
    assert latest["generation_tokens_total"] - before == streams * 1500
    compact = telemetry.read_routing_telemetry(redis_client)[replica.replica_id]
    assert (compact["running"], compact["waiting"]) == (0, 0)


def test_the_ledger_charges_ready_time_from_real_agents_events_and_stops_at_the_stop(
    fleet: Fleet,
) -> None:
    agents, deployment, secret = fleet
    began = time.time()
    agents.start("live-1", secret)
    replica = _ready_replica(deployment)
    seen_ready = time.time()  # the replica became ready at or before this
    time.sleep(3)
    killed = time.time()
    assert replica.pid is not None
    os.killpg(replica.pid, signal.SIGKILL)

    def ready_again() -> Replica | None:
        replica.refresh_from_db()
        return replica if replica.restarts >= 1 and replica.state == Replica.State.READY else None

    eventually(ready_again, 60, "the replica Ready again after the crash")
    seen_ready_again = time.time()
    time.sleep(3)
    stopping = time.time()
    agents.stop_all()
    # The agent's last beat reports the stop itself; no node loss needed.
    eventually(
        lambda: Replica.objects.get(pk=replica.pk).state == Replica.State.STOPPED,
        10,
        "the stop reported by the stopping agent",
    )

    def ledger_seconds(now: datetime) -> float:
        hour = hour_floor(datetime.fromtimestamp(began, UTC))
        for start in (hour, hour + timedelta(hours=1)):
            recompute_hour(start, now)
        rows = ReplicaHour.objects.filter(replica_id=replica.replica_id)
        return sum(row.ready_us for row in rows) / 1e6

    charged = ledger_seconds(timezone.now())
    # At least the two stretches the test saw ready, at most the agent's whole life.
    assert charged >= (killed - seen_ready) + (stopping - seen_ready_again) - 0.5
    assert charged <= stopping + 2.5 - began
    # Ten minutes on, nothing more: the meter stopped with the replica.
    assert ledger_seconds(timezone.now() + timedelta(minutes=10)) == charged
