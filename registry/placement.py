"""Placement of a deployment: database rows in, the engine model's check out.

The rule and the arithmetic live in serving.engine.placement (weights plus the bf16 KV of one
full sequence at max_model_len must fit memory x utilization minus 3 GB per GPU); this module
only turns rows into specs and adds the pools where the deployment would fit as it stands.

Room now (`check_deployment_capacity`) counts the free GPUs of each ready, active node of the
pool (not cordoned, not draining), a GPU being free when no replica holds it (a draining
replica's process still does), as the fleet's reconcile counts them; a replica's GPUs are on
one node. The fleet's rows are read through the pool's reverse relations: the registry never
imports serving's models.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from decimal import Decimal
from functools import cache
from typing import Any, Protocol, TypedDict

from registry.models import pools
from serving.engine.placement import (
    CapacityResult,
    NodeGpus,
    PlacementResult,
    check_capacity,
    check_placement,
)
from serving.engine.specs import DATA_DIR, GpuSpec

ENGINE_OVERHEAD_GB = 3.0
# serving's Replica.State values that hold GPUs on a node (HOLDING_STATES).
GPU_HOLDING_STATES = ("pending", "starting", "ready", "failed", "draining")


class GpuClassRow(Protocol):
    """A GPU class as the fleet stores it (serving's GpuClass row)."""

    name: str
    memory_gb: float
    mem_bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: float | None
    tdp_w: int
    default_usd_per_hour: Decimal


def gpu_spec(gpu_class: GpuClassRow, usd_per_hour: float | None = None) -> GpuSpec:
    return GpuSpec(
        name=gpu_class.name,
        memory_gb=gpu_class.memory_gb,
        mem_bandwidth_gbs=gpu_class.mem_bandwidth_gbs,
        bf16_tflops=gpu_class.bf16_tflops,
        fp8_tflops=gpu_class.fp8_tflops,
        tdp_w=float(gpu_class.tdp_w),
        usd_per_hour=(
            usd_per_hour if usd_per_hour is not None else float(gpu_class.default_usd_per_hour)
        ),
    )


class _EngineSettings(TypedDict):
    """`check_placement`'s keyword arguments: two of the deployment's engine args, the overhead."""

    max_model_len: int
    gpu_memory_utilization: float
    engine_overhead_gb: float


@cache
def cpu_class_names() -> frozenset[str]:
    """The classes that are CPU slots (cpus.csv), not GPUs."""
    with (DATA_DIR / "cpus.csv").open(newline="") as handle:
        return frozenset(row["gpu"] for row in csv.DictReader(handle))


def check_kv_connector(deployment: Any) -> list[str]:
    """Problems with a disaggregated deployment's KV hand-over; empty when both phases' nodes
    can run its connector (NIXL needs GPUs: vLLM's CPU build has no NIXL)."""
    if deployment.decode_pool_id is None or deployment.kv_connector != "nixl":
        return []
    cpu = [
        pool.name
        for pool in (deployment.pool, deployment.decode_pool)
        if pool.gpu_class.name in cpu_class_names()
    ]
    if not cpu:
        return []
    return [f"NIXL needs GPU nodes and {', '.join(cpu)} runs on CPUs: use shared storage."]


def check_deployment_placement(deployment: Any) -> PlacementResult:
    """`deployment` is a registry Deployment, saved or not. A disaggregated one must fit both
    its prefill pool (`pool`) and its decode pool."""
    result = _check_on_pool(deployment, deployment.pool)
    if result.ok and deployment.decode_pool_id is not None:
        decode = _check_on_pool(deployment, deployment.decode_pool)
        if not decode.ok:
            return replace(
                decode, message=f"Decode pool {deployment.decode_pool.name}: {decode.message}"
            )
    return result


def _check_on_pool(deployment: Any, pool: Any) -> PlacementResult:
    version = deployment.model_version
    settings = _engine_settings(deployment)
    model = version.model.spec()
    result = check_placement(
        gpu_spec(pool.gpu_class),
        model,
        version.quantization,
        deployment.tensor_parallel,
        **settings,
    )
    if result.ok:
        return result
    fitting = [
        other.name
        for other in pools().exclude(pk=pool.pk)
        if check_placement(
            gpu_spec(other.gpu_class),
            model,
            version.quantization,
            deployment.tensor_parallel,
            **settings,
        ).ok
    ]
    if fitting:
        where = f" Pools where it fits as it stands: {', '.join(fitting)}."
        return replace(result, message=result.message + where)
    return result


def free_gpus(pool: Any) -> list[NodeGpus]:
    """The free GPUs of each ready, active node of `pool`, by hostname."""
    nodes = pool.nodes.filter(health="ready", scheduling="active").order_by("hostname")
    gpu_model = nodes.model._meta.get_field("gpus").related_model
    replica_model = nodes.model._meta.get_field("replicas").related_model
    memory: dict[int, dict[int, int]] = {}
    for node_id, index, memory_mb in gpu_model._default_manager.filter(node__in=nodes).values_list(
        "node_id", "index", "memory_mb"
    ):
        memory.setdefault(node_id, {})[index] = memory_mb
    held: dict[int, set[int]] = {}
    for node_id, indices in replica_model._default_manager.filter(
        node__in=nodes, state__in=GPU_HOLDING_STATES
    ).values_list("node_id", "gpu_indices"):
        held.setdefault(node_id, set()).update(indices)
    rooms = []
    for node in nodes:
        gpus = memory.get(node.pk, {})
        free = sorted(set(gpus) - held.get(node.pk, set()))
        rooms.append(NodeGpus(node.hostname, tuple(gpus[index] for index in free)))
    return rooms


def check_deployment_capacity(deployment: Any, *, missing_only: bool = False) -> CapacityResult:
    """Room now for every replica `deployment` wants (an inactive one wants none); for a
    disaggregated one the prefill replicas first, then the decode ones on what is left.
    `missing_only`: only for the replicas it still lacks (a saved deployment whose placed
    replicas hold GPUs already; those on a draining node are replaced, so they count as
    lacking, as the fleet's reconcile counts them)."""
    active = deployment.status == "active"
    phases = [(deployment.pool, deployment.replicas_desired if active else 0, "")]
    if deployment.decode_pool_id is not None:
        decode_wanted = deployment.decode_replicas_desired if active else 0
        phases = [
            (deployment.pool, phases[0][1], "prefill phase, "),
            (deployment.decode_pool, decode_wanted, "decode phase, "),
        ]
    if missing_only and deployment.pk is not None:
        placed = _placed_per_phase(deployment)
        names = ["colocated"] if len(phases) == 1 else ["prefill", "decode"]
        phases = [
            (pool, max(0, wanted - placed.get(name, 0)), label)
            for (pool, wanted, label), name in zip(phases, names, strict=True)
        ]
    rooms: dict[int, list[NodeGpus]] = {}
    results = []
    for pool, wanted, label in phases:
        nodes = rooms.get(pool.pk)
        if nodes is None:
            nodes = free_gpus(pool)
        result = _capacity_on_pool(deployment, pool, nodes, int(wanted))
        rooms[pool.pk] = list(result.remaining)
        results.append(replace(result, message=label + result.message))
        if not result.ok:
            return results[-1]
    if len(results) == 1:
        return results[0]
    return replace(results[-1], message="; ".join(r.message for r in results))


def _placed_per_phase(deployment: Any) -> dict[str, int]:
    """The deployment's replicas the fleet runs or is starting (serving's DESIRED_STATES),
    on nodes that are not draining, by phase."""
    placed: dict[str, int] = {}
    for phase in (
        deployment.replicas.filter(state__in=GPU_HOLDING_STATES)
        .exclude(state="draining")
        .exclude(node__scheduling="draining")
        .values_list("phase", flat=True)
    ):
        placed[phase] = placed.get(phase, 0) + 1
    return placed


def _capacity_on_pool(
    deployment: Any, pool: Any, nodes: list[NodeGpus], wanted: int
) -> CapacityResult:
    version = deployment.model_version
    return check_capacity(
        pool.name,
        nodes,
        gpu_spec(pool.gpu_class),
        version.model.spec(),
        version.quantization,
        deployment.tensor_parallel,
        wanted,
        **_engine_settings(deployment),
    )


def _engine_settings(deployment: Any) -> _EngineSettings:
    args = deployment.effective_engine_args()
    return {
        "max_model_len": int(args["max_model_len"]),
        "gpu_memory_utilization": float(args["gpu_memory_utilization"]),
        "engine_overhead_gb": ENGINE_OVERHEAD_GB,
    }
