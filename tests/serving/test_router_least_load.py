"""Least load through `RouterState.by_load`: the load buckets follow every write to the
state, and the policy's choice is as light as a scan over all valid candidates of the
chosen version (v1 on two deployments, one per pool, or v2) finds. Every
policy's decision names least load's pick as its baseline, found without touching the
policy's random draws or the prefix index."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.router import (
    POLICIES,
    DeploymentRoute,
    LeastLoad,
    ModelRoute,
    ReplicaPerf,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    RouterState,
    is_candidate,
    least_load_pick,
)
from serving.router.canary import versions_in_order
from serving.router.coefficients import coefficients_from_perf
from serving.router.index import queue_load

MODEL = "llama-3.1-8b"
NOW = 1_000.0
CONFIG = RouterConfig()
ROUTE = ModelRoute(
    MODEL,
    (
        DeploymentRoute("stable", "v1", 30),
        DeploymentRoute("stable-l4", "v1", 30),
        DeploymentRoute("canary", "v2", 40),
    ),
)
DEPLOYMENTS = ("stable", "stable-l4", "canary")


def shapes() -> list[ReplicaPerf]:
    model = load_model_specs()[MODEL]
    return [
        coefficients_from_perf(PerfModel(spec, model))
        for name, spec in sorted(load_gpu_specs().items())
        if name in {"H100-SXM-80GB", "L4-24GB"}
    ]


PERFS = shapes()

replica_fields = st.fixed_dictionaries(
    {
        "deployment": st.sampled_from(DEPLOYMENTS),
        "shape": st.integers(0, len(PERFS) - 1),
        "region": st.sampled_from(("eu-west", "us-east")),
        "running": st.integers(0, 6),
        "waiting": st.integers(0, 3),
        "inflight": st.integers(0, 3),
        "telemetry_age": st.sampled_from((0.0, 10.0, 40.0)),
        "adapter": st.booleans(),
        "max_loras": st.integers(0, 1),
        "healthy": st.booleans() | st.just(True),
        "breaker_open": st.booleans() | st.just(False),
    }
)

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("telemetry"),
            st.integers(0, 30),
            st.integers(0, 6),
            st.integers(0, 3),
            st.none() | st.booleans(),
            st.none() | st.booleans(),
        ),
        st.tuples(st.just("started"), st.integers(0, 30)),
        st.tuples(st.just("finished"), st.integers(0, 30)),
        st.tuples(st.just("breaker"), st.integers(0, 30), st.booleans()),
    ),
    max_size=40,
)

request_fields = st.fixed_dictionaries(
    {
        "prompt_tokens": st.sampled_from((200, 100_000_000)),
        "adapter": st.sampled_from((None, "support-bot")),
        "eu_only": st.booleans(),
        "request_id": st.sampled_from(("req-1", "req-2", "req-3", "req-4")),
    }
)


def build(fields: list[dict], seed: int) -> RouterState:
    replicas = [
        ReplicaState(
            replica_id=f"r{index}",
            deployment_id=f["deployment"],
            model=MODEL,
            version="v1",
            pool="pool",
            gpu_class=f"shape-{f['shape']}",
            region=f["region"],
            price_per_hour=1.0,
            perf=PERFS[f["shape"]],
            running=f["running"],
            waiting=f["waiting"],
            inflight=f["inflight"],
            adapters_loaded=frozenset({"support-bot"}) if f["adapter"] else frozenset(),
            max_loras=f["max_loras"],
            healthy=f["healthy"],
            breaker_open_until=NOW + 30.0 if f["breaker_open"] else 0.0,
            telemetry_at=NOW - f["telemetry_age"],
        )
        for index, f in enumerate(fields)
    ]
    return RouterState([ROUTE], replicas, seed=seed)


def apply(state: RouterState, operation: tuple, size: int) -> None:
    kind, target = operation[0], f"r{operation[1] % size}"
    if kind == "telemetry":
        _, _, running, waiting, healthy, adapter = operation
        state.update_telemetry(
            target,
            running=running,
            waiting=waiting,
            kv_usage=0.5,
            telemetry_at=NOW,
            healthy=healthy,
            adapters_loaded=None
            if adapter is None
            else frozenset({"support-bot"} if adapter else ()),
        )
    elif kind == "started":
        state.request_started(target, 100, NOW)
    elif kind == "finished":
        state.request_finished(target, 100)
    else:
        state.set_breaker(target, NOW + 30.0 if operation[2] else 0.0)


def make_request(fields: dict) -> RouteRequest:
    return RouteRequest(
        model=MODEL,
        tenant="acme",
        tier="standard",
        prompt_tokens=fields["prompt_tokens"],
        max_tokens=100,
        request_id=fields.get("request_id", "req-1"),
        adapter=fields["adapter"],
        allowed_regions=frozenset({"eu-west"}) if fields["eu_only"] else None,
    )


def scan_minimum(state: RouterState, request: RouteRequest, size: int) -> int | None:
    """The brute-force answer: the least load over valid candidates of the first
    version, in the policy's order, that has any."""
    for version in versions_in_order(ROUTE, request):
        loads = [
            queue_load(replica)
            for replica in (state.replica(f"r{index}") for index in range(size))
            if replica is not None
            and replica.deployment_id in version.deployment_ids
            and is_candidate(replica, request, NOW, CONFIG)
        ]
        if loads:
            return min(loads)
    return None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(replica_fields, min_size=1, max_size=30),
    operations,
    request_fields,
    st.integers(0, 1_000),
)
def test_the_indexed_choice_is_as_light_as_the_scans_after_any_updates(
    fields: list[dict], updates: list[tuple], request_values: dict, seed: int
) -> None:
    state = build(fields, seed)
    for operation in updates:
        apply(state, operation, len(fields))
    request = make_request(request_values)

    decision = LeastLoad(state, CONFIG).choose(request, NOW)

    expected = scan_minimum(state, request, len(fields))
    chosen = None if decision.replica is None else queue_load(decision.replica)
    assert chosen == expected
    if decision.replica is not None:
        assert is_candidate(decision.replica, request, NOW, CONFIG)


