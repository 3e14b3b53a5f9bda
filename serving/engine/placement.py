"""Does a model fit on a GPU class at a TP degree and quantization? And if not, what would?

The rule is vLLM's start-up check: the weights plus the KV of ONE full sequence at
max_model_len must fit in memory x gpu_memory_utilization minus the engine's overhead, per GPU.
KV is budgeted in bf16 so a placement never depends on the fp8 KV option being turned on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from serving.engine.perf import GB, PerfModel
from serving.engine.specs import QUANTIZATIONS, GpuSpec, ModelSpec, load_gpu_specs

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class PlacementResult:
    ok: bool
    message: str
    gpu: str
    model: str
    quantization: str
    tensor_parallel: int
    kv_capacity_tokens: int
    weights_gb_per_gpu: float
    kv_gb_per_gpu_for_one_sequence: float
    usable_gb_per_gpu: float


@dataclass(frozen=True, slots=True)
class Placement:
    gpu: str
    tensor_parallel: int
    quantization: str
    kv_capacity_tokens: int
    usd_per_hour: float


def _measure(
    gpu: GpuSpec,
    model: ModelSpec,
    quantization: str,
    tensor_parallel: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    engine_overhead_gb: float,
) -> tuple[bool, PerfModel, float]:
    perf = PerfModel(
        gpu,
        model,
        quantization=quantization,
        tensor_parallel=tensor_parallel,
        gpu_memory_utilization=gpu_memory_utilization,
        engine_overhead_gb=engine_overhead_gb,
    )
    one_sequence = max_model_len * model.kv_bytes_per_token("auto") / tensor_parallel
    fits = perf.weights_bytes_per_gpu + one_sequence <= perf.usable_bytes_per_gpu
    return fits, perf, one_sequence


def fits(
    gpu: GpuSpec,
    model: ModelSpec,
    quantization: str,
    tensor_parallel: int,
    max_model_len: int = 8192,
    gpu_memory_utilization: float = 0.9,
    engine_overhead_gb: float = 3.0,
) -> bool:
    return _measure(
        gpu,
        model,
        quantization,
        tensor_parallel,
        max_model_len,
        gpu_memory_utilization,
        engine_overhead_gb,
    )[0]


def check_placement(
    gpu: GpuSpec,
    model: ModelSpec,
    quantization: str,
    tensor_parallel: int,
    max_model_len: int = 8192,
    gpu_memory_utilization: float = 0.9,
    engine_overhead_gb: float = 3.0,
) -> PlacementResult:
    if tensor_parallel not in TP_DEGREES:
        return _refusal(
            gpu,
            model,
            quantization,
            tensor_parallel,
            f"tensor parallel size must be one of {', '.join(map(str, TP_DEGREES))}, "
            f"not {tensor_parallel}",
        )
    if quantization not in QUANTIZATIONS:
        return _refusal(
            gpu,
            model,
            quantization,
            tensor_parallel,
            f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}",
        )
    if max_model_len > model.max_context:
        return _refusal(
            gpu,
            model,
            quantization,
            tensor_parallel,
            f"max_model_len {max_model_len} exceeds {model.name}'s context of {model.max_context}",
        )
    settings = (max_model_len, gpu_memory_utilization, engine_overhead_gb)
    ok, perf, one_sequence = _measure(gpu, model, quantization, tensor_parallel, *settings)
    needed_gb = (perf.weights_bytes_per_gpu + one_sequence) / GB
    usable_gb = perf.usable_bytes_per_gpu / GB
    where = f"{model.name} {quantization} at TP {tensor_parallel} on {gpu.name}"
    if ok:
        message = (
            f"{where} fits: {needed_gb:.1f} of {usable_gb:.1f} GB per GPU, "
            f"KV cache for {perf.kv_capacity_tokens} tokens"
        )
    else:
        message = (
            f"{where} does not fit: needs {needed_gb:.1f} GB per GPU "
            f"(weights {perf.weights_bytes_per_gpu / GB:.1f} + one {max_model_len}-token "
            f"sequence of KV {one_sequence / GB:.1f}) but {usable_gb:.1f} GB is usable. "
            + _alternatives(gpu, model, quantization, tensor_parallel, settings)
        )
    return PlacementResult(
        ok=ok,
        message=message,
        gpu=gpu.name,
        model=model.name,
        quantization=quantization,
        tensor_parallel=tensor_parallel,
        kv_capacity_tokens=perf.kv_capacity_tokens if ok else 0,
        weights_gb_per_gpu=perf.weights_bytes_per_gpu / GB,
        kv_gb_per_gpu_for_one_sequence=one_sequence / GB,
        usable_gb_per_gpu=usable_gb,
    )


def _alternatives(
    gpu: GpuSpec,
    model: ModelSpec,
    quantization: str,
    tensor_parallel: int,
    settings: tuple[int, float, float],
) -> str:
    options: list[str] = []
    bigger_tp = [tp for tp in TP_DEGREES if tp > tensor_parallel]
    fitting_tp = [tp for tp in bigger_tp if _measure(gpu, model, quantization, tp, *settings)[0]]
    if fitting_tp:
        options.append(f"TP {fitting_tp[0]} on {gpu.name} with {quantization}")
    lighter = QUANTIZATIONS[QUANTIZATIONS.index(quantization) + 1 :]
    fitting_quant = [q for q in lighter if _measure(gpu, model, q, tensor_parallel, *settings)[0]]
    if fitting_quant:
        options.append(f"{fitting_quant[0]} at TP {tensor_parallel} on {gpu.name}")
    other_gpus = [
        other.name
        for other in load_gpu_specs().values()
        if other.name != gpu.name
        and _measure(other, model, quantization, tensor_parallel, *settings)[0]
    ]
    if other_gpus:
        options.append(f"{quantization} at TP {tensor_parallel} on {', '.join(other_gpus)}")
    if not options:
        return "Nothing fits with this quantization and TP; see suggest_placements()."
    return "Would fit: " + "; or ".join(options) + "."


def _refusal(
    gpu: GpuSpec, model: ModelSpec, quantization: str, tensor_parallel: int, message: str
) -> PlacementResult:
    return PlacementResult(
        ok=False,
        message=message,
        gpu=gpu.name,
        model=model.name,
        quantization=quantization,
        tensor_parallel=tensor_parallel,
        kv_capacity_tokens=0,
        weights_gb_per_gpu=0.0,
        kv_gb_per_gpu_for_one_sequence=0.0,
        usable_gb_per_gpu=0.0,
    )


def suggest_placements(
    model: ModelSpec,
    quantization: str | None = None,
    max_model_len: int = 8192,
    gpu_memory_utilization: float = 0.9,
    engine_overhead_gb: float = 3.0,
) -> list[Placement]:
    """Every (GPU class, smallest fitting TP) per quantization, cheapest per hour first.
    quantization None tries all three."""
    settings = (max_model_len, gpu_memory_utilization, engine_overhead_gb)
    quantizations = QUANTIZATIONS if quantization is None else (quantization,)
    placements: list[Placement] = []
    for gpu in load_gpu_specs().values():
        for quant in quantizations:
            for tp in TP_DEGREES:
                ok, perf, _ = _measure(gpu, model, quant, tp, *settings)
                if ok:
                    placements.append(
                        Placement(
                            gpu.name, tp, quant, perf.kv_capacity_tokens, gpu.usd_per_hour * tp
                        )
                    )
                    break
    return sorted(placements, key=lambda p: (p.usd_per_hour, -p.kv_capacity_tokens))


# --- room on the fleet now: free GPUs per node, one replica's GPUs on one node -------------


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """A schedulable node's free GPUs: the memory of each in MiB as NVML reports it (0 when
    the agent has not said: the GPU class's datasheet figure is used)."""

    node: str
    free_memory_mb: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """How many of `wanted` replicas the nodes of a pool have room for now, and why not all."""

    ok: bool
    wanted: int
    placeable: int
    message: str
    # The nodes' free GPUs once the placeable replicas took theirs (another phase on the same
    # pool is placed onto these).
    remaining: tuple[NodeGpus, ...]


