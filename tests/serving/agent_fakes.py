"""A tiny real control plane for agent tests: an aiohttp server that speaks the agent contract
and records what it was sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from serving.agent.agent import AgentConfig, NodeAgent
from serving.agent.gpus import SimulatedGpus
from serving.agent.launch import LaunchSettings
from serving.agent.replica import Backoff, SupervisionTimings


class FakeControlPlane:
    def __init__(self, heartbeat_interval_s: float = 0.2) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registrations: list[dict[str, Any]] = []
        self.heartbeats: list[dict[str, Any]] = []
        self.desired: list[dict[str, Any]] | None = []
        self.valid_tokens: set[str] = set()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/api/agent/v1/register", self._register)
        app.router.add_post("/api/agent/v1/heartbeat", self._heartbeat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # The same port after a restart, as a control plane behind a fixed address would be.
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _register(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("join_token") != "join-secret":
            return web.json_response({"detail": "bad join token"}, status=401)
        self.registrations.append(body)
        token = f"node-token-{len(self.registrations)}"
        self.valid_tokens.add(token)
        return web.json_response(
            {
                "node_id": "node-1",
                "node_token": token,
                "heartbeat_interval_s": self.heartbeat_interval_s,
            }
        )

    async def _heartbeat(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if token not in self.valid_tokens:
            return web.json_response({"detail": "unknown node token"}, status=401)
        self.heartbeats.append(await request.json())
        if self.desired is None:
            return web.json_response({})
        return web.json_response({"desired_replicas": self.desired})

    def events(self, replica_id: str | None = None) -> list[dict[str, Any]]:
        """Each event once, as the control plane keeps them: delivery is at least once (a beat
        cut off after it landed, when the agent stops mid-beat, is sent again)."""
        seen: set[str] = set()
        kept = []
        for beat in self.heartbeats:
            for event in beat["events"]:
                if event["event_id"] in seen:
                    continue
                seen.add(event["event_id"])
                if replica_id is None or event["replica_id"] == replica_id:
                    kept.append(event)
        return kept

    def latest_replica(self, replica_id: str) -> dict[str, Any] | None:
        for beat in reversed(self.heartbeats):
            for replica in beat["replicas"]:
                if replica["replica_id"] == replica_id:
                    return dict(replica)
        return None


def simulated_spec(replica_id: str = "r-1", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replica_id": replica_id,
        "deployment_id": "d-1",
        "model": "meta-llama/Llama-3.2-1B-Instruct",
        "served_model_name": "llama-1b",
        "gpu_indices": [0],
        "port": None,
        "tensor_parallel_size": 1,
        "max_model_len": 4096,
        "max_num_seqs": 32,
        "gpu_memory_utilization": 0.9,
        "enable_prefix_caching": True,
        "sim": {"gpu_class": "L4-24GB", "time_scale": 50},
    }
    spec.update(overrides)
    return spec


def agent_config(control_plane: str, state_dir: Path, ready_timeout_s: float = 30.0) -> AgentConfig:
    return AgentConfig(
        control_plane=control_plane,
        join_token="join-secret",
        state_dir=state_dir,
        node_name="test-node",
        launch=LaunchSettings(simulated=True, default_time_scale=50, sim_gpu_class="L4-24GB"),
        timings=SupervisionTimings(
            backoff=Backoff(base_s=0.2, cap_s=1.0),
            ready_timeout_s=ready_timeout_s,
            ready_poll_s=0.1,
            stop_grace_s=2.0,
            drain_timeout_s=5.0,
        ),
        control_plane_timeout_s=1.0,
        register_retry_cap_s=0.5,
        scrape_timeout_s=1.0,
    )


@asynccontextmanager
async def running_agent(
    control_plane: str, state_dir: Path, ready_timeout_s: float = 30.0
) -> AsyncIterator[NodeAgent]:
    agent = NodeAgent(
        agent_config(control_plane, state_dir, ready_timeout_s),
        SimulatedGpus("L4-24GB", 2, "test-node"),
    )
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


async def eventually(check: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what or check}")
