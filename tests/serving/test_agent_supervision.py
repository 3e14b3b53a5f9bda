"""The agent against a real (tiny) control plane, running real engine-simulator processes."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from tests.serving.agent_fakes import FakeControlPlane, eventually, running_agent, simulated_spec

pytestmark = pytest.mark.slow


def _kinds(control_plane: FakeControlPlane, replica_id: str) -> list[str]:
    return [event["kind"] for event in control_plane.events(replica_id)]


def _is_ready(control_plane: FakeControlPlane, replica_id: str, restarts: int = 0) -> bool:
    replica = control_plane.latest_replica(replica_id)
    return bool(replica and replica["state"] == "Ready" and replica["restarts"] == restarts)


async def test_a_killed_replica_is_restarted_and_reported_as_crashed_then_restarted(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    control_plane.desired = [simulated_spec("r-1")]
    try:
        async with running_agent(control_plane.url, tmp_path):
            await eventually(lambda: _is_ready(control_plane, "r-1"), what="first Ready")
            first_pid = control_plane.latest_replica("r-1")["pid"]  # type: ignore[index]

            os.kill(first_pid, signal.SIGKILL)

            await eventually(lambda: _is_ready(control_plane, "r-1", restarts=1), what="restart")
            replica = control_plane.latest_replica("r-1")
    finally:
        await control_plane.stop()

    # The last, stopped, is the agent's goodbye as the test ends.
    kinds = ["started", "ready", "crashed", "restarted", "ready", "stopped"]
    assert _kinds(control_plane, "r-1") == kinds
    assert replica is not None and replica["pid"] != first_pid
    assert "signal 9" in replica["last_error"]


async def test_a_ready_replica_has_generated_a_token_and_reports_its_telemetry(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    control_plane.desired = [simulated_spec("r-1")]
    try:
        async with running_agent(control_plane.url, tmp_path):
            await eventually(
                lambda: (
                    _is_ready(control_plane, "r-1")
                    and (control_plane.latest_replica("r-1") or {}).get("telemetry")
                ),
                what="telemetry of a Ready replica",
            )
            replica = control_plane.latest_replica("r-1")
            gpus = control_plane.heartbeats[-1]["gpus"]
    finally:
        await control_plane.stop()

    assert replica is not None
    # The readiness probe's one-token completion is counted by the engine itself.
    assert replica["telemetry"]["request_success_total"].get("length", 0) >= 1
    assert replica["telemetry"]["generation_tokens_total"] >= 1
    assert gpus[0]["memory_used_mb"] == round(24 * 1024 * 0.9)
    assert gpus[1]["memory_used_mb"] == 0


async def test_events_queued_while_the_control_plane_is_down_arrive_when_it_returns(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    control_plane.desired = [simulated_spec("r-1")]
    async with running_agent(control_plane.url, tmp_path) as agent:
        await eventually(lambda: _is_ready(control_plane, "r-1"), what="first Ready")
        await control_plane.stop()
        replica = agent.replicas["r-1"]

        os.kill(replica.pid or 0, signal.SIGKILL)
        await eventually(
            lambda: replica.state == "Ready" and replica.restarts == 1, what="restart offline"
        )
        # Still serving with no control plane in sight.
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{replica.base_url}/v1/completions",
                json={"model": "llama-1b", "prompt": "hello", "max_tokens": 2},
            ) as response,
        ):
            served_offline = response.status
        beats_before_return = len(control_plane.heartbeats)

        await control_plane.start()
        await eventually(lambda: "restarted" in _kinds(control_plane, "r-1"), what="catch-up")
        await eventually(lambda: not agent.events.pending(), what="queue drained")
        await control_plane.stop()

    caught_up = control_plane.heartbeats[beats_before_return:]
    assert served_offline == 200
    assert [e["kind"] for beat in caught_up for e in beat["events"]][:3] == [
        "crashed",
        "restarted",
        "ready",
    ]
    assert caught_up[0]["replicas"][0]["restarts"] == 1


async def test_a_replica_no_longer_desired_is_drained_stopped_and_reported_once(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    control_plane.desired = [simulated_spec("r-1")]
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await eventually(lambda: _is_ready(control_plane, "r-1"), what="first Ready")
            pid = agent.replicas["r-1"].pid or 0

            control_plane.desired = []

            await eventually(lambda: "r-1" not in agent.replicas, what="replica forgotten")
    finally:
        await control_plane.stop()

    assert _kinds(control_plane, "r-1")[-1] == "stopped"
    assert control_plane.latest_replica("r-1")["state"] == "Stopped"  # type: ignore[index]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_an_engine_whose_health_is_200_but_cannot_generate_never_becomes_ready(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    wedged = simulated_spec("r-1", sim={"gpu_class": "L4-24GB", "extra_args": ["--sim-hang"]})
    control_plane.desired = [wedged]
    try:
        async with running_agent(control_plane.url, tmp_path, ready_timeout_s=2.0) as agent:
            replica = await eventually(lambda: agent.replicas.get("r-1"), what="the replica")
            async with aiohttp.ClientSession() as http:

                async def health() -> int:
                    try:
                        async with http.get(f"{replica.base_url}/health") as response:
                            return response.status
                    except aiohttp.ClientError:
                        return 0

                while await health() != 200:
                    await asyncio.sleep(0.05)
            state_when_healthy = replica.state
            await eventually(
                lambda: "failed" in _kinds(control_plane, "r-1"), what="the readiness failure"
            )
    finally:
        await control_plane.stop()

    assert state_when_healthy == "Starting"
    assert "ready" not in _kinds(control_plane, "r-1")


async def test_a_ready_replica_has_its_lora_adapters_loaded(tmp_path: Path) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    control_plane.desired = [
        simulated_spec(
            "r-1",
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
            adapters=[{"name": "sql", "path": "/adapters/sql"}],
        )
    ]
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await eventually(lambda: _is_ready(control_plane, "r-1"), what="Ready")
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"{agent.replicas['r-1'].base_url}/v1/models") as response,
            ):
                served = [model["id"] for model in (await response.json())["data"]]
    finally:
        await control_plane.stop()

    assert "sql" in served
    assert control_plane.latest_replica("r-1")["adapters"] == ["sql"]  # type: ignore[index]
