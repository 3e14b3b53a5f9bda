"""N gateways in the cluster simulator: each with its own in-flight counts and prefix index
over the same scraped telemetry (ours telling each other of both, peers' apart); one
gateway routes as the single-gateway simulator did; the telemetry interval may be the
policy's own."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest

from serving.capacity.autoscaler import AutoscalerConfig
from serving.clustersim import (
    AutoscaleBounds,
    FleetSpec,
    LengthClass,
    LengthMix,
    PoolSpec,
    SimConfig,
    SimRequest,
    SimResult,
    bursty,
    homogeneous,
    poisson,
    simulate,
    summarize,
)
from serving.clustersim.__main__ import main as cli_main
from serving.clustersim.families import FAMILIES
from serving.clustersim.fleet import disaggregated
from serving.clustersim.simulator import DEFAULT_REFRESH_INTERVAL_S
from serving.router import POLICIES, Decision, LeastLoad, RouterConfig, RouteRequest, RouterState

MIXED = FleetSpec(pools=(PoolSpec("h100", "H100-SXM-80GB", 2), PoolSpec("l40s", "L40S-48GB", 2)))
LONG = LengthMix((LengthClass(1.0, 6000, 100),))


def burst(seed: int = 4) -> list[SimRequest]:
    return bursty(6, 90, burst_rate_per_s=40, burst_every_s=30, burst_length_s=10, seed=seed)


def digest(result: SimResult) -> str:
    """Where and when every request ran, and every scaling decision, to the microsecond."""
    rows: list[object] = [
        (
            r.request.request_id,
            r.replica_id,
            r.prefill_replica_id,
            r.failed,
            None if r.first_token_s is None else round(r.first_token_s, 6),
            None if r.finished_s is None else round(r.finished_s, 6),
        )
        for r in result.records
    ]
    rows.append(
        tuple((round(t, 6), pool, desired) for t, pool, desired, _ in result.scaling_events)
    )
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


# Digests of these runs taken from the simulator before it had gateways (one router state).
# cost_aware's was taken again when its TPOT prediction learned the KV each decode step
# reads (serving/router/predict.py), after the gateways had been checked against the old one,
# and again when its prefix discount and near-tie choice learned to weigh TPOT too, and when
# the prompt-rate time constant fell from 20 s to 5 s, when the TPOT prediction learned
# that decodes ride in mixed steps, and when cost-aware learned to keep the decode of the
# requests already on a replica within their TPOT objectives. All but the disaggregated
# run's were taken again when the simulator stopped telling the router of a first token or
# a finish before it happened (an engine step begun before an arrival and ending after it).
# cost_aware's again when batch requests were routed with a bound on their wait
# (`RouterConfig.untimed_ttft_s`) instead of meeting on every replica, and when the L40S
# engines took vLLM's own prefill budget for their GPU (2048 tokens a step, not 8192), and
# when the router's steps learned to compute while they read the weights
# (`ReplicaPerf.compute_base_s`), and when a request missing everywhere took the cheapest
# replica instead of one within 1.5 times its least miss (this mixed fleet overloads), and
# when a looser tier meeting only where a tighter one decodes took a cheaper replica it
# still meets on instead, and when a looser tier on the least-bad path kept to the
# replicas where it would still meet its own objectives before any holder of its prefix
# where it would miss, and when the TTFT prediction stopped counting the prompt chunk of the
# step under way twice, and when it stopped counting the prompts queued there among the
# decodes they wait behind and learned each replica's TTFT scale at its first tokens
# (`ReplicaState.ttft_scale`), and when the TTFT margin went to 0.9 while TPOT's stayed
# at 0.8 (`RouterConfig.ttft_margin`); and when the simulator held the requests the router
# advises queueing in the gateway's admission queue, as the gateway does, it held none of
# this run's requests: the run with the queue and without ("cost_aware_sent") are the one
# before. The runs keep that budget (`max_num_batched_tokens="vllm"`): the
# platform's smaller one is an engine flag, not a gateway change, and has its own tests
# (test_step_budget).
SINGLE_GATEWAY_RUNS = {
    "cost_aware": (
        MIXED,
        lambda: poisson(12, 60, seed=3),
        SimConfig(),
        "6588eed981347bca",
    ),
    "cost_aware_sent": (
        MIXED,
        lambda: poisson(12, 60, seed=3),
        SimConfig(admission_queue=False),
        "6588eed981347bca",
    ),
    "least_load": (
        homogeneous("H100-SXM-80GB", 3),
        lambda: bursty(6, 90, burst_rate_per_s=30, burst_every_s=30, burst_length_s=10, seed=4),
        SimConfig(policy="least_load"),
        "842c1700c22929f7",
    ),
    "autoscaled": (
        FleetSpec(pools=(PoolSpec("h100", "H100-SXM-80GB", 1, autoscale=AutoscaleBounds(1, 4)),)),
        lambda: poisson(15, 120, seed=5),
        SimConfig(
            policy="least_load",
            autoscaler=AutoscalerConfig(target_running_per_replica=16.0),
            cold_start_s=20.0,
        ),
        "952f268455d0d01c",
    ),
    "disaggregated": (
        disaggregated("H100-SXM-80GB", 1, "H100-SXM-80GB", 1),
        lambda: poisson(3, 40, lengths=LONG, seed=1),
        SimConfig(policy="disaggregated"),
        "ca0bb42e7fec27a2",
    ),
}


@pytest.mark.parametrize("case", sorted(SINGLE_GATEWAY_RUNS))
def test_one_gateway_routes_exactly_as_the_single_router_simulator_did(case: str) -> None:
    fleet, requests, config, expected = SINGLE_GATEWAY_RUNS[case]
    assert config.gateways == 1 and config.telemetry_interval_s == 2.0
    fleet = replace(fleet, max_num_batched_tokens="vllm")
    assert digest(simulate(fleet, requests(), config)) == expected


def test_the_same_seed_gives_the_same_run_with_many_gateways() -> None:
    config = SimConfig(policy="cost_aware", gateways=4, telemetry_interval_s=0.5)
    requests = poisson(12, 40, seed=6)
    assert digest(simulate(MIXED, requests, config)) == digest(simulate(MIXED, requests, config))


def test_arrivals_are_dealt_round_robin_to_the_gateways() -> None:
    requests = poisson(8, 20, seed=2)
    result = simulate(MIXED, requests, SimConfig(gateways=3))
    by_id = {r.request.request_id: r for r in result.records}
    assert [by_id[r.request_id].gateway for r in requests] == [i % 3 for i in range(len(requests))]


def test_sixteen_gateways_on_stale_telemetry_balance_a_burst_worse_than_one() -> None:
    fleet = homogeneous("H100-SXM-80GB", 4)
    requests = burst()
    one, sixteen = (
        summarize(
            simulate(
                fleet,
                requests,
                SimConfig(
                    policy="least_load", gateways=n, telemetry_interval_s=2, share_inflight=False
                ),
            )
        )
        for n in (1, 16)
    )
    # One gateway counts every request it sent since the last scrape; each of sixteen that
    # do not tell each other sees a sixteenth of them and herds onto the replica that looked idle two seconds ago.
    assert sixteen.ttft_p99_s > 1.5 * one.ttft_p99_s
    assert sixteen.tiers["interactive"].slo_attainment < one.tiers["interactive"].slo_attainment


def test_cost_aware_gateways_that_share_their_counts_keep_a_burst_within_the_slo() -> None:
    # At vLLM's own 8192-token steps a herded replica's queued prompts stall its decodes
    # hardest; at the platform's 1024 the unaware gateways lose 3 points of the SLO, not 5+.
    fleet = replace(homogeneous("H100-SXM-80GB", 4), max_num_batched_tokens="vllm")
    requests = burst()
    one, unaware, counting, sharing = (
        summarize(
            simulate(
                fleet,
                requests,
                SimConfig(
                    gateways=n, telemetry_interval_s=2, count_gateways=count, share_inflight=share
                ),
            )
        )
        .tiers["interactive"]
        .slo_attainment
        for n, count, share in (
            (1, True, None),
            (16, False, False),
            (16, True, False),
            (16, True, None),
        )
    )
    # Each of sixteen alone sees a sixteenth of what was sent there (98.18 % against one
    # gateway's 99.62); taking its own sixteen times it stops packing a replica the others
    # are packing too (98.71); told of every request 5 ms late, it routes as one gateway
    # does (99.70). Each gateway's TTFT scale, learned from its own first tokens, finds
    # part of what the unaware ones do not see (95.00, 99.62, 98.33 and 99.70 before it;
    # 97.80, 99.70, 98.41 and 99.62 with it, before the TTFT margin went to 0.9). Since the
    # gateways hold what the router advises queueing, taking its own sixteen times
    # over-predicts the queues: the gateways hold 391 requests, each waiting for one of its
    # own few finishes or a refresh, and keep 85.83 %; sending them at once keeps 98.71.
    assert unaware < one - 0.01
    assert sharing >= one - 0.01 and sharing > unaware and sharing > counting
    sent = summarize(
        simulate(
            fleet,
            requests,
            SimConfig(
                gateways=16, telemetry_interval_s=2, share_inflight=False, admission_queue=False
            ),
        )
    )
    assert sent.tiers["interactive"].slo_attainment > unaware + 0.005 > counting


def test_each_gateway_counts_the_tpot_objectives_in_flight_on_its_own_copy() -> None:
    # The gateways' copies of a replica once shared one dict of objectives in flight: every
    # start was counted once per gateway, and the tightest objective stayed on every copy
    # but the one that saw its count reach zero, after the requests had gone.
    result = simulate(homogeneous("H100-SXM-80GB", 2), burst(), SimConfig(gateways=4))
    assert all(record.finished_s is not None for record in result.records)
    for replica in result.replicas:
        objectives = [state.inflight_tpot_objectives for state in replica.states]
        assert len({id(counts) for counts in objectives}) == 4
        assert objectives == [{}, {}, {}, {}]
        assert [state.tightest_tpot_s for state in replica.states] == [math.inf] * 4


def test_gateways_that_share_their_prefix_index_keep_a_shared_document_on_one_replica() -> None:
    spec = FAMILIES["rag"]
    requests = spec.generate(seed=spec.seed, rate=spec.rate_per_s, duration_s=10.0)
    fleet = homogeneous("H100-SXM-80GB", 6)

    def cached_share(config: SimConfig) -> float:
        records = simulate(fleet, requests, config).records
        prompt = sum(r.request.prompt_tokens for r in records)
        return sum(r.request.prompt_tokens - r.prefill_tokens for r in records) / prompt

    one = cached_share(SimConfig())
    apart = cached_share(SimConfig(gateways=16, share_prefix_index=False))
    shared = cached_share(SimConfig(gateways=16))  # ours share it by default
    # Each of sixteen alone sends a document wherever its own index says (0.43 -> 0.19 of
    # the prompt tokens expected cached); one index keeps most of one gateway's (0.35).
    assert apart < 0.6 * one
    assert shared > 1.5 * apart
    assert SimConfig(gateways=16, policy="dynamo_kv").shares_prefix_index is False  # as shipped


def test_fresh_telemetry_hides_most_of_what_the_gateways_do_not_know() -> None:
    fleet = homogeneous("H100-SXM-80GB", 4)
    requests = burst()
    stale, fresh = (
        summarize(
            simulate(
                fleet,
                requests,
                SimConfig(
                    policy="least_load", gateways=16, telemetry_interval_s=t, share_inflight=False
                ),
            )
        )
        for t in (2.0, 0.05)
    )
    assert fresh.ttft_p99_s < stale.ttft_p99_s


@pytest.mark.parametrize(
    ("fleet", "requests", "config"),
    [
        (MIXED, lambda: poisson(12, 40, seed=3), SimConfig(policy="cost_aware", gateways=4)),
        (
            homogeneous("H100-SXM-80GB", 3),
            burst,
            SimConfig(policy="weighted_scorer", gateways=5, telemetry_interval_s=0.1),
        ),
        (
            disaggregated("H100-SXM-80GB", 1, "H100-SXM-80GB", 1),
            lambda: poisson(3, 30, lengths=LONG, seed=1),
            SimConfig(policy="disaggregated", gateways=3),
        ),
        (
            FleetSpec(
                pools=(PoolSpec("h100", "H100-SXM-80GB", 1, autoscale=AutoscaleBounds(1, 4)),)
            ),
            lambda: poisson(15, 90, seed=5),
            SimConfig(
                policy="least_load",
                gateways=4,
                autoscaler=AutoscalerConfig(target_running_per_replica=16.0),
                cold_start_s=20.0,
            ),
        ),
    ],
    ids=["cost_aware", "weighted_scorer", "disaggregated", "autoscaled"],
)
def test_every_gateways_in_flight_counts_return_to_zero_after_a_run(
    fleet: FleetSpec, requests: object, config: SimConfig
) -> None:
    assert callable(requests)
    result = simulate(fleet, requests(), config)
    assert all(r.finished_s is not None for r in result.records)
    for replica in result.replicas:
        assert len(replica.states) == config.gateways
        for state in replica.states:
            counts = (
                state.inflight,
                state.inflight_prompt_tokens,
                state.prefill_pending_tokens,
                state.unsynced,
                state.unsynced_prefill_tokens,
            )
            assert counts == (0, 0, 0, 0, 0)


def test_a_request_is_counted_only_by_the_gateway_that_routed_it_where_counts_are_not_shared() -> (
    None
):
    result = simulate(MIXED, poisson(6, 30, seed=8), SimConfig(gateways=4, share_inflight=False))
    # `prompt_rate_at` moves only when the gateway starts a request with prefill work there.
    for replica in result.replicas:
        for gateway, state in enumerate(replica.states):
            started = [
                sent
                for r in result.records
                if r.gateway == gateway and r.replica_id == replica.replica_id and r.prefill_tokens
                if (sent := r.sent_s) is not None
            ]
            assert state.prompt_rate_at == max(started, default=0.0)
    assert len({r.gateway for r in result.records}) == 4


def test_shared_counts_reach_the_other_gateways_after_the_sync_delay() -> None:
    config = SimConfig(gateways=4, inflight_sync_delay_s=0.02)
    assert config.shares_inflight and not SimConfig(gateways=4, policy="dynamo_kv").shares_inflight
    result = simulate(MIXED, poisson(6, 30, seed=8), config)
    for replica in result.replicas:
        for gateway, state in enumerate(replica.states):
            started = [
                r.request.arrival_s + (0.0 if r.gateway == gateway else 0.02)
                for r in result.records
                if r.replica_id == replica.replica_id and r.prefill_tokens
            ]
            assert state.prompt_rate_at == pytest.approx(max(started, default=0.0))
            assert (state.unsynced, state.unsynced_prefill_tokens) == (0, 0)


def test_every_gateway_sees_every_scrape() -> None:
    result = simulate(MIXED, poisson(6, 30, seed=8), SimConfig(gateways=3))
    for replica in result.replicas:
        assert len({state.telemetry_at for state in replica.states}) == 1
        assert replica.states[0].telemetry_at == result.timeline[-1].at_s


class FreshLeastLoad:
    """Least load with a refresh interval of its own. A policy is any class with `choose`; a
    wrapper rather than a subclass, since the router's compiled build cannot be subclassed."""

    name = "fresh_least_load"
    refresh_interval_s = 0.25

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self._least_load = LeastLoad(state, config)

    def choose(self, request: RouteRequest, now: float) -> Decision:
        return self._least_load.choose(request, now)


