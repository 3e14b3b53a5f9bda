"""The router: picks a replica for a request over plain data. Imports nothing from Django."""

# First: puts the compiled build of the hot path, when it matches the sources, ahead of them.
import serving.router.native  # noqa: F401  # isort: skip

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
from serving.router.peers import (
    PEERS,
    DynamoKv,
    LlmDEpp,
    PeerPolicy,
    ProductionStackPrefixAware,
    ProductionStackRoundRobin,
)
from serving.router.policies import POLICIES as OWN_POLICIES
from serving.router.policies import (
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

# Ours and the peers', by name: what the gateway, the simulator and the benchmarks look up.
POLICIES: dict[str, type[RoundRobin | LeastLoad | WeightedScorer | CostAware | PeerPolicy]] = {
    **OWN_POLICIES,
    **PEERS,
}

__all__ = [
    "COLOCATED",
    "DECODE",
    "DEFAULT_SLO_TIERS",
    "OWN_POLICIES",
    "PEERS",
    "POLICIES",
    "PREFILL",
    "AdmissionQueue",
    "BreakerState",
    "CircuitBreaker",
    "CostAware",
    "Decision",
    "DeploymentRoute",
    "Disaggregated",
    "DynamoKv",
    "KvLink",
    "LeastLoad",
    "LlmDEpp",
    "ModelRoute",
    "Policy",
    "Prediction",
    "PrefixIndex",
    "ProductionStackPrefixAware",
    "ProductionStackRoundRobin",
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