@settings(max_examples=200, deadline=None)
@given(st.lists(replica_fields, min_size=1, max_size=30), operations, st.integers(0, 1_000))
def test_the_load_buckets_hold_exactly_the_healthy_replicas_at_their_current_load(
    fields: list[dict], updates: list[tuple], seed: int
) -> None:
    state = build(fields, seed)
    for operation in updates:
        apply(state, operation, len(fields))

    for deployment in DEPLOYMENTS:
        by_load = state.by_load(deployment)
        bucketed = {
            replica.replica_id: load
            for load, bucket in by_load.buckets.items()
            for replica in bucket
        }
        healthy = {
            replica.replica_id: queue_load(replica)
            for replica in (state.replica(f"r{index}") for index in range(len(fields)))
            if replica is not None and replica.deployment_id == deployment and replica.healthy
        }
        assert bucketed == healthy
        assert by_load.loads == sorted(by_load.buckets)


def test_least_load_follows_in_flight_requests_as_they_start_and_finish() -> None:
    state = build([{**BASE, "running": 1}, {**BASE, "running": 2}], seed=1)
    policy = LeastLoad(state, CONFIG)
    request = make_request({"prompt_tokens": 200, "adapter": None, "eu_only": False})

    state.request_started("r0")
    state.request_started("r0")
    after_starts = policy.choose(request, NOW).replica
    state.request_finished("r0")
    state.request_finished("r0")
    after_finishes = policy.choose(request, NOW).replica

    assert after_starts is not None and after_starts.replica_id == "r1"
    assert after_finishes is not None and after_finishes.replica_id == "r0"


def test_least_load_skips_a_lighter_replica_whose_breaker_is_open() -> None:
    state = build([{**BASE, "running": 0}, {**BASE, "running": 5}], seed=1)
    state.set_breaker("r0", NOW + 10.0)
    request = make_request({"prompt_tokens": 200, "adapter": None, "eu_only": False})

    chosen = LeastLoad(state, CONFIG).choose(request, NOW).replica

    assert chosen is not None and chosen.replica_id == "r1"