def test_no_telemetry_interval_means_the_policys_own_refresh_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(POLICIES, FreshLeastLoad.name, FreshLeastLoad)
    config = SimConfig(policy=FreshLeastLoad.name, telemetry_interval_s=None)
    assert config.scrape_interval_s == 0.25
    result = simulate(homogeneous("H100-SXM-80GB", 2), poisson(4, 5, seed=1), config)
    gaps = {
        round(b.at_s - a.at_s, 9)
        for a, b in zip(result.timeline, result.timeline[1:], strict=False)
    }
    assert gaps == {0.25}
    assert replace(config, telemetry_interval_s=0.5).scrape_interval_s == 0.5


def test_our_policies_without_an_interval_scrape_every_two_seconds() -> None:
    assert DEFAULT_REFRESH_INTERVAL_S == 2.0
    for policy in ("least_load", "cost_aware", "disaggregated"):
        assert SimConfig(policy=policy, telemetry_interval_s=None).scrape_interval_s == 2.0


def test_nonsense_gateways_and_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="gateways must be at least 1"):
        SimConfig(gateways=0)
    with pytest.raises(ValueError, match="telemetry_interval_s must be positive"):
        SimConfig(telemetry_interval_s=0.0)
    with pytest.raises(ValueError, match="inflight_sync_delay_s must be at least 0"):
        SimConfig(inflight_sync_delay_s=-0.001)


