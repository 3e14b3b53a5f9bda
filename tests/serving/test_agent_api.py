"""The agent's registration, credentials and its authenticated replica API."""

from __future__ import annotations

import asyncio
import stat
import time
from pathlib import Path

import aiohttp

from serving.agent.agent import NodeAgent
from tests.serving.agent_fakes import FakeControlPlane, eventually, running_agent, simulated_spec


async def _registered(control_plane: FakeControlPlane, agent: NodeAgent) -> None:
    await eventually(lambda: control_plane.heartbeats and agent.node_token, what="registration")


async def test_putting_replicas_without_the_node_token_is_refused(tmp_path: Path) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)
            async with (
                aiohttp.ClientSession() as http,
                http.put(
                    f"{agent.agent_url}/v1/replicas", json={"replicas": [simulated_spec()]}
                ) as response,
            ):
                status = response.status
            replicas = dict(agent.replicas)
    finally:
        await control_plane.stop()

    assert status == 401
    assert replicas == {}


async def test_putting_replicas_with_another_nodes_token_is_refused(tmp_path: Path) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)
            async with (
                aiohttp.ClientSession() as http,
                http.get(
                    f"{agent.agent_url}/v1/replicas",
                    headers={"Authorization": "Bearer node-token-999"},
                ) as response,
            ):
                status = response.status
    finally:
        await control_plane.stop()

    assert status == 401


async def test_putting_the_same_desired_set_twice_launches_the_replica_once(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    control_plane.desired = None  # the push path alone decides here
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)
            headers = {"Authorization": f"Bearer {agent.node_token}"}
            body = {"replicas": [simulated_spec("r-7")]}
            async with aiohttp.ClientSession(headers=headers) as http:
                for _ in range(2):
                    async with http.put(f"{agent.agent_url}/v1/replicas", json=body) as response:
                        assert response.status == 200
                await eventually(
                    lambda: "ready" in [e["kind"] for e in control_plane.events("r-7")],
                    what="the ready event delivered",
                )
                async with http.get(f"{agent.agent_url}/v1/replicas") as response:
                    listed = (await response.json())["replicas"]
    finally:
        await control_plane.stop()

    assert [(r["replica_id"], r["state"]) for r in listed] == [("r-7", "Ready")]
    # Launched once; the stop is the agent's last beat as the test ended.
    assert [e["kind"] for e in control_plane.events("r-7")] == ["started", "ready", "stopped"]


async def test_a_spec_the_agent_cannot_launch_is_a_400_that_says_why(tmp_path: Path) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)
            headers = {"Authorization": f"Bearer {agent.node_token}"}
            body = {"replicas": [simulated_spec(kv_cache_dtype="int2")]}
            async with (
                aiohttp.ClientSession(headers=headers) as http,
                http.put(f"{agent.agent_url}/v1/replicas", json=body) as response,
            ):
                status, detail = response.status, (await response.json())["detail"]
    finally:
        await control_plane.stop()

    assert status == 400
    assert "kv_cache_dtype" in detail


async def test_a_restarted_agent_is_the_same_node_without_registering_again(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)
        beats = len(control_plane.heartbeats)
        async with running_agent(control_plane.url, tmp_path) as agent:
            await eventually(lambda: len(control_plane.heartbeats) > beats, what="a heartbeat")
            node_id = agent.credentials.node_id if agent.credentials else None
    finally:
        await control_plane.stop()

    assert len(control_plane.registrations) == 1
    assert node_id == "node-1"
    assert stat.S_IMODE((tmp_path / "node.json").stat().st_mode) == 0o600


async def test_a_node_token_the_control_plane_forgot_leads_to_a_new_registration(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)

            control_plane.valid_tokens.clear()

            await eventually(lambda: agent.node_token == "node-token-2", what="re-registration")
    finally:
        await control_plane.stop()

    assert len(control_plane.registrations) == 2
    # The first registration had no token to show; the second proves it is the same node.
    assert "node_token" not in control_plane.registrations[0]
    assert control_plane.registrations[1]["node_token"] == "node-token-1"


