"""What GPUs this node has and how busy they are: from NVML, or simulated where there are none.

Simulated GPUs are the GPU classes of serving/engine/data/gpus.csv, with UUIDs derived from the
node's identity so a restarted agent reports the same GPUs, and a load derived from the replicas
placed on them so the console shows the fleet working."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
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


def parse_simulated_gpus(value: str) -> tuple[str, int]:
    """`L4-24GB:4` -> ("L4-24GB", 4)."""
    gpu_class, sep, count = value.rpartition(":")
    if not sep or not gpu_class or not count.isdigit():
        raise ValueError(f"--simulate-gpus wants CLASS:COUNT, e.g. L4-24GB:4, got {value!r}")
    return gpu_class, int(count)


def _text(value: bytes | str) -> str:
    # nvidia-ml-py returned bytes before 11.5 and str since; accept both.
    return value.decode() if isinstance(value, bytes) else value
