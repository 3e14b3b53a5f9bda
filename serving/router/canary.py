"""Canary traffic split: which deployment of a model name a request goes to."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from serving.router.contracts import DeploymentRoute, ModelRoute, RouteRequest


def _bucket(key: str, total: int) -> int:
    # A keyed-free cryptographic hash: stable across processes (unlike hash()) and uniform
    # even for sequential request ids, so a 25% weight gets 25% of traffic.
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % total


def split_by_weight(deployments: Sequence[DeploymentRoute], key: str) -> DeploymentRoute | None:
    """The deployment that `key` (a request id, or a tenant in cohort mode) falls into.

    Weights need not sum to 100; a weight of 0 or less is never chosen.
    """
    total = 0
    for deployment in deployments:
        if deployment.weight > 0:
            total += deployment.weight
    if total <= 0:
        return None
    bucket = _bucket(key, total)
    for deployment in deployments:
        if deployment.weight <= 0:
            continue
        if bucket < deployment.weight:
            return deployment
        bucket -= deployment.weight
    raise AssertionError("bucket outside the total weight")  # pragma: no cover


def split_key(route: ModelRoute, request: RouteRequest) -> str:
    return request.tenant if route.cohort_by_tenant else request.request_id


def deployments_in_order(route: ModelRoute, request: RouteRequest) -> Iterator[DeploymentRoute]:
    """The split's choice first, then the other weighted deployments as fallbacks.

    The fallbacks matter when the chosen deployment has no live replica: sending the
    request to the other version beats failing it. Weight-0 deployments stay out. Lazy,
    because the fallbacks are rarely needed and the first answer is on the hot path.
    """
    chosen = split_by_weight(route.deployments, split_key(route, request))
    if chosen is None:
        return
    yield chosen
    yield from sorted(
        (d for d in route.deployments if d.weight > 0 and d is not chosen),
        key=lambda d: -d.weight,
    )
