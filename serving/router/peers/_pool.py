"""The replicas a peer scores: every live replica of a version, as the peers score them all."""

from __future__ import annotations

from serving.router.contracts import ReplicaState, VersionRoute
from serving.router.index import RouterState


def live_replicas(state: RouterState, version: VersionRoute) -> list[ReplicaState]:
    deployments = version.deployments
    if len(deployments) == 1:
        return state.live(deployments[0].deployment_id).items
    return [r for d in deployments for r in state.live(d.deployment_id).items]
