"""Canary traffic split: which version of a model name a request goes to.

Traffic weight splits a served model's traffic between its versions (a version's weight is
the sum of its deployments' weights; a deployment of weight 0 takes nothing). Inside the
chosen version the policy picks a replica across all of the version's deployments, as
vLLM's production stack and llm-d route across every endpoint serving a model name: a
version deployed on an L40S pool and an L4 pool is one set of replicas to choose from,
which is what lets the cost-aware policy choose between GPU classes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar

from serving.router.contracts import DeploymentRoute, ModelRoute, RouteRequest, VersionRoute


class _Weighted(Protocol):
    @property
    def weight(self) -> int: ...


_W = TypeVar("_W", bound=_Weighted)


def _bucket(key: str, total: int) -> int:
    # A keyed-free cryptographic hash: stable across processes (unlike hash()) and uniform
    # even for sequential request ids, so a 25% weight gets 25% of traffic.
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % total


def split_by_weight(choices: Sequence[_W], key: str) -> _W | None:
    """The choice (a version, or a deployment) that `key` (a request id, or a tenant in
    cohort mode) falls into.

    Weights need not sum to 100; a weight of 0 or less is never chosen.
    """
    total = 0
    for choice in choices:
        if choice.weight > 0:
            total += choice.weight
    if total <= 0:
        return None
    bucket = _bucket(key, total)
    for choice in choices:
        if choice.weight <= 0:
            continue
        if bucket < choice.weight:
            return choice
        bucket -= choice.weight
    raise AssertionError("bucket outside the total weight")  # pragma: no cover


def split_key(route: ModelRoute, request: RouteRequest) -> str:
    return request.tenant if route.cohort_by_tenant else request.request_id


def versions_in_order(route: ModelRoute, request: RouteRequest) -> Iterator[VersionRoute]:
    """The split's choice first, then the other versions, heaviest first, as fallbacks.

    The fallbacks matter when the chosen version has no live replica: sending the request
    to the other version beats failing it. Lazy, because the fallbacks are rarely needed
    and the first answer is on the hot path. The versions are grouped once, when the route
    is built (`ModelRoute.versions`); with one version nothing is hashed.
    """
    versions = route.versions
    if len(versions) == 1:
        yield versions[0]
        return
    chosen = split_by_weight(versions, split_key(route, request))
    if chosen is None:
        return
    yield chosen
    for version in route.versions_by_weight:
        if version is not chosen:
            yield version


def deployments_in_order(route: ModelRoute, request: RouteRequest) -> Iterator[DeploymentRoute]:
    """The deployments of `versions_in_order`, version after version: the chosen version's
    first. Weight-0 deployments stay out."""
    for version in versions_in_order(route, request):
        yield from version.deployments
