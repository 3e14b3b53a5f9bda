"""The peer routers' scoring on hand-built fleets, against the arithmetic of their sources."""

from __future__ import annotations

import pytest

from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.router import (
    POLICIES,
    DeploymentRoute,
    DynamoKv,
    LlmDEpp,
    ModelRoute,
    ProductionStackPrefixAware,
    ProductionStackRoundRobin,
    ReplicaState,
    RouteRequest,
    RouterState,
)
from serving.router.coefficients import coefficients_from_perf
from serving.router.peers.dynamo import ApproxKvIndexer, dynamo_logit
from serving.router.peers.llm_d import EppPrefixIndexer, block_keys, epp_scores

MODEL = "llama-3.1-8b"
NOW = 1_000.0
H100 = "H100-SXM-80GB"
PERF = coefficients_from_perf(PerfModel(load_gpu_specs()[H100], load_model_specs()[MODEL]))
PROMPT = tuple(range(100, 164))  # 64 blocks of 16 tokens: 1,024 prompt tokens


def replica(replica_id: str, **fields: object) -> ReplicaState:
    values: dict[str, object] = {
        "replica_id": replica_id,
        "deployment_id": "stable",
        "model": MODEL,
        "version": "v1",
        "pool": "h100",
        "gpu_class": H100,
        "region": "eu-west",
        "price_per_hour": 4.0,
        "perf": PERF,
        "telemetry_at": NOW,
    }
    values.update(fields)
    return ReplicaState(**values)  # type: ignore[arg-type]


def fleet(*replicas: ReplicaState, seed: int = 1) -> RouterState:
    route = ModelRoute(MODEL, (DeploymentRoute("stable", "v1", 100),))
    return RouterState([route], replicas, seed=seed)


def request(n: int = 0, **fields: object) -> RouteRequest:
    values: dict[str, object] = {
        "model": MODEL,
        "tenant": "acme",
        "tier": "standard",
        "prompt_tokens": 1024,
        "max_tokens": 100,
        "request_id": f"req-{n}",
    }
    values.update(fields)
    return RouteRequest(**values)  # type: ignore[arg-type]


def chosen(policy: object, req: RouteRequest, now: float = NOW) -> str:
    decision = policy.choose(req, now)  # type: ignore[attr-defined]
    assert decision.replica is not None
    return str(decision.replica.replica_id)


def test_every_peer_is_registered_by_name_beside_our_policies() -> None:
    assert POLICIES["llm_d_epp"] is LlmDEpp
    assert POLICIES["production_stack_roundrobin"] is ProductionStackRoundRobin
    assert POLICIES["production_stack_prefix"] is ProductionStackPrefixAware
    assert POLICIES["dynamo_kv"] is DynamoKv
    assert "cost_aware" in POLICIES and "weighted_scorer" in POLICIES


def test_each_peer_names_its_own_metrics_refresh_default() -> None:
    assert LlmDEpp.refresh_interval_s == 0.05  # DefaultRefreshMetricsInterval
    assert ProductionStackRoundRobin.refresh_interval_s == 15.0  # chart engineScrapeInterval
    assert ProductionStackPrefixAware.refresh_interval_s == 15.0
    assert DynamoKv.refresh_interval_s is None  # its cost reads no polled metrics


# llm-d's endpoint picker


def test_llm_d_scores_queue_kv_and_prefix_with_the_shipped_weights() -> None:
    holder = replica("holder", waiting=3, kv_usage=0.25)
    other = replica("other", waiting=1, kv_usage=0.0)
    # 9 of 10 hashes held (the model's block and 8 of 9 prompt blocks).
    scores = epp_scores([holder, other], {"holder": 9}, 10)
    assert scores == pytest.approx([2 * 0.0 + 2 * 0.75 + 3 * 0.9, 2 * 1.0 + 2 * 1.0 + 0.0])


def test_llm_d_sends_a_prompt_to_the_prefix_holder_despite_a_longer_queue() -> None:
    state = fleet(replica("holder", waiting=8), replica("other", waiting=0))
    policy = LlmDEpp(state)
    policy.indexer.add(block_keys(request(prefix_hashes=PROMPT)), "holder")
    assert chosen(policy, request(1, prefix_hashes=PROMPT)) == "holder"


