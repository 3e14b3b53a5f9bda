"""One replica's engine process and its supervision: launch, readiness, adapters, restarts with
backoff, draining and stopping."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import math
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .gpus import GpuLoad
from .launch import (
    LaunchSettings,
    build_launch_command,
    engine_environment,
    engine_path,
    replica_cores,
)
from .metrics import parse_vllm_metrics
from .specs import AdapterSpec, ReplicaSpec, with_port

log = logging.getLogger(__name__)

PENDING, STARTING, READY, DRAINING, FAILED, STOPPED = (
    "Pending",
    "Starting",
    "Ready",
    "Draining",
    "Failed",
    "Stopped",
)
LIVE_STATES = frozenset({STARTING, READY, DRAINING})

OUTPUT_TAIL_LINES = 40
LAST_ERROR_CHARS = 2000

EmitEvent = Callable[[str, str, str], Any]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Restart delays: base, doubled per consecutive failure, capped; a replica that stayed
    Ready for `stable_after_s` starts again from the base."""

    base_s: float = 1.0
    cap_s: float = 30.0
    stable_after_s: float = 60.0

    def delay(self, consecutive_failures: int) -> float:
        return float(min(self.cap_s, self.base_s * 2.0 ** max(0, consecutive_failures - 1)))


@dataclass(frozen=True, slots=True)
class SupervisionTimings:
    backoff: Backoff = field(default_factory=Backoff)
    # Loading a 70B model from disk takes minutes; the simulator is ready in well under one.
    ready_timeout_s: float = 900.0
    ready_poll_s: float = 0.25
    stop_grace_s: float = 15.0
    drain_timeout_s: float = 60.0
    # Idle this long before a draining replica stops: a gateway that has not yet read the
    # routing table without it (pub/sub in flight, its 1 s poll) may still send it a request.
    drain_quiet_s: float = 2.0
    http_timeout_s: float = 5.0


