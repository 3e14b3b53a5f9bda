"""What accelerators this node has and how busy they are: GPUs from NVML, a CPU node's cores in
slots, or GPUs simulated where there are none.

A CPU node is inventoried as slots: its usable cores split into equal groups, each with an
equal share of memory, reported in the shape of a GPU so that placement, reconcile, health,
drain and telemetry treat a CPU pool like any other (a replica's `gpu_indices` name its slots).
Simulated GPUs are the GPU classes of serving/engine/data/gpus.csv, with UUIDs derived from the
node's identity so a restarted agent reports the same GPUs, and a load derived from the replicas
placed on them so the console shows the fleet working."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from serving.engine.specs import load_gpu_specs

# A fixed namespace: the same node name always yields the same fake UUIDs.
_SIMULATED_GPU_NAMESPACE = uuid.UUID("5b0d7c1e-3a51-4f3e-9d55-6a3c8c0f2e71")
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_mb: int

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "memory_mb": self.memory_mb,
        }


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    uuid: str
    utilization_pct: int
    memory_used_mb: int
    memory_total_mb: int
    temperature_c: int

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "utilization_pct": self.utilization_pct,
            "memory_used_mb": self.memory_used_mb,
            "memory_total_mb": self.memory_total_mb,
            "temperature_c": self.temperature_c,
        }


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """What a replica is doing to the GPUs it holds, for simulated GPUs to report."""

    gpu_indices: tuple[int, ...]
    memory_fraction: float
    busy_fraction: float


class GpuInventory(Protocol):
    simulated: bool

    def inventory(self) -> list[GpuInfo]: ...

    def sample(self, loads: list[GpuLoad]) -> list[GpuSample]: ...


class NvmlGpus:
    """The node's real GPUs through nvidia-ml-py. Loads are ignored: NVML measures them."""

    simulated = False

    def __init__(self) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]

    def inventory(self) -> list[GpuInfo]:
        nvml = self._nvml
        return [
            GpuInfo(
                index=index,
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                name=_text(nvml.nvmlDeviceGetName(handle)),
                memory_mb=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
            )
            for index, handle in enumerate(self._handles)
        ]

    def sample(self, loads: list[GpuLoad]) -> list[GpuSample]:
        nvml = self._nvml
        samples = []
        for index, handle in enumerate(self._handles):
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            samples.append(
                GpuSample(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    utilization_pct=int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    memory_used_mb=int(memory.used) // _MIB,
                    memory_total_mb=int(memory.total) // _MIB,
                    temperature_c=int(
                        nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                    ),
                )
            )
        return samples


class SimulatedGpus:
    simulated = True

    def __init__(self, gpu_class: str, count: int, node_identity: str) -> None:
        specs = load_gpu_specs()
        if gpu_class not in specs:
            known = ", ".join(specs)
            raise ValueError(f"unknown GPU class {gpu_class!r}; use one of {known}")
        if count < 1:
            raise ValueError("a simulated node needs at least one GPU")
        self.gpu_class = gpu_class
        memory_mb = int(specs[gpu_class].memory_gb * 1024)
        self._gpus = [
            GpuInfo(
                index=index,
                uuid="GPU-" + str(uuid.uuid5(_SIMULATED_GPU_NAMESPACE, f"{node_identity}/{index}")),
                name=gpu_class,
                memory_mb=memory_mb,
            )
            for index in range(count)
        ]

    def inventory(self) -> list[GpuInfo]:
        return list(self._gpus)

    def sample(self, loads: list[GpuLoad]) -> list[GpuSample]:
        memory_fraction = [0.0] * len(self._gpus)
        busy = [0.0] * len(self._gpus)
        for load in loads:
            for index in load.gpu_indices:
                if 0 <= index < len(self._gpus):
                    memory_fraction[index] += load.memory_fraction
                    busy[index] = max(busy[index], load.busy_fraction)
        return [
            GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                utilization_pct=round(100 * min(1.0, busy[gpu.index])),
                memory_used_mb=round(gpu.memory_mb * min(1.0, memory_fraction[gpu.index])),
                memory_total_mb=gpu.memory_mb,
                # Idle around 32 C, a busy datacenter GPU in the high 60s.
                temperature_c=round(32 + 36 * min(1.0, busy[gpu.index])),
            )
            for gpu in self._gpus
        ]