def test_llm_d_leaves_the_prefix_holder_when_its_queue_is_longest_and_its_kv_fuller() -> None:
    # Holder: 0 (queue) + 2 x 0.4 (KV) + 3 (whole prefix) = 3.8; other: 2 + 2 + 0 = 4.
    state = fleet(replica("holder", waiting=8, kv_usage=0.6), replica("other", waiting=0))
    policy = LlmDEpp(state)
    policy.indexer.add(block_keys(request(prefix_hashes=PROMPT)), "holder")
    assert chosen(policy, request(1, prefix_hashes=PROMPT)) == "other"


def test_llm_d_records_the_chosen_endpoint_before_any_telemetry_arrives() -> None:
    state = fleet(replica("a"), replica("b"), replica("c"))
    policy = LlmDEpp(state)
    first = chosen(policy, request(1, prefix_hashes=PROMPT))
    assert {chosen(policy, request(n, prefix_hashes=PROMPT)) for n in range(2, 10)} == {first}


def test_llm_d_counts_the_model_block_for_any_endpoint_that_served_the_model() -> None:
    indexer = EppPrefixIndexer()
    indexer.add(block_keys(request(prefix_hashes=(1, 2, 3))), "a")
    assert indexer.match(block_keys(request(prefix_hashes=(7, 8, 9)))) == {"a": 1}


def test_llm_d_breaks_equal_scores_at_random() -> None:
    policy = LlmDEpp(fleet(replica("a"), replica("b"), replica("c")))
    assert len({chosen(policy, request(n)) for n in range(30)}) > 1


def test_llm_d_forgets_an_endpoints_least_recently_added_blocks_past_its_capacity() -> None:
    indexer = EppPrefixIndexer(capacity_per_server=3)
    keys = block_keys(request(prefix_hashes=(1, 2, 3)))  # model block + 3: one too many
    indexer.add(keys, "a")
    assert indexer.match(keys) == {}  # the model block went first, and the walk stops there


def test_llm_d_never_counts_one_tenants_prefix_for_another() -> None:
    state = fleet(replica("a"), replica("b"))
    policy = LlmDEpp(state)
    policy.indexer.add(block_keys(request(prefix_hashes=PROMPT)), "a")
    assert policy.indexer.match(block_keys(request(tenant="globex", prefix_hashes=PROMPT))) == {}


# production-stack


