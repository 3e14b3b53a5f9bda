"""Simulated GPUs: stable identities per node, figures from gpus.csv, load from replicas."""

from __future__ import annotations

import pytest

from serving.agent.gpus import GpuLoad, SimulatedGpus, parse_simulated_gpus
from serving.agent.replica import Backoff
from serving.engine.specs import load_gpu_specs


def test_a_node_reports_the_same_gpu_uuids_after_a_restart() -> None:
    first = SimulatedGpus("L4-24GB", 4, "node-a").inventory()
    again = SimulatedGpus("L4-24GB", 4, "node-a").inventory()

    assert [g.uuid for g in first] == [g.uuid for g in again]
    assert len({g.uuid for g in first}) == 4


def test_two_nodes_never_share_a_gpu_uuid() -> None:
    a = {g.uuid for g in SimulatedGpus("L4-24GB", 4, "node-a").inventory()}
    b = {g.uuid for g in SimulatedGpus("L4-24GB", 4, "node-b").inventory()}

    assert not a & b


def test_simulated_memory_comes_from_the_gpu_class_datasheet() -> None:
    gpu = SimulatedGpus("H100-SXM-80GB", 1, "n").inventory()[0]

    assert gpu.memory_mb == int(load_gpu_specs()["H100-SXM-80GB"].memory_gb * 1024)


def test_only_the_gpus_a_replica_holds_look_busy() -> None:
    gpus = SimulatedGpus("L4-24GB", 3, "n")

    samples = gpus.sample([GpuLoad(gpu_indices=(1, 2), memory_fraction=0.9, busy_fraction=0.5)])

    assert [s.utilization_pct for s in samples] == [0, 50, 50]
    assert samples[0].memory_used_mb == 0
    assert samples[1].memory_used_mb == round(samples[1].memory_total_mb * 0.9)
    assert samples[1].temperature_c > samples[0].temperature_c


def test_an_unknown_gpu_class_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="L4-24GB"):
        SimulatedGpus("T4-16GB", 1, "n")


def test_the_simulate_flag_reads_class_and_count() -> None:
    assert parse_simulated_gpus("RTX-PRO-6000-96GB:8") == ("RTX-PRO-6000-96GB", 8)


def test_restart_delays_double_and_stop_at_the_cap() -> None:
    backoff = Backoff(base_s=1.0, cap_s=10.0)

    assert [backoff.delay(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