class ReplicaSupervisor:
    def __init__(
        self,
        spec: ReplicaSpec,
        *,
        launch: LaunchSettings,
        timings: SupervisionTimings,
        http: aiohttp.ClientSession,
        emit: EmitEvent,
        port: int,
    ) -> None:
        self.spec = with_port(spec, port)
        self.state = PENDING
        self.pid: int | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.telemetry: dict[str, Any] | None = None
        self.loaded_adapters: dict[str, str] = {}
        self._launch = launch
        self._timings = timings
        self._http = http
        self._emit = emit
        self._output: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
        self._process: asyncio.subprocess.Process | None = None
        self._wanted = True
        self._stop_requested = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def base_url(self) -> str:
        return f"http://{self._launch.host}:{self.spec.port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"replica {self.replica_id}")

    # -- the supervision loop ---------------------------------------------------------------

    async def _supervise(self) -> None:
        consecutive_failures = 0
        first_launch = True
        while self._wanted:
            if not first_launch:
                consecutive_failures += 1
                delay = self._timings.backoff.delay(consecutive_failures)
                if await self._sleep_unless_stopped(delay):
                    break
            process = await self._spawn(restart=not first_launch, delay_note=consecutive_failures)
            first_launch = False
            if process is None:
                continue
            exit_code = await self._run_until_exit(process)
            if not self._wanted:
                break
            if self.ready_at is not None and (
                time.time() - self.ready_at >= self._timings.backoff.stable_after_s
            ):
                consecutive_failures = 0
            self._record_crash(exit_code)
        self._mark_stopped()

    async def _spawn(self, restart: bool, delay_note: int) -> asyncio.subprocess.Process | None:
        try:
            argv, extra_env = build_launch_command(self.spec, self._launch)
            cores = replica_cores(self.spec, self._launch)
        except ValueError as exc:
            self.state = FAILED
            self.last_error = str(exc)
            self._emit(self.replica_id, "failed", self.last_error)
            return None
        self.state = STARTING
        self.ready_at = None
        self.telemetry = None
        self.loaded_adapters = {}
        self._output.clear()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                env=engine_environment(os.environ, extra_env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                # Its own process group, so stopping it also stops vLLM's tensor-parallel workers.
                start_new_session=True,
                preexec_fn=functools.partial(_prepare_child, cores),
            )
        except OSError as exc:
            self.state = FAILED
            self.last_error = f"could not launch {argv[0]}: {exc}"
            self._emit(self.replica_id, "failed", self.last_error)
            return None
        self._process = process
        self.pid = process.pid
        self.started_at = time.time()
        if restart:
            self.restarts += 1
            self._emit(
                self.replica_id,
                "restarted",
                f"restart {self.restarts} (pid {process.pid}, after {delay_note} failure(s) in a row)",
            )
        else:
            self._emit(self.replica_id, "started", f"pid {process.pid} on port {self.spec.port}")
        return process

    async def _run_until_exit(self, process: asyncio.subprocess.Process) -> int:
        reader = asyncio.create_task(self._collect_output(process))
        exited = asyncio.create_task(process.wait())
        readiness = asyncio.create_task(self._become_ready(exited))
        try:
            exit_code = await exited
        finally:
            readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await readiness
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(reader, timeout=1.0)
            self._process = None
        return exit_code

    async def _collect_output(self, process: asyncio.subprocess.Process) -> None:
        # The pipe must be drained or a chatty engine blocks on a full buffer.
        assert process.stdout is not None
        async for line in process.stdout:
            self._output.append(line.decode(errors="replace").rstrip())

    async def _become_ready(self, exited: asyncio.Task[int]) -> None:
        deadline = time.monotonic() + self._timings.ready_timeout_s
        while not exited.done():
            remaining = deadline - time.monotonic()
            if await self._generates_a_token(
                max(0.5, min(self._timings.http_timeout_s, remaining))
            ):
                await self._sync_adapters(self.spec.adapters)
                if self.state == STARTING:
                    self.state = READY
                    self.ready_at = time.time()
                    self._emit(self.replica_id, "ready", f"ready on port {self.spec.port}")
                return
            if time.monotonic() > deadline:
                self.last_error = (
                    f"not ready within {self._timings.ready_timeout_s:.0f}s\n{self.output_tail()}"
                )[-LAST_ERROR_CHARS:]
                self._emit(self.replica_id, "failed", "not ready in time; restarting")
                self._signal(signal.SIGKILL)
                return
            await asyncio.sleep(self._timings.ready_poll_s)

    async def _generates_a_token(self, timeout_s: float) -> bool:
        """/health answers 200 even after a GPU fault (vLLM #36960): ask for one real token."""
        body = {"model": self.spec.served_model_name, "prompt": "ping", "max_tokens": 1}
        try:
            async with self._http.post(
                f"{self.base_url}/v1/completions",
                json=body,
                headers=self._engine_headers(),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                if response.status != 200:
                    return False
                payload = await response.json()
                return bool(payload.get("choices"))
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return False

    def _record_crash(self, exit_code: int) -> None:
        cause = (
            f"killed by signal {-exit_code}" if exit_code < 0 else f"exited with code {exit_code}"
        )
        tail = self.output_tail()
        self.last_error = (f"{cause}\n{tail}" if tail else cause)[-LAST_ERROR_CHARS:]
        self.state = FAILED
        self.pid = None
        self.telemetry = None
        self._emit(self.replica_id, "crashed", cause)

    def _mark_stopped(self) -> None:
        self.state = STOPPED
        self.pid = None
        self.telemetry = None
        self._emit(self.replica_id, "stopped", "stopped as desired")

    async def _sleep_unless_stopped(self, seconds: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop_requested.wait(), timeout=seconds)
        return self._stop_requested.is_set()

    # -- adapters ---------------------------------------------------------------------------

    async def update_adapters(self, spec: ReplicaSpec) -> None:
        """A new desired adapter list for a live replica: load and unload without a restart."""
        self.spec = with_port(spec, self.spec.port or 0)
        if self.state == READY:
            await self._sync_adapters(spec.adapters)

    async def _sync_adapters(self, wanted: tuple[AdapterSpec, ...]) -> None:
        wanted_by_name = {adapter.name: adapter.path for adapter in wanted}
        for name in [n for n in self.loaded_adapters if n not in wanted_by_name]:
            if await self._post_adapter("/v1/unload_lora_adapter", {"lora_name": name}):
                del self.loaded_adapters[name]
        for name, path in wanted_by_name.items():
            if self.loaded_adapters.get(name) == path:
                continue
            body = {"lora_name": name, "lora_path": engine_path(path)}
            if await self._post_adapter("/v1/load_lora_adapter", body):
                self.loaded_adapters[name] = path

    def _engine_headers(self) -> dict[str, str]:
        key = self.spec.api_key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    async def _post_adapter(self, path: str, body: dict[str, str]) -> bool:
        try:
            async with self._http.post(
                f"{self.base_url}{path}",
                json=body,
                headers=self._engine_headers(),
                timeout=aiohttp.ClientTimeout(total=self._timings.http_timeout_s),
            ) as response:
                text = await response.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.last_error = f"{path} {body.get('lora_name')}: {exc}"
            return False
        # A replica that kept an adapter across our restart answers 400 "already loaded".
        if response.status == 200 or "already" in text.lower():
            return True
        self.last_error = f"{path} {body.get('lora_name')}: HTTP {response.status} {text[:500]}"
        return False

    # -- telemetry --------------------------------------------------------------------------

    async def scrape(self, timeout_s: float) -> None:
        if self.state not in LIVE_STATES:
            return
        try:
            async with self._http.get(
                f"{self.base_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                if response.status != 200:
                    return
                text = await response.text()
        except (TimeoutError, aiohttp.ClientError):
            return
        try:
            self.telemetry = parse_vllm_metrics(text, scraped_at=time.time())
        except ValueError as exc:
            log.warning("replica %s: unreadable /metrics: %s", self.replica_id, exc)

    def gpu_load(self) -> GpuLoad:
        live = self.state in LIVE_STATES
        running = (self.telemetry or {}).get("num_requests_running", 0) if live else 0
        return GpuLoad(
            gpu_indices=self.spec.gpu_indices,
            # vLLM takes its whole gpu_memory_utilization share at start-up, busy or not.
            memory_fraction=self.spec.gpu_memory_utilization if live else 0.0,
            # Decode batches fill the SMs quickly and then saturate.
            busy_fraction=1.0 - math.exp(-running / 8.0),
        )

    # -- stopping ---------------------------------------------------------------------------

    def drain_and_stop(self) -> asyncio.Task[None]:
        """Idempotent: stop taking new work, let in-flight requests finish, then stop."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._drain_then_stop())
        return self._stopping

    async def _drain_then_stop(self) -> None:
        if self.state == READY:
            self.state = DRAINING
            deadline = time.monotonic() + self._timings.drain_timeout_s
            idle_since: float | None = None
            while time.monotonic() < deadline and self._process is not None:
                await self.scrape(timeout_s=self._timings.http_timeout_s)
                telemetry = self.telemetry or {}
                busy = telemetry.get("num_requests_running", 0) + telemetry.get(
                    "num_requests_waiting", 0
                )
                if self.telemetry is None or busy:
                    idle_since = None
                else:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since >= self._timings.drain_quiet_s:
                        break
                await asyncio.sleep(0.5)
        await self.stop()

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period; returns once the loop has ended."""
        self._wanted = False
        self._stop_requested.set()
        process = self._process
        if process is not None and process.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=self._timings.stop_grace_s)
            except TimeoutError:
                self._signal(signal.SIGKILL)
        if self._task is not None:
            await self._task
        elif self.state != STOPPED:
            # Never launched (refused before start): nothing to signal, only to report.
            self._mark_stopped()

    def _signal(self, signum: signal.Signals) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)

    # -- reporting --------------------------------------------------------------------------

    def output_tail(self) -> str:
        return "\n".join(self._output)

    def to_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "deployment_id": self.spec.deployment_id,
            "served_model_name": self.spec.served_model_name,
            "gpu_indices": list(self.spec.gpu_indices),
            "state": self.state,
            "pid": self.pid,
            "port": self.spec.port,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "adapters": sorted(self.loaded_adapters),
            "telemetry": self.telemetry,
        }


def pick_free_port(taken: set[int]) -> int:
    """A port nothing listens on now. The engine binds it a moment later; a rare clash shows
    up as a crash and the restart picks up the same port once the other side lets go."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port = int(probe.getsockname()[1])
        if port not in taken:
            return port


_PR_SET_PDEATHSIG = 1
_libc: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)


def _prepare_child(cores: list[int] | None) -> None:
    # Runs in the child before exec. If the agent is killed outright (no chance to stop its
    # replicas), the engine dies too instead of holding GPUs nobody supervises. On a CPU node
    # the engine and every process it starts stay on its slot's cores.
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if cores:
        os.sched_setaffinity(0, cores)