def test_production_stack_round_robin_cycles_through_endpoints_sorted_by_name() -> None:
    policy = ProductionStackRoundRobin(fleet(replica("b"), replica("c"), replica("a")))
    assert [chosen(policy, request(n)) for n in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_production_stack_round_robins_counter_survives_a_new_routing_table() -> None:
    state = fleet(replica("a"), replica("b"))
    assert chosen(ProductionStackRoundRobin(state), request(0)) == "a"
    republished = RouterState(
        [ModelRoute(MODEL, (DeploymentRoute("stable", "v1", 100),))],
        [replica("a"), replica("b")],
        prefix_index=state.prefix_index,
    )
    assert chosen(ProductionStackRoundRobin(republished), request(1)) == "b"


def test_production_stack_prefix_aware_sticks_to_the_holder_whatever_its_load() -> None:
    state = fleet(replica("a"), replica("b"), replica("c"))
    policy = ProductionStackPrefixAware(state)
    first = chosen(policy, request(0, prefix_hashes=PROMPT))
    state.update_telemetry(first, running=200, waiting=50, kv_usage=0.95, telemetry_at=NOW)
    forked = PROMPT[:40] + tuple(range(900, 924))
    assert {chosen(policy, request(n, prefix_hashes=forked)) for n in range(1, 8)} == {first}


def test_production_stack_prefix_aware_prefers_the_longest_matching_prefix() -> None:
    state = fleet(replica("a"), replica("b"))
    policy = ProductionStackPrefixAware(state)
    policy.trie.insert([("acme", h) for h in PROMPT[1:16:2]], "a")  # the first 16 blocks
    policy.trie.insert([("acme", h) for h in PROMPT[1:48:2]], "b")  # the first 48
    decision = policy.choose(request(1, prefix_hashes=PROMPT), NOW)
    assert decision.replica is not None and decision.replica.replica_id == "b"
    assert decision.cached_tokens == 48 * 16


def test_production_stack_prefix_aware_spreads_unseen_prompts_at_random() -> None:
    policy = ProductionStackPrefixAware(fleet(replica("a"), replica("b"), replica("c")))
    picks = {chosen(policy, request(n, prefix_hashes=(10 * n, 10 * n + 1))) for n in range(30)}
    assert picks == {"a", "b", "c"}


# Dynamo


def test_dynamos_cost_is_overlap_weighted_prefill_blocks_plus_decode_blocks() -> None:
    # 1,024 tokens in 16-token blocks, 48 of the 64 cached on the busy holder.
    busy = replica("busy", prefill_pending_tokens=512, inflight_prompt_tokens=3200)
    idle = replica("idle")
    # Busy: (512 + 1024 - 48 x 16) / 16 = 48 prefill blocks; 3200 / 16 + (64 - 48) = 216.
    assert dynamo_logit(busy, 1024, 64, 48, 16) == pytest.approx(48 + 216)
    # Idle: 1024 / 16 = 64 prefill blocks; 0 + 64 = 64 decode blocks.
    assert dynamo_logit(idle, 1024, 64, 0, 16) == pytest.approx(64 + 64)
    assert dynamo_logit(busy, 1024, 64, 48, 16, overlap_score_weight=2.0) == pytest.approx(
        2 * 48 + 216
    )


def test_dynamo_leaves_a_busy_prefix_holder_for_an_idle_worker() -> None:
    state = fleet(
        replica("holder", prefill_pending_tokens=512, inflight_prompt_tokens=3200),
        replica("idle"),
    )
    policy = DynamoKv(state)
    policy.indexer.route([("acme", h) for h in PROMPT[:48]], "holder", NOW)
    assert chosen(policy, request(1, prefix_hashes=PROMPT)) == "idle"


def test_dynamo_sends_a_prompt_to_a_lightly_loaded_prefix_holder() -> None:
    # Holder: 16 prefill + 16 decode blocks = 32 against the other's 128.
    state = fleet(replica("holder"), replica("other"))
    policy = DynamoKv(state)
    policy.indexer.route([("acme", h) for h in PROMPT[:48]], "holder", NOW)
    decision = policy.choose(request(1, prefix_hashes=PROMPT), NOW)
    assert decision.replica is not None and decision.replica.replica_id == "holder"
    assert decision.cached_tokens == 48 * 16


def test_dynamo_spreads_load_by_its_own_accounting_without_telemetry() -> None:
    state = fleet(replica("a"), replica("b"), replica("c"))
    policy = DynamoKv(state)
    picks = []
    for n in range(3):
        replica_id = chosen(policy, request(n))
        state.request_started(replica_id, 1024, NOW)
        picks.append(replica_id)
    assert sorted(picks) == ["a", "b", "c"]


def test_dynamo_breaks_a_tie_towards_the_smaller_tree() -> None:
    state = fleet(replica("big"), replica("small"))
    policy = DynamoKv(state)
    policy.indexer.route([("globex", h) for h in range(10)], "big", NOW)
    policy.indexer.route([("globex", h) for h in range(20, 22)], "small", NOW)
    assert chosen(policy, request(1)) == "small"


def test_dynamos_approximate_tree_forgets_blocks_after_the_ttl() -> None:
    indexer = ApproxKvIndexer()
    blocks = [("acme", h) for h in PROMPT]
    indexer.route(blocks, "a", NOW)
    assert indexer.overlaps(blocks, NOW + 119.0) == {"a": 64}
    assert indexer.overlaps(blocks, NOW + 121.0) == {}
    assert indexer.tree_sizes["a"] == 0


def test_dynamos_overlap_is_the_leading_run_each_worker_holds() -> None:
    indexer = ApproxKvIndexer()
    indexer.route([("acme", h) for h in PROMPT[:10]], "a", NOW)
    indexer.route([("acme", h) for h in PROMPT[:4]], "b", NOW)
    indexer.route([("acme", h) for h in PROMPT[5:20]], "c", NOW)  # not a prefix
    assert indexer.overlaps([("acme", h) for h in PROMPT], NOW) == {"a": 10, "b": 4}
