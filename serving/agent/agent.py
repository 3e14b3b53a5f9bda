"""The node agent: owns the replicas of one node, applies the desired set (pulled with each
heartbeat or pushed to its HTTP API), and reports GPUs, replicas and events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from .control_plane import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    ControlPlaneClient,
    CredentialStore,
    NodeCredentials,
    Unauthorized,
    Unreachable,
)
from .events import EventQueue
from .gpus import GpuInventory
from .launch import ALL_INTERFACES, LaunchSettings
from .replica import (
    STOPPED,
    ReplicaSupervisor,
    SupervisionTimings,
    pick_free_port,
)
from .specs import ReplicaSpec, SpecError, parse_desired_set, parse_desired_set_leniently

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    control_plane: str
    join_token: str
    state_dir: Path
    node_name: str = field(default_factory=socket.gethostname)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    # What the control plane should call; defaults to the listen address.
    advertise_url: str | None = None
    launch: LaunchSettings = field(default_factory=lambda: LaunchSettings(simulated=False))
    timings: SupervisionTimings = field(default_factory=SupervisionTimings)
    control_plane_timeout_s: float = 5.0
    register_retry_cap_s: float = 10.0
    scrape_timeout_s: float = 1.5


# The last beat of a stopping agent waits this long for the control plane at most.
GOODBYE_TIMEOUT_S = 2.0


class NodeAgent:
    def __init__(self, config: AgentConfig, gpus: GpuInventory) -> None:
        self.config = config
        self.gpus = gpus
        self.events = EventQueue()
        self.replicas: dict[str, ReplicaSupervisor] = {}
        self.credentials: NodeCredentials | None = None
        self.agent_url: str = ""
        self.last_heartbeat_ok_at: float | None = None
        self._refused_token: str | None = None
        self._store = CredentialStore(config.state_dir, config.control_plane)
        self._apply_lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def node_token(self) -> str | None:
        return self.credentials.node_token if self.credentials else None

    # -- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        from .api import build_agent_app

        self._http = aiohttp.ClientSession()
        self.credentials = self._store.load()
        if restored := self.events.restore(self._undelivered_path):
            log.info("%d replica events from before the last stop wait for delivery", restored)
        self._runner = web.AppRunner(build_agent_app(self), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.listen_host, self.config.listen_port)
        await site.start()
        self.agent_url = self.config.advertise_url or self._listen_url()
        self._loop_task = asyncio.create_task(self._report_forever(), name="heartbeats")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await asyncio.gather(*(r.stop() for r in self.replicas.values()))
        await self._say_goodbye()
        self.events.save(self._undelivered_path)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _say_goodbye(self) -> None:
        """One last beat, its answer ignored: the control plane learns that the replicas
        stopped, and when, now rather than when the node is declared lost. What it cannot
        take waits on disk for the next start."""
        if self.credentials is None or self._http is None:
            return
        events = self.events.pending()
        body = self.heartbeat_body(events)
        try:
            await asyncio.wait_for(
                self._client().heartbeat(self.credentials.node_token, body),
                timeout=GOODBYE_TIMEOUT_S,
            )
        except (Unreachable, Unauthorized, TimeoutError) as exc:
            log.warning("could not report the stop to the control plane: %s", exc)
            return
        self.events.acknowledge(events)

    @property
    def _undelivered_path(self) -> Path:
        return self.config.state_dir / "undelivered-events.json"

    def _listen_url(self) -> str:
        assert self._runner is not None
        port = int(self._runner.addresses[0][1])
        host = self.config.listen_host
        if host in ALL_INTERFACES:
            host = socket.gethostname()
        return f"http://{host}:{port}"

    # -- desired state ----------------------------------------------------------------------

    async def apply_desired(
        self, specs: list[ReplicaSpec], untouchable: frozenset[str] = frozenset()
    ) -> None:
        """Level-triggered: make the running set equal `specs`. Applying the same set again
        changes nothing; a changed launch spec replaces its replica. Replicas in
        `untouchable` (desired, but with a spec this agent refused) are left as they are."""
        async with self._apply_lock:
            desired = {spec.replica_id: spec for spec in specs}
            for replica_id, replica in list(self.replicas.items()):
                if replica.state == STOPPED or replica_id in untouchable:
                    continue
                spec = desired.get(replica_id)
                if spec is None:
                    replica.drain_and_stop()
                elif spec.launch_identity() != replica.spec.launch_identity():
                    await replica.stop()
                    del self.replicas[replica_id]
                elif spec.adapters != replica.spec.adapters:
                    await replica.update_adapters(spec)
            for replica_id, spec in desired.items():
                current = self.replicas.get(replica_id)
                if current is not None and current.state != STOPPED:
                    continue
                self._launch(spec)

    def _launch(self, spec: ReplicaSpec) -> None:
        assert self._http is not None
        taken = {r.spec.port for r in self.replicas.values() if r.spec.port is not None}
        known = {gpu.index for gpu in self.gpus.inventory()}
        missing = sorted(set(spec.gpu_indices) - known)
        replica = ReplicaSupervisor(
            spec,
            launch=self.config.launch,
            timings=self.config.timings,
            http=self._http,
            emit=self.events.emit,
            port=spec.port if spec.port is not None else pick_free_port(taken),
        )
        self.replicas[spec.replica_id] = replica
        if missing:
            replica.state = "Failed"
            replica.last_error = f"this node has no GPU {missing}"
            self.events.emit(spec.replica_id, "failed", replica.last_error)
            return
        replica.start()

    async def apply_desired_json(self, raw: Any) -> None:
        await self.apply_desired(parse_desired_set(raw))

    def replica_states(self) -> list[dict[str, Any]]:
        return [replica.to_json() for replica in self.replicas.values()]

    # -- reporting --------------------------------------------------------------------------

    async def _report_forever(self) -> None:
        interval = DEFAULT_HEARTBEAT_INTERVAL_S
        while True:
            if self.credentials is None:
                await self._register_until_accepted()
            assert self.credentials is not None
            interval = self.credentials.heartbeat_interval_s
            began = time.monotonic()
            try:
                await self.heartbeat_once()
            except Unauthorized:
                log.warning("control plane refused node %s; registering again", self._node_id())
                # Kept for the registration: a node that exists re-registers only with it.
                self._refused_token = self.credentials.node_token
                self.credentials = None
                self._store.forget()
                continue
            except Unreachable as exc:
                # Replicas keep serving; events wait in the queue for the next beat that lands.
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def _register_until_accepted(self) -> None:
        client = self._client()
        delay = 0.5
        while True:
            try:
                self.credentials = await client.register(self.registration())
            except (Unreachable, Unauthorized) as exc:
                log.warning("registration failed, retrying in %.1fs: %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(self.config.register_retry_cap_s, delay * 2)
                continue
            self._store.save(self.credentials)
            self._refused_token = None
            log.info("registered as node %s", self.credentials.node_id)
            return

    def registration(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "join_token": self.config.join_token,
            "hostname": self.config.node_name,
            "agent_url": self.agent_url,
            "gpus": [gpu.to_json() for gpu in self.gpus.inventory()],
        }
        if self._refused_token is not None:
            body["node_token"] = self._refused_token
        return body

    async def heartbeat_once(self) -> None:
        """One beat: scrape, send, then act on the desired set the answer carries."""
        assert self.credentials is not None
        await asyncio.gather(
            *(r.scrape(self.config.scrape_timeout_s) for r in list(self.replicas.values()))
        )
        events = self.events.pending()
        body = self.heartbeat_body(events)
        answer = await self._client().heartbeat(self.credentials.node_token, body)
        self.last_heartbeat_ok_at = time.time()
        self.events.acknowledge(events)
        self._forget_reported_stops(body)
        desired = answer.get("desired_replicas")
        # An answer without the key says nothing about the desired set; [] means "run none".
        if desired is not None:
            try:
                specs, refused = parse_desired_set_leniently(desired)
            except SpecError as exc:
                log.error("control plane sent a desired set we cannot read: %s", exc)
                return
            for replica_id, reason in refused.items():
                log.error("cannot run replica %s: %s", replica_id, reason)
            await self.apply_desired(specs, untouchable=frozenset(refused))

    def heartbeat_body(self, events: list[Any]) -> dict[str, Any]:
        loads = [replica.gpu_load() for replica in self.replicas.values()]
        return {
            "node_id": self._node_id(),
            "sent_at": time.time(),
            "gpus": [sample.to_json() for sample in self.gpus.sample(loads)],
            "replicas": self.replica_states(),
            "events": [event.to_json() for event in events],
        }

    def _forget_reported_stops(self, body: dict[str, Any]) -> None:
        reported = {r["replica_id"] for r in body["replicas"] if r["state"] == STOPPED}
        for replica_id in reported:
            replica = self.replicas.get(replica_id)
            if replica is not None and replica.state == STOPPED:
                del self.replicas[replica_id]

    def _node_id(self) -> str | None:
        return self.credentials.node_id if self.credentials else None

    def _client(self) -> ControlPlaneClient:
        assert self._http is not None
        return ControlPlaneClient(
            self.config.control_plane, self._http, self.config.control_plane_timeout_s
        )
