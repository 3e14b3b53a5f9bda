"""The router: picks a replica for a request over plain data. Imports nothing from Django."""

from serving.router.breaker import BreakerState, CircuitBreaker
from serving.router.canary import deployments_in_order, split_by_weight, versions_in_order
from serving.router.contracts import (
    COLOCATED,
    DECODE,
    DEFAULT_SLO_TIERS,
    PREFILL,
    Decision,
    DeploymentRoute,
    KvLink,
    ModelRoute,
    Reason,
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    SloTier,
    VersionRoute,
)
from serving.router.disaggregated import Disaggregated
from serving.router.index import ReplicaSet, RouterState
from serving.router.policies import (
    POLICIES,
    CostAware,
    LeastLoad,
    Policy,
    RoundRobin,
    ScorerWeights,
    WeightedScorer,
    least_load_pick,
)
from serving.router.predict import Prediction, is_candidate, predict
from serving.router.prefix import PrefixIndex
from serving.router.queue import AdmissionQueue, QueueFull

__all__ = [
    "COLOCATED",
    "DECODE",
    "DEFAULT_SLO_TIERS",
    "POLICIES",
    "PREFILL",
    "AdmissionQueue",
    "BreakerState",
    "CircuitBreaker",
    "CostAware",
    "Decision",
    "DeploymentRoute",
    "Disaggregated",
    "KvLink",
    "LeastLoad",
    "ModelRoute",
    "Policy",
    "Prediction",
    "PrefixIndex",
    "QueueFull",
    "Reason",
    "ReplicaPerf",
    "ReplicaSet",
    "ReplicaState",
    "RoundRobin",
    "RouteRequest",
    "RouterConfig",
    "RouterState",
    "ScorerWeights",
    "SloTier",
    "VersionRoute",
    "WeightedScorer",
    "deployments_in_order",
    "is_candidate",
    "least_load_pick",
    "predict",
    "split_by_weight",
    "versions_in_order",
]