def check_capacity(
    pool: str,
    nodes: Sequence[NodeGpus],
    gpu: GpuSpec,
    model: ModelSpec,
    quantization: str,
    tensor_parallel: int,
    wanted: int,
    max_model_len: int = 8192,
    gpu_memory_utilization: float = 0.9,
    engine_overhead_gb: float = 3.0,
) -> CapacityResult:
    """Place `wanted` replicas of `tensor_parallel` GPUs each, every replica on one node, on
    free GPUs whose own memory holds the model at that TP degree (as the fleet's reconcile
    chooses). Nodes that are not ready, cordoned or draining are not in `nodes`."""
    settings = (max_model_len, gpu_memory_utilization, engine_overhead_gb)

    def holds(memory_mb: int) -> bool:
        own = replace(gpu, memory_gb=memory_mb * 1.048576 / 1000.0) if memory_mb else gpu
        return _measure(own, model, quantization, tensor_parallel, *settings)[0]

    placeable, remaining = 0, []
    for node in nodes:
        usable = [mb for mb in node.free_memory_mb if holds(mb)]
        here = min(len(usable) // tensor_parallel, wanted - placeable)
        taken = Counter(usable[: here * tensor_parallel])
        left = []
        for mb in node.free_memory_mb:
            if taken[mb]:
                taken[mb] -= 1
            else:
                left.append(mb)
        placeable += here
        remaining.append(NodeGpus(node.node, tuple(left)))
    ok = placeable >= wanted
    return CapacityResult(
        ok=ok,
        wanted=wanted,
        placeable=placeable,
        message=_capacity_message(pool, nodes, tensor_parallel, wanted, placeable, holds),
        remaining=tuple(remaining),
    )


def _capacity_message(
    pool: str,
    nodes: Sequence[NodeGpus],
    tensor_parallel: int,
    wanted: int,
    placeable: int,
    holds: Callable[[int], bool],
) -> str:
    plural = "s" if tensor_parallel > 1 else ""
    if wanted == 0:
        return f"pool {pool}: no replicas wanted"
    if not nodes:
        return f"pool {pool}: no ready, schedulable node"
    largest = max(nodes, key=lambda node: len(node.free_memory_mb))
    free = len(largest.free_memory_mb)
    largest_text = f"largest free is {free} on node {largest.node}"
    if placeable >= wanted:
        replicas = f"{wanted} replica{'s' if wanted > 1 else ''}"
        return f"pool {pool}: room for {replicas} now ({largest_text})"
    if free < tensor_parallel:
        return f"pool {pool}: no node has {tensor_parallel} free GPU{plural}; {largest_text}"
    if placeable == 0 and not any(holds(mb) for node in nodes for mb in node.free_memory_mb):
        return f"pool {pool}: the free GPUs are too small for the model at TP {tensor_parallel}"
    return (
        f"pool {pool}: room for {placeable} of {wanted} replicas of {tensor_parallel} "
        f"GPU{plural} on one node ({largest_text})"
    )
