"""One version on several pools: traffic weight splits between versions, and every policy
chooses among the replicas of all the chosen version's deployments. No database."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.router import (
    CostAware,
    DeploymentRoute,
    LeastLoad,
    ModelRoute,
    ReplicaState,
    RoundRobin,
    RouterConfig,
    RouteRequest,
    RouterState,
    WeightedScorer,
    least_load_pick,
)
from serving.router.coefficients import coefficients_from_perf

MODEL = "llama-3.1-8b"
NOW = 1_000.0
CHEAP = "L40S-48GB"
DEAR = "H100-SXM-80GB"
# As the demo deploys llama-3.1-8b: one version, one deployment per pool, weight 100 each.
ONE_VERSION_ON_TWO_POOLS = ModelRoute(
    MODEL,
    (DeploymentRoute("l40s-eu-west", "v1", 100), DeploymentRoute("h100-eu-west", "v1", 100)),
)


def replica(replica_id: str, deployment_id: str, gpu_class: str, **fields: object) -> ReplicaState:
    spec = load_gpu_specs()[gpu_class]
    values: dict[str, object] = {
        "replica_id": replica_id,
        "deployment_id": deployment_id,
        "model": MODEL,
        "version": "v1",
        "pool": deployment_id,
        "gpu_class": gpu_class,
        "region": "eu-west",
        "price_per_hour": spec.usd_per_hour,
        "perf": coefficients_from_perf(PerfModel(spec, load_model_specs()[MODEL])),
        "telemetry_at": NOW,
    }
    values.update(fields)
    return ReplicaState(**values)  # type: ignore[arg-type]


def two_pools(cheap: dict | None = None, dear: dict | None = None, seed: int = 1) -> RouterState:
    return RouterState(
        [ONE_VERSION_ON_TWO_POOLS],
        [
            replica("l40s-1", "l40s-eu-west", CHEAP, **(cheap or {})),
            replica("h100-1", "h100-eu-west", DEAR, **(dear or {})),
        ],
        seed=seed,
    )


def request(n: int, tier: str = "standard") -> RouteRequest:
    return RouteRequest(
        model=MODEL,
        tenant="acme",
        tier=tier,  # type: ignore[arg-type]
        prompt_tokens=200,
        max_tokens=100,
        request_id=f"req-{n}",
    )


def picks(policy: object, count: int, *, start_requests: bool = False) -> list[str]:
    chosen = []
    for n in range(count):
        decision = policy.choose(request(n), NOW)  # type: ignore[attr-defined]
        assert decision.replica is not None
        assert decision.deployment_id == decision.replica.deployment_id
        if start_requests:
            policy.state.request_started(decision.replica.replica_id)  # type: ignore[attr-defined]
        chosen.append(decision.replica.replica_id)
    return chosen


def test_cost_aware_sends_every_request_both_pools_can_serve_to_the_cheaper_pool() -> None:
    state = two_pools()
    policy = CostAware(state)

    decisions = [policy.choose(request(n), NOW) for n in range(200)]

    assert all(decision.meets_slo for decision in decisions)
    assert Counter(decision.deployment_id for decision in decisions) == {"l40s-eu-west": 200}


def test_cost_aware_goes_to_the_dearer_pool_when_only_it_meets_the_slo() -> None:
    state = two_pools(cheap={"running": 60, "kv_usage": 0.95, "waiting": 20})

    policy = CostAware(state)

    decisions = [policy.choose(request(n, tier="interactive"), NOW) for n in range(50)]

    assert {decision.deployment_id for decision in decisions} == {"h100-eu-west"}
    assert all(decision.meets_slo for decision in decisions)


def test_least_load_fills_the_lighter_pool_first_then_spreads_over_both() -> None:
    state = two_pools(dear={"running": 4})

    chosen = picks(LeastLoad(state), 12, start_requests=True)

    assert chosen[:4] == ["l40s-1"] * 4
    assert Counter(chosen) == {"l40s-1": 8, "h100-1": 4}


def test_round_robin_alternates_between_the_deployments_of_a_version() -> None:
    chosen = picks(RoundRobin(two_pools()), 10)

    assert chosen[0::2] == [chosen[0]] * 5
    assert chosen[1::2] == [chosen[1]] * 5
    assert {chosen[0], chosen[1]} == {"l40s-1", "h100-1"}


def test_the_weighted_scorer_scores_the_replicas_of_both_pools_together() -> None:
    state = two_pools(cheap={"waiting": 8, "kv_usage": 0.5}, dear={"kv_usage": 0.5})

    assert set(picks(WeightedScorer(state), 50)) == {"h100-1"}


def test_the_baseline_is_the_lightest_replica_across_the_versions_deployments() -> None:
    state = two_pools(cheap={"running": 6})

    baselines = [least_load_pick(state, RouterConfig(), request(n), NOW) for n in range(50)]
    decisions = [CostAware(state).choose(request(n), NOW) for n in range(50)]

    assert {b and b.replica_id for b in baselines} == {"h100-1"}
    assert {d.replica.replica_id for d in decisions if d.replica is not None} == {"l40s-1"}
    assert {d.baseline_replica.replica_id for d in decisions if d.baseline_replica} == {"h100-1"}


def test_a_drained_deployment_of_a_version_takes_nothing_while_its_siblings_share() -> None:
    route = replace(
        ONE_VERSION_ON_TWO_POOLS,
        deployments=(
            *ONE_VERSION_ON_TWO_POOLS.deployments,
            DeploymentRoute("l4-eu-west", "v1", 0),
        ),
    )
    drained = replica("l4-1", "l4-eu-west", "L4-24GB")
    state = RouterState(
        [route],
        [
            replica("l40s-1", "l40s-eu-west", CHEAP),
            replica("h100-1", "h100-eu-west", DEAR),
            drained,
        ],
        seed=1,
    )

    cost_aware = Counter(
        picks(CostAware(state, RouterConfig(ttft_margin=1.0, tpot_margin=1.0)), 100)
    )
    least_load = Counter(picks(LeastLoad(state), 100, start_requests=True))

    # The L4 is cheaper still and meets the SLO without the margin, but takes no traffic.
    assert cost_aware == {"l40s-1": 100}
    assert set(least_load) == {"l40s-1", "h100-1"}


def test_a_version_on_two_pools_falls_back_to_the_other_version_only_when_it_has_none() -> None:
    route = ModelRoute(
        MODEL,
        (
            DeploymentRoute("l40s-eu-west", "v1", 85),
            DeploymentRoute("h100-eu-west", "v1", 5),
            DeploymentRoute("canary", "v2", 10),
        ),
    )
    canary = replace(replica("canary-1", "canary", CHEAP), version="v2")
    state = RouterState(
        [route],
        [
            replica("l40s-1", "l40s-eu-west", CHEAP, healthy=False),
            replica("h100-1", "h100-eu-west", DEAR),
            canary,
        ],
        seed=1,
    )

    chosen = Counter(picks(CostAware(state), 400))

    # v1's cheap replica is down: v1's 90% goes to v1's other pool, though that pool's own
    # weight is below the canary's.
    assert set(chosen) == {"h100-1", "canary-1"}
    assert 20 < chosen["canary-1"] < 70
