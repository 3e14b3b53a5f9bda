"""The embedded Redis of `make run` keeps its data across a stop, even a SIGKILL: usage
waiting in the stream and the monthly counters are not lost when the platform restarts."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from services import EmbeddedRedis

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_what_redis_held_survives_a_sigkill_and_a_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", _free_port())
    process = server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.xadd("usage:events", {"e": b"one event"})
        client.incrby("budget:tenant:1:tokens", 1234)
        time.sleep(1.5)  # the append-only file is synced every second
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    again = EmbeddedRedis(tmp_path / "redis", server.port).start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.xlen("usage:events") == 1
        assert client.get("budget:tenant:1:tokens") == b"1234"
    finally:
        again.send_signal(signal.SIGINT)
        again.wait(timeout=10)


def test_data_kept_in_a_snapshot_from_before_the_append_only_file_is_kept(
    tmp_path: Path,
) -> None:
    data = tmp_path / "redis"
    server = EmbeddedRedis(data, _free_port())
    process = server.start()
    client = redis.Redis.from_url(server.url)
    client.set("budget:tenant:2:tokens", 99)
    client.config_set("appendonly", "no")  # as the embedded Redis ran before
    client.save()
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    for leftover in data.glob("appendonly*"):
        leftover.unlink()

    again = EmbeddedRedis(data, server.port).start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.get("budget:tenant:2:tokens") == b"99"
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        again.send_signal(signal.SIGINT)
        again.wait(timeout=10)
