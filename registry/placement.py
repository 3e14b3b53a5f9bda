"""Placement of a deployment: database rows in, the engine model's check out.

The rule and the arithmetic live in serving.engine.placement (weights plus the bf16 KV of one
full sequence at max_model_len must fit memory x utilization minus 3 GB per GPU); this module
only turns rows into specs and adds the pools where the deployment would fit as it stands.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from decimal import Decimal
from functools import cache
from typing import Any, Protocol, TypedDict

from registry.models import pools
from serving.engine.placement import PlacementResult, check_placement
from serving.engine.specs import DATA_DIR, GpuSpec

ENGINE_OVERHEAD_GB = 3.0


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
    args = deployment.effective_engine_args()
    settings: _EngineSettings = {
        "max_model_len": int(args["max_model_len"]),
        "gpu_memory_utilization": float(args["gpu_memory_utilization"]),
        "engine_overhead_gb": ENGINE_OVERHEAD_GB,
    }
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