def test_least_load_spreads_equal_loads_over_every_tied_replica() -> None:
    state = build([{**BASE, "running": 3} for _ in range(4)] + [{**BASE, "running": 9}], seed=5)
    policy = LeastLoad(state, CONFIG)
    request = make_request({"prompt_tokens": 200, "adapter": None, "eu_only": False})

    picks = Counter(policy.choose(request, NOW).replica.replica_id for _ in range(400))  # type: ignore[union-attr]

    assert set(picks) == {"r0", "r1", "r2", "r3"}
    assert min(picks.values()) > 50


BASE: dict = {
    "deployment": "stable",
    "shape": 0,
    "region": "eu-west",
    "running": 0,
    "waiting": 0,
    "inflight": 0,
    "telemetry_age": 0.0,
    "adapter": False,
    "max_loras": 1,
    "healthy": True,
    "breaker_open": False,
}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(replica_fields, min_size=1, max_size=30),
    operations,
    request_fields,
    st.integers(0, 1_000),
    st.sampled_from(sorted(POLICIES)),
)
def test_every_policys_baseline_is_as_light_as_the_scans(
    fields: list[dict], updates: list[tuple], request_values: dict, seed: int, policy: str
) -> None:
    state = build(fields, seed)
    for operation in updates:
        apply(state, operation, len(fields))
    request = make_request(request_values)

    decision = POLICIES[policy](state, CONFIG).choose(request, NOW)

    baseline = decision.baseline_replica
    assert (baseline is None) == (decision.replica is None)
    if baseline is not None:
        assert queue_load(baseline) == scan_minimum(state, request, len(fields))
        assert is_candidate(baseline, request, NOW, CONFIG)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(replica_fields, min_size=1, max_size=30),
    st.lists(request_fields, min_size=1, max_size=8),
    st.integers(0, 1_000),
    st.sampled_from(sorted(POLICIES)),
)
def test_looking_up_the_baseline_leaves_a_policys_own_choices_as_they_were(
    fields: list[dict], request_values: list[dict], seed: int, policy: str
) -> None:
    plain, looked_up = build(fields, seed), build(fields, seed)
    plain_policy = POLICIES[policy](plain, CONFIG)
    looked_up_policy = POLICIES[policy](looked_up, CONFIG)
    requests = [
        replace(make_request(values), prefix_hashes=(1000 + 2 * n, 1001 + 2 * n))
        for n, values in enumerate(request_values)
    ]

    plain_picks, looked_up_picks = [], []
    for request in requests:
        plain_picks.append(plain_policy.choose(request, NOW).replica)
        rng_before = looked_up.rng.getstate()
        least_load_pick(looked_up, CONFIG, request, NOW)
        assert looked_up.rng.getstate() == rng_before
        assert looked_up.prefix_index.longest_matches("acme", request.prefix_hashes) == {}
        looked_up_picks.append(looked_up_policy.choose(request, NOW).replica)

    assert [r and r.replica_id for r in looked_up_picks] == [
        r and r.replica_id for r in plain_picks
    ]


def test_least_loads_decision_names_its_own_pick_as_the_baseline() -> None:
    state = build([{**BASE, "running": 3} for _ in range(4)], seed=5)
    request = make_request({"prompt_tokens": 200, "adapter": None, "eu_only": False})

    decision = LeastLoad(state, CONFIG).choose(request, NOW)

    assert decision.baseline_replica is decision.replica


def test_the_baseline_breaks_ties_on_the_first_candidate_of_the_lightest_bucket() -> None:
    state = build([{**BASE, "running": 9}] + [{**BASE, "running": 3} for _ in range(4)], seed=5)
    state.set_breaker("r1", NOW + 10.0)
    request = make_request({"prompt_tokens": 200, "adapter": None, "eu_only": False})

    picks = {least_load_pick(state, CONFIG, request, NOW).replica_id for _ in range(20)}  # type: ignore[union-attr]

    # r1..r4 joined the load-3 bucket in that order, and r1's breaker is open.
    assert picks == {"r2"}
