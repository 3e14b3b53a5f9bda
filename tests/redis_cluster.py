"""A local Redis Cluster of three masters on loopback ports, for the tests that must hold on
Cluster too. Debian's redis-server and redis-cli; each node's files live in a temporary
directory that goes with it. No Django here: spawned test processes import it too."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.cluster import RedisCluster

# The cluster bus listens on port + 10000, which must be a port too.
_LOWEST_PORT, _HIGHEST_PORT = 20_000, 45_000


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(_LOWEST_PORT, _HIGHEST_PORT)
        if port not in ports and _free(port) and _free(port + 10_000):
            ports.append(port)
    return ports


class LocalRedisCluster:
    """`with LocalRedisCluster() as cluster:` three masters, every slot assigned, state ok."""

    def __init__(self, masters: int = 3, start_timeout_s: float = 30.0) -> None:
        self.masters = masters
        self.start_timeout_s = start_timeout_s
        self.ports: list[int] = []
        self._directory: Path | None = None
        self._servers: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """One node's URL: a cluster client finds the others from it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self) -> RedisCluster:
        return RedisCluster.from_url(self.url, socket_timeout=5)

    def __enter__(self) -> LocalRedisCluster:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server and redis-cli are needed for a local Redis Cluster")
        self._directory = Path(tempfile.mkdtemp(prefix="redis-cluster-"))
        self.ports = _free_ports(self.masters)
        try:
            for port in self.ports:
                self._servers.append(self._start_node(port))
            for port in self.ports:
                self._wait_for_ping(port)
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{port}" for port in self.ports),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=self.start_timeout_s,
            )
            self._wait_for_state_ok()
        except BaseException:
            self.stop()
            raise

    def _start_node(self, port: int) -> subprocess.Popen[bytes]:
        assert self._directory is not None
        node_dir = self._directory / str(port)
        node_dir.mkdir()
        log = (node_dir / "redis.log").open("wb")
        return subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                "--dir",
                str(node_dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _wait_for_ping(self, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        node = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        try:
            while True:
                try:
                    node.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            node.close()

    def _wait_for_state_ok(self) -> None:
        """Every node must agree that all slots are served, not only the first one."""
        deadline = time.monotonic() + self.start_timeout_s
        for port in self.ports:
            node = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
            try:
                while node.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"Redis Cluster node {port} never reached state ok")
                    time.sleep(0.1)
            finally:
                node.close()

    def flush(self) -> None:
        """Empty every master (FLUSHALL on a cluster client only reaches the primaries)."""
        for port in self.ports:
            node = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
            try:
                node.flushall()
            finally:
                node.close()

    def stop(self) -> None:
        for server in self._servers:
            server.terminate()
        for server in self._servers:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self._servers.clear()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