class CpuSlots:
    """A CPU node's cores in `slots` equal groups, measured from /proc (Linux).

    `reserved` cores (the last ones) go to no slot: they are the node's own, for the agent,
    the engines' API servers and tokenizers. vLLM's CPU build does the same when it binds its
    threads itself (`VLLM_CPU_OMP_THREADS_BIND=auto` keeps one core back): engine threads that
    spin on every core starve everything else on the node, heartbeats included."""

    simulated = False

    def __init__(
        self, slots: int, node_identity: str, reserved: int = 1, proc: Path = Path("/proc")
    ) -> None:
        every = sorted(os.sched_getaffinity(0))
        if not 0 <= reserved < len(every):
            raise ValueError(f"--cpu-reserved-cores must be between 0 and {len(every) - 1}")
        cores = every[: len(every) - reserved]
        if not 1 <= slots <= len(cores):
            raise ValueError(
                f"--cpu-slots must be between 1 and {len(cores)} (the cores left after "
                f"{reserved} reserved for the node)"
            )
        per_slot = len(cores) // slots
        self.slots = tuple(tuple(cores[i * per_slot : (i + 1) * per_slot]) for i in range(slots))
        self._proc = proc
        self._busy_before: dict[int, tuple[int, int]] = {}
        memory_mb = _meminfo_mb(proc, "MemTotal") // slots
        name = _cpu_model(proc)
        self._devices = [
            GpuInfo(
                index=index,
                uuid="CPU-"
                + str(uuid.uuid5(_SIMULATED_GPU_NAMESPACE, f"{node_identity}/cpu{index}")),
                name=name,
                memory_mb=memory_mb,
            )
            for index in range(slots)
        ]

    def inventory(self) -> list[GpuInfo]:
        return list(self._devices)

    def sample(self, loads: list[GpuLoad]) -> list[GpuSample]:
        """Each slot's core utilization since the last sample, and its share of used memory.
        Loads are ignored: the kernel measures them."""
        times = _cpu_times(self._proc)
        used_mb = (
            _meminfo_mb(self._proc, "MemTotal") - _meminfo_mb(self._proc, "MemAvailable")
        ) // len(self.slots)
        samples = []
        for device, cores in zip(self._devices, self.slots, strict=True):
            busy = total = 0
            for core in cores:
                now = times.get(core, (0, 0))
                before = self._busy_before.get(core, (0, 0))
                busy += now[0] - before[0]
                total += now[1] - before[1]
                self._busy_before[core] = now
            samples.append(
                GpuSample(
                    index=device.index,
                    uuid=device.uuid,
                    utilization_pct=round(100 * busy / total) if total > 0 else 0,
                    memory_used_mb=used_mb,
                    memory_total_mb=device.memory_mb,
                    temperature_c=0,  # not measured on CPU nodes
                )
            )
        return samples


def _cpu_times(proc: Path) -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) jiffies from /proc/stat; idle and iowait are not busy."""
    times: dict[int, tuple[int, int]] = {}
    for line in (proc / "stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        values = [int(v) for v in fields]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def _meminfo_mb(proc: Path, field: str) -> int:
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) // 1024
    raise ValueError(f"/proc/meminfo has no {field}")


def _cpu_model(proc: Path) -> str:
    for line in (proc / "cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "CPU"


def parse_simulated_gpus(value: str) -> tuple[str, int]:
    """`L4-24GB:4` -> ("L4-24GB", 4)."""
    gpu_class, sep, count = value.rpartition(":")
    if not sep or not gpu_class or not count.isdigit():
        raise ValueError(f"--simulate-gpus wants CLASS:COUNT, e.g. L4-24GB:4, got {value!r}")
    return gpu_class, int(count)


def _text(value: bytes | str) -> str:
    # nvidia-ml-py returned bytes before 11.5 and str since; accept both.
    return value.decode() if isinstance(value, bytes) else value
