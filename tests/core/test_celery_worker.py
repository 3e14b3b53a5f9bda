"""A real Celery worker, against the real Redis broker, runs a task to completion."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings

from config.tasks import ping

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_real_worker_runs_a_task_sent_through_redis(redis_client: redis.Redis) -> None:
    queue = f"test-{uuid.uuid4().hex[:8]}"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-Q",
            queue,
            "--pool",
            "solo",
            "-l",
            "WARNING",
            "-n",
            f"{queue}@%h",
        ],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": settings.REDIS_URL},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        token = uuid.uuid4().hex
        ping.apply_async(args=[token], queue=queue)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and redis_client.get(f"platform:ping:{token}") is None:
            assert worker.poll() is None, worker.stdout.read().decode() if worker.stdout else ""
            time.sleep(0.2)
        assert redis_client.get(f"platform:ping:{token}") == b"pong"
    finally:
        worker.terminate()
        worker.wait(timeout=30)
