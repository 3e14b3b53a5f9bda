"""Peer routers, modelled as their projects ship them, each cited to its source.

One module per peer; each class implements `policies.Policy` and names its own metrics
refresh default in `refresh_interval_s` (None where its choice reads no polled metrics).
`serving.router.POLICIES` includes them by name, beside our own policies.
"""

from serving.router.peers.dynamo import DynamoKv
from serving.router.peers.llm_d import LlmDEpp
from serving.router.peers.production_stack import (
    ProductionStackPrefixAware,
    ProductionStackRoundRobin,
)

PeerPolicy = LlmDEpp | ProductionStackRoundRobin | ProductionStackPrefixAware | DynamoKv

PEERS: dict[str, type[PeerPolicy]] = {
    peer.name: peer
    for peer in (LlmDEpp, ProductionStackRoundRobin, ProductionStackPrefixAware, DynamoKv)
}

__all__ = [
    "PEERS",
    "DynamoKv",
    "LlmDEpp",
    "PeerPolicy",
    "ProductionStackPrefixAware",
    "ProductionStackRoundRobin",
]