async def test_the_agent_keeps_trying_to_register_until_the_control_plane_answers(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    await control_plane.start()
    await control_plane.stop()  # keeps its port, answers nothing
    async with running_agent(control_plane.url, tmp_path) as agent:
        await asyncio.sleep(0.5)  # long enough for a few refused attempts
        unregistered = agent.node_token is None
        await control_plane.start()
        await _registered(control_plane, agent)
        await control_plane.stop()

    assert unregistered
    registration = control_plane.registrations[0]
    assert registration["hostname"] == "test-node"
    assert registration["agent_url"] == agent.agent_url
    assert [gpu["name"] for gpu in registration["gpus"]] == ["L4-24GB", "L4-24GB"]


async def test_a_replica_on_a_gpu_the_node_lacks_fails_and_can_still_be_removed(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    control_plane.desired = [simulated_spec("r-9", gpu_indices=[5])]
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await eventually(
                lambda: (control_plane.latest_replica("r-9") or {}).get("state") == "Failed",
                what="the refusal reported",
            )
            last_error = agent.replicas["r-9"].last_error

            control_plane.desired = []

            await eventually(lambda: "r-9" not in agent.replicas, what="the replica forgotten")
    finally:
        await control_plane.stop()

    assert last_error == "this node has no GPU [5]"
    assert [e["kind"] for e in control_plane.events("r-9")] == ["failed", "stopped"]


async def test_one_unrunnable_spec_in_a_heartbeat_answer_does_not_block_the_others(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    control_plane.desired = [
        simulated_spec("r-bad", quantization="int3"),
        {**simulated_spec(), "replica_id": 42},
    ]
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await eventually(lambda: "42" in agent.replicas, what="the good replica launched")
            ids = set(agent.replicas)
    finally:
        await control_plane.stop()

    assert ids == {"42"}


async def _launch_until_ready(
    control_plane: FakeControlPlane, agent: NodeAgent, replica_id: str
) -> None:
    headers = {"Authorization": f"Bearer {agent.node_token}"}
    body = {"replicas": [simulated_spec(replica_id)]}
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.put(f"{agent.agent_url}/v1/replicas", json=body) as response,
    ):
        assert response.status == 200
    await eventually(
        lambda: "ready" in [e["kind"] for e in control_plane.events(replica_id)],
        what="the ready event delivered",
    )


async def test_a_replica_stopped_while_the_control_plane_is_down_is_reported_after_a_restart(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    control_plane.desired = None
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)
            await _launch_until_ready(control_plane, agent, "r-9")
            await control_plane.stop()  # down first, as when the whole platform stops
        stopped_at = time.time()
        assert (tmp_path / "undelivered-events.json").exists()
        await control_plane.start()
        async with running_agent(control_plane.url, tmp_path):
            await eventually(
                lambda: "stopped" in [e["kind"] for e in control_plane.events("r-9")],
                what="the stop delivered after the restart",
            )
    finally:
        await control_plane.stop()

    [stop] = [e for e in control_plane.events("r-9") if e["kind"] == "stopped"]
    assert stop["at"] <= stopped_at, "the event keeps the time the replica stopped"
    assert not (tmp_path / "undelivered-events.json").exists()


async def test_a_stopping_agent_reports_its_replicas_stopped_before_it_exits(
    tmp_path: Path,
) -> None:
    control_plane = FakeControlPlane()
    control_plane.desired = None
    await control_plane.start()
    try:
        async with running_agent(control_plane.url, tmp_path) as agent:
            await _registered(control_plane, agent)
            await _launch_until_ready(control_plane, agent, "r-5")
        # Stopped: the last beat already carried the stop, and the replica's final state.
        assert "stopped" in [e["kind"] for e in control_plane.events("r-5")]
        assert (control_plane.latest_replica("r-5") or {}).get("state") == "Stopped"
    finally:
        await control_plane.stop()
    assert not (tmp_path / "undelivered-events.json").exists()
