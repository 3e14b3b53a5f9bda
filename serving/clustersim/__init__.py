"""The cluster simulator: discrete events in virtual time over the engine model, with the real
router and the real autoscaler policy. Imports nothing from Django."""

from serving.clustersim.families import FAMILIES, FamilySpec
from serving.clustersim.fleet import (
    TENSOR_PARALLEL_DEGREES,
    AutoscaleBounds,
    FleetSpec,
    PoolSpec,
    homogeneous,
    smallest_tensor_parallel,
    with_budget,
)
from serving.clustersim.report import (
    ModelFigures,
    Summary,
    TierFigures,
    WorkCost,
    format_summary,
    plot,
    summarize,
    work_costs,
    write_csv,
)
from serving.clustersim.simulator import ClusterSimulator, SimConfig, SimResult, simulate
from serving.clustersim.workloads import (
    DEFAULT_TENANTS,
    LengthClass,
    LengthMix,
    SimRequest,
    Tenant,
    assign_models,
    bursty,
    diurnal,
    load_azure_conversation,
    load_mooncake,
    poisson,
)

__all__ = [
    "DEFAULT_TENANTS",
    "FAMILIES",
    "TENSOR_PARALLEL_DEGREES",
    "AutoscaleBounds",
    "ClusterSimulator",
    "FamilySpec",
    "FleetSpec",
    "LengthClass",
    "LengthMix",
    "ModelFigures",
    "PoolSpec",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "Summary",
    "Tenant",
    "TierFigures",
    "WorkCost",
    "assign_models",
    "bursty",
    "diurnal",
    "format_summary",
    "homogeneous",
    "load_azure_conversation",
    "load_mooncake",
    "plot",
    "poisson",
    "simulate",
    "smallest_tensor_parallel",
    "summarize",
    "with_budget",
    "work_costs",
    "write_csv",
]