def test_the_cli_takes_gateways_and_a_telemetry_interval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--workload", "poisson", "--rate", "4", "--duration", "10"]
    argv += ["--fleet", "H100-SXM-80GB:2", "--policy", "least_load"]
    assert cli_main([*argv, "--gateways", "4", "--telemetry-interval", "0.5"]) == 0
    assert "least_load on 2x H100-SXM-80GB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main([*argv, "--gateways", "0"])


def test_each_gateway_learns_its_replicas_ttft_scale_from_its_own_first_tokens() -> None:
    """The simulator tells the routing gateway, at each first token, what the engine did
    against what it predicted (`RouterState.observe_ttft`): the replicas' scales move from
    1, differently on each gateway's copy, and stay at 1 with the calibration off."""
    fleet = replace(homogeneous("H100-SXM-80GB", 4), max_num_batched_tokens="vllm")
    requests = burst()
    learned = simulate(fleet, requests, SimConfig(gateways=4, telemetry_interval_s=2))
    scales = [[copy.ttft_scale for copy in replica.states] for replica in learned.replicas]
    assert all(len(copies) == 4 for copies in scales)
    assert any(scale != 1.0 for copies in scales for scale in copies)
    assert any(len(set(copies)) > 1 for copies in scales)
    low, high = RouterConfig().ttft_scale_bounds
    assert all(low <= scale <= high for copies in scales for scale in copies)
    off = SimConfig(gateways=4, telemetry_interval_s=2, router=RouterConfig(ttft_quantile=None))
    unlearned = simulate(fleet, requests, off)
    assert {copy.ttft_scale for replica in unlearned.replicas for copy in replica.states} == {1.0}
