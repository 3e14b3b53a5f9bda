"""The cluster simulator: discrete events in virtual time over the engine model, with the real
router and the real autoscaler policy. Imports nothing from Django."""

from serving.clustersim.families import FAMILIES, FamilySpec
from serving.clustersim.fleet import AutoscaleBounds, FleetSpec, PoolSpec, homogeneous, with_budget
from serving.clustersim.report import (
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
    bursty,
    diurnal,
    load_azure_conversation,
    load_mooncake,
    poisson,
)

__all__ = [
    "DEFAULT_TENANTS",
    "FAMILIES",
    "AutoscaleBounds",
    "ClusterSimulator",
    "FamilySpec",
    "FleetSpec",
    "LengthClass",
    "LengthMix",
    "PoolSpec",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "Summary",
    "Tenant",
    "TierFigures",
    "WorkCost",
    "bursty",
    "diurnal",
    "format_summary",
    "homogeneous",
    "load_azure_conversation",
    "load_mooncake",
    "plot",
    "poisson",
    "simulate",
    "summarize",
    "with_budget",
    "work_costs",
    "write_csv",
]
