"""Canary traffic split: weights by request id, or by tenant in cohort mode, between a
served model's versions; a version's weight is the sum of its deployments'."""

from __future__ import annotations

import math

from serving.router import DeploymentRoute, ModelRoute, RouteRequest, deployments_in_order
from serving.router.canary import split_by_weight, versions_in_order

STABLE = DeploymentRoute("stable", "v1", 75)
CANARY = DeploymentRoute("canary", "v2", 25)


def request(request_id: str, tenant: str = "acme") -> RouteRequest:
    return RouteRequest(
        model="llama-3.1-8b",
        tenant=tenant,
        tier="standard",
        prompt_tokens=100,
        max_tokens=10,
        request_id=request_id,
    )


def test_a_deployment_with_weight_zero_never_gets_traffic() -> None:
    deployments = (DeploymentRoute("stable", "v1", 100), DeploymentRoute("canary", "v2", 0))
    chosen = {split_by_weight(deployments, f"req-{n}") for n in range(2000)}
    assert chosen == {deployments[0]}


def test_a_weight_of_25_gets_a_quarter_of_the_requests() -> None:
    trials = 8000
    hits = sum(split_by_weight((STABLE, CANARY), f"req-{n}") == CANARY for n in range(trials))
    # Four standard deviations of a binomial(8000, 0.25): fails by chance about 1 in 16,000.
    bound = 4 * math.sqrt(trials * 0.25 * 0.75)
    assert abs(hits - trials * 0.25) < bound


def test_the_same_request_id_always_lands_on_the_same_side() -> None:
    assert len({split_by_weight((STABLE, CANARY), "req-42") for _ in range(10)}) == 1


def test_cohort_mode_keeps_each_tenant_on_one_side() -> None:
    route = ModelRoute("llama-3.1-8b", (STABLE, CANARY), cohort_by_tenant=True)
    for tenant in ("acme", "globex", "initech", "umbrella"):
        sides = {next(deployments_in_order(route, request(f"req-{n}", tenant))) for n in range(200)}
        assert len(sides) == 1


def test_cohort_mode_still_splits_tenants_by_weight() -> None:
    route = ModelRoute("llama-3.1-8b", (STABLE, CANARY), cohort_by_tenant=True)
    tenants = [f"tenant-{n}" for n in range(4000)]
    on_canary = sum(next(deployments_in_order(route, request("r", t))) == CANARY for t in tenants)
    assert abs(on_canary - 1000) < 4 * math.sqrt(4000 * 0.25 * 0.75)


def test_other_weighted_deployments_are_fallbacks_but_weight_zero_is_not() -> None:
    retired = DeploymentRoute("retired", "v0", 0)
    route = ModelRoute("llama-3.1-8b", (STABLE, CANARY, retired))
    order = list(deployments_in_order(route, request("req-1")))
    assert len(order) == 2 and set(order) == {STABLE, CANARY}


def test_no_weight_anywhere_means_no_deployment() -> None:
    assert split_by_weight((DeploymentRoute("a", "v1", 0),), "req-1") is None


# A version on several pools: one deployment per pool, one share of traffic.
ON_TWO_POOLS = ModelRoute(
    "llama-3.1-8b",
    (
        DeploymentRoute("stable-l40s", "v1", 45),
        DeploymentRoute("stable-l4", "v1", 45),
        DeploymentRoute("canary", "v2", 10),
    ),
)


def test_a_versions_weight_is_the_sum_of_its_deployments_weights() -> None:
    trials = 8000
    hits = sum(
        next(versions_in_order(ON_TWO_POOLS, request(f"req-{n}"))).version == "v2"
        for n in range(trials)
    )
    assert abs(hits - trials * 0.1) < 4 * math.sqrt(trials * 0.1 * 0.9)


def test_the_chosen_version_brings_all_its_deployments_and_the_other_version_follows() -> None:
    order = [
        [d.deployment_id for d in version.deployments]
        for version in versions_in_order(ON_TWO_POOLS, request("req-1"))
    ]
    assert sorted(order) == [["canary"], ["stable-l40s", "stable-l4"]]


def test_a_deployment_of_weight_zero_stays_out_of_its_version() -> None:
    draining = DeploymentRoute("stable-l4", "v1", 0)
    route = ModelRoute("llama-3.1-8b", (DeploymentRoute("stable-l40s", "v1", 100), draining))
    (version,) = route.versions
    assert version.weight == 100 and draining not in version.deployments
    assert draining not in set(deployments_in_order(route, request("req-1")))


def test_cohort_mode_keeps_each_tenant_on_one_version_of_several_pools() -> None:
    route = ModelRoute("llama-3.1-8b", ON_TWO_POOLS.deployments, cohort_by_tenant=True)
    for tenant in ("acme", "globex", "initech", "umbrella"):
        sides = {
            next(versions_in_order(route, request(f"req-{n}", tenant))).version for n in range(200)
        }
        assert len(sides) == 1
