"""A CPU node: its cores in slots (one kept back for the node), memory and utilization from
/proc, and engines that listen on the node's address only."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from serving.agent.__main__ import build_parser, engine_host
from serving.agent.gpus import CpuSlots

STAT = """cpu  400 0 200 1000 0 0 0 0 0 0
cpu0 100 0 50 250 0 0 0 0 0 0
cpu1 100 0 50 250 0 0 0 0 0 0
cpu2 100 0 50 250 0 0 0 0 0 0
cpu3 100 0 50 250 0 0 0 0 0 0
intr 1
"""


@pytest.fixture
def proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "stat").write_text(STAT)
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    (tmp_path / "cpuinfo").write_text("processor : 0\nmodel name : Test Xeon 8488C\n")
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})
    return tmp_path


def test_the_cores_are_split_into_slots_after_one_is_kept_for_the_node(proc: Path) -> None:
    node = CpuSlots(2, "n", proc=proc)

    assert node.slots == ((0, 1), (2, 3))
    devices = node.inventory()
    assert [d.index for d in devices] == [0, 1]
    assert {d.name for d in devices} == {"Test Xeon 8488C"}
    assert {d.memory_mb for d in devices} == {8192}  # half the node's 16 GiB each
    assert len({d.uuid for d in devices}) == 2
    assert [d.uuid for d in CpuSlots(2, "n", proc=proc).inventory()] == [d.uuid for d in devices]


def test_more_slots_than_free_cores_are_refused(proc: Path) -> None:
    with pytest.raises(ValueError, match="between 1 and 4"):
        CpuSlots(5, "n", proc=proc)
    assert CpuSlots(5, "n", reserved=0, proc=proc).slots[-1] == (4,)


def test_slot_utilization_is_measured_between_samples(proc: Path) -> None:
    node = CpuSlots(2, "n", proc=proc)
    node.sample([])
    # Cores 0 and 1 fully busy since, cores 2 and 3 idle.
    (proc / "stat").write_text(
        STAT.replace("cpu0 100 0 50 250", "cpu0 200 0 50 250")
        .replace("cpu1 100 0 50 250", "cpu1 200 0 50 250")
        .replace("cpu2 100 0 50 250", "cpu2 100 0 50 350")
        .replace("cpu3 100 0 50 250", "cpu3 100 0 50 350")
    )

    first, second = node.sample([])

    assert (first.utilization_pct, second.utilization_pct) == (100, 0)
    assert first.memory_used_mb == 4096  # the node's 8 GiB in use, shared by two slots


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--control-plane", "http://cp", "--token", "t", *argv])


def test_engines_listen_on_the_nodes_own_address() -> None:
    assert engine_host(_args(), "127.0.0.1") == "127.0.0.1"
    assert engine_host(_args("--advertise-url", "http://10.1.2.3:9000"), "0.0.0.0") == "10.1.2.3"
    assert engine_host(_args("--engine-host", "10.9.9.9"), "0.0.0.0") == "10.9.9.9"


def test_an_agent_that_would_bind_engines_to_every_interface_refuses_to_start() -> None:
    with pytest.raises(SystemExit, match="not on all interfaces"):
        engine_host(_args(), "0.0.0.0")
