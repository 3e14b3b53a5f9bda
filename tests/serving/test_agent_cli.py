"""`python -m serving.agent` as an operator runs it: a real process against a control plane."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.serving.agent_fakes import FakeControlPlane, eventually, simulated_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


async def test_the_agent_process_serves_replicas_and_stops_them_on_sigterm(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    control_plane.desired = [simulated_spec("r-1", sim=None)]
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "serving.agent",
        "--control-plane",
        control_plane.url,
        "--token",
        "join-secret",
        "--simulate-gpus",
        "L4-24GB:2",
        "--sim-time-scale",
        "50",
        "--state-dir",
        str(tmp_path),
        "--log-level",
        "WARNING",
        cwd=ROOT,
    )
    try:
        ready = await eventually(
            lambda: (
                (control_plane.latest_replica("r-1") or {}).get("state") == "Ready"
                and control_plane.latest_replica("r-1")
            ),
            what="a Ready replica",
        )
        agent.send_signal(signal.SIGTERM)
        exit_code = await asyncio.wait_for(agent.wait(), timeout=20)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await control_plane.stop()

    registration = control_plane.registrations[0]
    assert exit_code == 0
    assert [gpu["name"] for gpu in registration["gpus"]] == ["L4-24GB", "L4-24GB"]
    assert control_plane.heartbeats[-1]["gpus"][0]["memory_total_mb"] == 24 * 1024
    with pytest.raises(ProcessLookupError):
        os.kill(ready["pid"], 0)
