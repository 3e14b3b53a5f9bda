"""The agent's secrets stay with the agent: the join token is read once (file, environment or
flag) and leaves the environment, and no engine process it starts can read either token from
its own environment."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from serving.agent.__main__ import build_parser, join_token
from serving.agent.launch import engine_environment
from tests.serving.agent_fakes import FakeControlPlane, eventually, simulated_spec

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--control-plane", "http://cp", *argv])


def test_the_token_file_wins_and_the_variable_leaves_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "join-token"
    token_file.write_text("jt_from_file\n")
    environ = {"NODE_AGENT_JOIN_TOKEN": "jt_from_env", "PATH": "/bin"}

    token = join_token(_args("--token-file", str(token_file)), environ)

    assert (token, environ) == ("jt_from_file", {"PATH": "/bin"})


def test_the_token_comes_from_the_environment_when_no_file_or_flag_names_it() -> None:
    environ = {"NODE_AGENT_JOIN_TOKEN": "jt_from_env"}
    assert join_token(_args(), environ) == "jt_from_env"
    assert environ == {}


def test_an_agent_without_a_join_token_stops_with_a_message() -> None:
    with pytest.raises(SystemExit, match="a join token is needed"):
        join_token(_args(), {})


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "join-token").write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        join_token(_args("--token-file", str(tmp_path / "join-token")), {})


def test_an_engines_environment_keeps_the_nodes_settings_but_not_the_agents_secrets() -> None:
    agent_env = {
        "PATH": "/usr/bin",
        "HF_HOME": "/var/lib/hf",
        "NODE_AGENT_JOIN_TOKEN": "jt_secret",
        "NODE_AGENT_ARGS": "--cpu-slots 1",
        "SECRET_KEY": "k" * 50,
        "DATABASE_URL": "postgres://u:p@db/x",
    }
    env = engine_environment(agent_env, {"CUDA_VISIBLE_DEVICES": "0"})
    assert env == {"PATH": "/usr/bin", "HF_HOME": "/var/lib/hf", "CUDA_VISIBLE_DEVICES": "0"}


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode().partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


@pytest.mark.slow
async def test_an_engine_the_agent_launches_has_neither_token_in_its_environment(
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
        "--simulate-gpus",
        "L4-24GB:2",
        "--sim-time-scale",
        "50",
        "--state-dir",
        str(tmp_path),
        "--log-level",
        "WARNING",
        cwd=ROOT,
        # As systemd's EnvironmentFile and the DaemonSet's secretKeyRef pass it.
        env={**os.environ, "NODE_AGENT_JOIN_TOKEN": "join-secret"},
    )
    try:
        ready = await eventually(
            lambda: (
                (control_plane.latest_replica("r-1") or {}).get("state") == "Ready"
                and control_plane.latest_replica("r-1")
            ),
            what="a Ready replica",
        )
        engine_env = _environ_of(ready["pid"])
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(agent.wait(), timeout=20)
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()
            await control_plane.stop()

    node_token = "node-token-1"  # what the fake control plane issued
    assert control_plane.registrations[0]["join_token"] == "join-secret"
    assert node_token in control_plane.valid_tokens
    leaked = {
        name
        for name, value in engine_env.items()
        if "join-secret" in value or node_token in value or name.startswith("NODE_AGENT_")
    }
    assert not leaked, f"the engine's environment holds the agent's secrets in {leaked}"
    assert "PATH" in engine_env  # the node's own settings still reach the engine
