"""`make run`: the whole platform on one machine, with a demo fleet.

Starts embedded PostgreSQL and Redis (unless DATABASE_URL / REDIS_URL are set), migrates,
loads the demo data, then runs the ASGI server, a Celery worker, Celery beat and the demo
fleet's node agents as child processes with prefixed logs. A child that exits while the
platform runs is started again, after 1 s, doubling to 30 s while it keeps exiting. SIGINT or
SIGTERM stops them all.
With PLATFORM_DEMO_ENGINE=vllm it first builds the tiny model (scripts/build_tiny_model.py,
in the vLLM virtual environment `make` set up), which the demo's CPU node serves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

from services import (
    ROOT,
    EmbeddedPostgres,
    EmbeddedRedis,
    StartupError,
    ensure_database,
    require_free_port,
    var_dir,
    venv_bin,
)

STOP_GRACE_S = 10.0
# A child that exits is started again after a delay that doubles from the first to the last,
# and starts over at the first once the child had been up for RESTART_RESET_AFTER_S.
RESTART_DELAYS_S = (1, 30)
RESTART_RESET_AFTER_S = 60.0
# Stopped before the other applications: the web server finishes the requests it holds while
# the engines behind them still run (the node agents stop theirs when they stop).
STOPPED_FIRST = ("traffic", "web")
# The model the README's snippet calls: the banner waits until it answers.
DEMO_MODEL = "llama-3.1-8b"
WS_MAX_SIZE_BYTES = 4 * 1024 * 1024 + 64 * 1024
# uvicorn's caps (platform/kubernetes/gateway.yaml sets the same): an idle keep-alive
# connection closes after 5 s; past 1000 connections or tasks uvicorn answers 503; h11 (when
# uvicorn runs it instead of httptools) buffers at most 64 KiB of an unfinished request head;
# a WebSocket that stops answering pings is closed within 40 s. The body deadline and the
# per-client cap are the app's own (config/middleware.py).
UVICORN_LIMITS = [
    "--timeout-keep-alive=5",
    "--limit-concurrency=1000",
    "--h11-max-incomplete-event-size=65536",
    "--ws-ping-interval=20",
    "--ws-ping-timeout=20",
]
# Statement timeouts by process kind (config/settings.py's DATABASE_STATEMENT_TIMEOUT_MS is the
# web default): rollups and invoices may run minutes, a migration as long as it takes.
STATEMENT_TIMEOUT_MS = {"realtime": "30000", "batch": "600000"}
COLORS = ["36", "32", "35", "33", "34", "31", "96", "92", "95", "93"]


Launch = Callable[[], subprocess.Popen[bytes]]


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    launch: Launch  # starts it again
    is_data_service: bool = False
    started_at: float = field(default_factory=time.monotonic)
    next_delay_s: float = RESTART_DELAYS_S[0]
    restart_at: float | None = None  # set while it waits to be started again


class Supervisor:
    """Owns every child process; relays their output with a name prefix; restarts one that
    exits; stops them all.

    Restarts happen on a thread of their own, under `_lock`: the signal handler's
    KeyboardInterrupt lands only on the main thread, so it can never fall between a restart's
    fork and the record of its process, and `stop_all` takes the lock before it stops anything,
    so nothing is started once the stop has begun."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self._print_lock = threading.Lock()
        self._lock = threading.Lock()

    def say(self, name: str, line: str) -> None:
        color = COLORS[hash(name) % len(COLORS)]
        with self._print_lock:
            sys.stdout.write(f"\033[{color}m{name:>10} |\033[0m {line}\n")
            sys.stdout.flush()

    def adopt(
        self,
        name: str,
        process: subprocess.Popen[bytes],
        launch: Launch,
        *,
        is_data_service: bool = False,
    ) -> None:
        self.children.append(Child(name, process, launch, is_data_service))
        self._relay_output(name, process)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        def launch() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a stop reaches its workers
            )

        process = launch()
        self.adopt(name, process, launch)
        return process

    def _relay_output(self, name: str, process: subprocess.Popen[bytes]) -> None:
        if process.stdout is not None:
            threading.Thread(target=self._relay, args=(name, process), daemon=True).start()

    def _relay(self, name: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            self.say(name, raw.decode(errors="replace").rstrip())

    def first_exited(self) -> Child | None:
        return next((child for child in self.children if child.process.poll() is not None), None)

    def keep_alive(self) -> NoReturn:
        """Restart children as they exit, until a signal interrupts the main thread."""
        threading.Thread(target=self._restart_exited, daemon=True).start()
        while True:
            time.sleep(1)

    def _restart_exited(self) -> None:
        while not self.stopping.wait(0.5):
            with self._lock:
                if self.stopping.is_set():
                    return
                for child in self.children:
                    self._tend(child, time.monotonic())

    def _tend(self, child: Child, now: float) -> None:
        if child.restart_at is None:
            code = child.process.poll()
            if code is None:
                return
            # What it forked (Celery's pool) would hold its queue and its port: gone with it.
            self._signal(child, signal.SIGKILL)
            if now - child.started_at >= RESTART_RESET_AFTER_S:
                child.next_delay_s = RESTART_DELAYS_S[0]
            self._restart_later(child, now, f"{child.name} exited with code {code}; restarting")
        elif now >= child.restart_at:
            try:
                process = child.launch()
            except (OSError, subprocess.SubprocessError) as error:
                self._restart_later(child, now, f"{child.name} did not start ({error}); retrying")
                return
            child.process, child.started_at, child.restart_at = process, now, None
            self._relay_output(child.name, process)

    def _restart_later(self, child: Child, now: float, reason: str) -> None:
        child.restart_at = now + child.next_delay_s
        self.say("run", f"{reason} in {child.next_delay_s:.0f} s")
        child.next_delay_s = min(child.next_delay_s * 2, RESTART_DELAYS_S[1])

    def stop_all(self) -> None:
        self.stopping.set()
        with self._lock:  # a restart in progress finishes first, and none starts after
            self._stop_children()

    def _stop_children(self) -> None:
        # The data services last so they can shut down cleanly.
        first = [child for child in self.children if child.name in STOPPED_FIRST]
        services = [child for child in self.children if child.is_data_service]
        applications = [child for child in self.children if child not in first + services]
        for group in (first, applications, services):
            for child in reversed(group):
                # To the main process alone, as a process manager does: Celery's warm shutdown
                # lets its pool finish the task in hand (an ingest drain commits, then acks).
                child.process.send_signal(
                    signal.SIGTERM if child.name != "postgres" else signal.SIGINT
                )
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    child.process.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    self._signal(child, signal.SIGKILL)
                    child.process.wait()
            for child in group:
                # Whatever the child forked (Celery's pool) shares its process group.
                self._signal(child, signal.SIGKILL)

    @staticmethod
    def _signal(child: Child, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signum)


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


def poll_until(
    probe: Callable[[], bool], supervisor: Supervisor, timeout_s: float, every_s: float
) -> bool:
    """Until `probe()` is true (False on a timeout); a child that exits is a StartupError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = supervisor.first_exited()
        if exited is not None:
            raise StartupError(f"{exited.name} exited with code {exited.process.returncode}")
        if probe():
            return True
        time.sleep(every_s)
    return False


def answers_200(request: urllib.request.Request | str, timeout_s: float) -> bool:
    try:
        # The platform's own http://127.0.0.1 addresses, never a caller's URL.
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # nosec B310
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False  # HTTPError too: 404 until a replica is routed, 503 while it warms


def wait_ready(url: str, supervisor: Supervisor, timeout_s: float = 120) -> None:
    if not poll_until(lambda: answers_200(url, 2), supervisor, timeout_s, 0.3):
        raise StartupError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def wait_serving(
    base_url: str, api_key: str, model: str, supervisor: Supervisor, timeout_s: float = 180
) -> bool:
    """Until `model` answers a one-token chat completion through the gateway: the banner's
    snippet works the moment it is printed. False (and the caller says so) on a timeout."""
    body = json.dumps(
        {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]}
    ).encode()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"{base_url}/chat/completions", body, headers)
    return poll_until(lambda: answers_200(request, 10), supervisor, timeout_s, 1.0)


def main() -> int:
    host = os.environ.get("HOST", "127.0.0.1")
    port = int(os.environ.get("PORT", "8000"))
    require_free_port(port, "the web server", "PORT")
    var = var_dir()
    var.mkdir(parents=True, exist_ok=True)

    supervisor = Supervisor()

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    env = dict(os.environ)
    env.setdefault("DEBUG", "true")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PLATFORM_PUBLIC_URL", f"http://{host}:{port}")
    # The demo's simulated replicas end answers at EOS as a model does: a request without
    # max_tokens gets the key's cap as its limit, which the simulator would otherwise fill.
    env.setdefault("SERVING_SIM_STOP_AT_EOS", "true")
    try:
        if not env.get("DATABASE_URL"):
            postgres = EmbeddedPostgres(var / "postgres", int(env.get("PLATFORM_PG_PORT", "54329")))
            supervisor.adopt("postgres", postgres.start(), postgres.launch, is_data_service=True)
            env["DATABASE_URL"] = postgres.url
        if not env.get("REDIS_URL"):
            redis = EmbeddedRedis(var / "redis", int(env.get("PLATFORM_REDIS_PORT", "63799")))
            supervisor.adopt("redis", redis.start(), redis.launch, is_data_service=True)
            env["REDIS_URL"] = redis.url
        ensure_database(env["DATABASE_URL"])
        if env.get("PLATFORM_DEMO_ENGINE") == "vllm":
            build_tiny_model(env, var)
        manage({**env, "DATABASE_STATEMENT_TIMEOUT_MS": "0"}, "migrate", "--noinput", "-v", "0")
        manage(env, "seed_demo")
        supervisor.spawn(
            "web",
            [
                venv_bin("uvicorn"),
                "config.asgi:application",
                "--host",
                host,
                "--port",
                str(port),
                "--no-access-log",
                "--lifespan",
                "off",
                # A WebSocket message is at most the gateway's body limit (4 MiB) plus framing;
                # uvicorn's own default would buffer 16 MiB before the gateway sees it.
                "--ws-max-size",
                str(WS_MAX_SIZE_BYTES),
                *UVICORN_LIMITS,
            ],
            env,
        )
        # One worker per queue (CELERY_TASK_ROUTES): a long invoice run never delays an ingest.
        for name, queue, concurrency in (("worker", "realtime", 2), ("worker-batch", "batch", 1)):
            worker_env = {**env}
            worker_env.setdefault("DATABASE_STATEMENT_TIMEOUT_MS", STATEMENT_TIMEOUT_MS[queue])
            supervisor.spawn(
                name,
                [
                    venv_bin("celery"),
                    "-A",
                    "config",
                    "worker",
                    "-l",
                    "WARNING",
                    "--queues",
                    queue,
                    "--concurrency",
                    str(concurrency),
                    "-n",
                    f"{queue}@%h",
                ],
                worker_env,
            )
        supervisor.spawn(
            "beat",
            [
                venv_bin("celery"),
                "-A",
                "config",
                "beat",
                "-l",
                "WARNING",
                "-s",
                str(var / "celerybeat-schedule"),
            ],
            env,
        )
        for name, argv in demo_fleet_commands(env):
            supervisor.spawn(name, argv, env)
        wait_ready(f"http://{host}:{port}/readyz", supervisor)
        key = demo_key()
        if key and not wait_serving(f"http://{host}:{port}/v1", key, DEMO_MODEL, supervisor):
            print(f"warning: {DEMO_MODEL} is not answering yet; see the console's fleet page")
        start_demo_traffic(supervisor, env, host, port)
        print_banner(env, host, port)
        supervisor.keep_alive()
    except KeyboardInterrupt:
        print("\nStopping every process...", flush=True)
        return 0
    except StartupError as error:
        print(error.code, file=sys.stderr, flush=True)
        return 2
    except subprocess.CalledProcessError as error:
        print(
            f"error: {' '.join(map(str, error.cmd))} failed ({error.returncode})", file=sys.stderr
        )
        return 2
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        supervisor.stop_all()


def build_tiny_model(env: dict[str, str], var: Path) -> None:
    """The demo CPU node's model, built offline (seconds; nothing when it is up to date)."""
    python = env.get("VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        raise StartupError(
            f"PLATFORM_DEMO_ENGINE=vllm needs vLLM's CPU build at {python}: run it through "
            "`make run`, which installs it (requirements-cpu-node.txt), or set VLLM_PYTHON"
        )
    subprocess.run(
        [python, "scripts/build_tiny_model.py", str(var / "models" / "tiny-llama")],
        cwd=ROOT,
        env=env,
        check=True,
    )


def demo_fleet_commands(env: dict[str, str]) -> list[tuple[str, list[str]]]:
    """The node agents of the demo fleet, as `manage.py demo_fleet --commands` lists them."""
    if env.get("PLATFORM_DEMO_FLEET", "1") in {"0", "false", "no"}:
        return []
    result = subprocess.run(
        [sys.executable, "manage.py", "demo_fleet", "--commands"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        if "Unknown command" in result.stderr:
            return []
        raise StartupError(f"could not list the demo fleet: {result.stderr.strip()}")
    return [(item["name"], item["argv"]) for item in json.loads(result.stdout or "[]")]


def demo_key() -> str | None:
    """The demo tenant's API key, as seed_demo wrote it to var/demo.json."""
    demo = var_dir() / "demo.json"
    key = json.loads(demo.read_text()).get("acme_api_key") if demo.exists() else None
    return str(key) if key else None


def start_demo_traffic(supervisor: Supervisor, env: dict[str, str], host: str, port: int) -> None:
    """A trickle of requests with the demo key, so the console's live numbers move."""
    rate = env.get("PLATFORM_DEMO_TRAFFIC", "0.5")
    if rate in {"0", "false", "no"}:
        return
    key = demo_key()
    if not key:
        return
    supervisor.spawn(
        "traffic",
        [
            sys.executable,
            "scripts/demo_traffic.py",
            "--base-url",
            f"http://{host}:{port}/v1",
            "--api-key",
            key,
            "--rate",
            rate,
        ],
        env,
    )


def print_banner(env: dict[str, str], host: str, port: int) -> None:
    demo = Path(var_dir() / "demo.json")
    details = json.loads(demo.read_text()) if demo.exists() else {}
    lines = [
        "",
        "The platform is up.",
        f"  Console:        http://{host}:{port}/",
        f"  Admin login:    {details.get('admin_username', 'admin')} / {details.get('admin_password', '?')}",
    ]
    for label, value in details.get("extra", {}).items():
        lines.append(f"  {label + ':':<15} {value}")
    lines += [
        f"  OpenAI base URL: http://{host}:{port}/v1",
        f"  API schema:     http://{host}:{port}/api/v1/docs/",
        "Press Ctrl-C to stop.",
        "",
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
