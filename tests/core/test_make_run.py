"""`make run` end to end: embedded services, the whole platform, a clean stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_environment(tmp_path: Path, web_port: int) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG"}
    }
    env.update(
        PORT=str(web_port),
        PLATFORM_VAR_DIR=str(tmp_path / "var"),
        PLATFORM_PG_PORT=str(free_port()),
        PLATFORM_REDIS_PORT=str(free_port()),
        SECURE_SSL_REDIRECT="false",
    )
    return env


def wait_for_readyz(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "make run exited early"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
                return int(reply.status)
        except OSError:
            time.sleep(0.5)
    raise AssertionError("readyz never answered")


def wait_for_line(
    lines: list[str], text: str, process: subprocess.Popen[bytes], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(text in line for line in lines):
            return
        assert process.poll() is None, "make run exited early"
        time.sleep(0.3)
    raise AssertionError(f"{text!r} never printed")


def chat_status(port: int, key: str) -> int:
    body = json.dumps(
        {"model": "llama-3.1-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        body,
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


@pytest.mark.slow
def test_make_run_answers_readyz_and_sigterm_leaves_no_child_behind(tmp_path: Path) -> None:
    web_port = free_port()
    process = subprocess.Popen(
        [sys.executable, "scripts/run.py"],
        cwd=ROOT,
        env=run_environment(tmp_path, web_port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: list[str] = []
    assert process.stdout is not None
    stdout = process.stdout
    reader = threading.Thread(
        target=lambda: lines.extend(line.decode(errors="replace") for line in stdout), daemon=True
    )
    reader.start()
    try:
        assert wait_for_readyz(web_port, process, timeout_s=180) == 200
        # The banner's promise: the README's snippet works the moment it is printed.
        wait_for_line(lines, "The platform is up.", process, timeout_s=240)
        key = json.loads((tmp_path / "var" / "demo.json").read_text())["acme_api_key"]
        assert chat_status(web_port, key) == 200
        descendants = psutil.Process(process.pid).children(recursive=True)
        names = " ".join(command_line(child) for child in descendants)
        assert "postgres" in names and "redis-server" in names
        assert "uvicorn" in names and "worker" in names and "beat" in names

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert alive == [], f"left behind: {[p.pid for p in alive]}"
    finally:
        if process.poll() is None:
            # A failed test must not leave the platform running under the rest of the suite.
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            process.kill()
        reader.join(timeout=10)
        print("".join(lines)[-5000:])


def command_line(process: psutil.Process) -> str:
    """The process's command line; empty for one that exited since it was listed (a
    short-lived child of a worker)."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def test_make_run_says_clearly_when_the_web_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "scripts/run.py"],
            cwd=ROOT,
            env=run_environment(tmp_path, taken),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode != 0
    assert f"port {taken} is already in use" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
