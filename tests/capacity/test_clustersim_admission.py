"""The gateways' admission queues in the cluster simulator: a request the router advises
waiting is held as the product's gateway holds it (`Gateway.wait_in_queue`), and a looser
tier's request waits out a queue a tighter tier cannot bear (`RouterConfig.defer_looser_after`)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from serving.clustersim import homogeneous, simulate, summarize
from serving.clustersim.families import FAMILIES
from serving.clustersim.simulator import REFUSED, SimConfig, SimResult
from serving.clustersim.workloads import LengthClass, LengthMix, poisson
from serving.gateway.service import GatewayConfig
from serving.router import RouterConfig

H100 = "H100-SXM-80GB"
DEFERRED = SimConfig(router=RouterConfig(defer_looser_after=0.5))


def bursty(seconds: float = 30.0) -> SimResult:
    return simulate(homogeneous(H100, 4), FAMILIES["bursty"].generate(duration_s=seconds), DEFERRED)


def test_the_simulated_queue_is_the_gateways() -> None:
    gateway = {f.name: f.default for f in fields(GatewayConfig)}
    sim = SimConfig()
    for name in ("queue_max", "queue_aging_s", "queue_timeout_s"):
        assert getattr(sim, name) == gateway[name], name
    assert SimConfig().holds_advised and not SimConfig(policy="dynamo_kv").holds_advised
    with pytest.raises(ValueError, match="admission queue"):
        SimConfig(queue_max=0)


def test_a_held_request_counts_its_wait_in_its_ttft_and_the_router_learns_from_the_send() -> None:
    result = bursty()
    held = [r for r in result.records if r.queued_s is not None and r.first_token_s is not None]
    assert held, "bursts over four H100s hold some requests"
    for record in held:
        assert record.request.arrival_s <= record.queued_s <= record.sent_s  # type: ignore[operator]
        waited = record.sent_s - record.request.arrival_s  # type: ignore[operator]
        assert record.ttft_s == pytest.approx(record.sent_ttft_s + waited)  # type: ignore[operator]
    assert summarize(result).held == len([r for r in result.records if r.queued_s is not None])


def test_deferring_the_looser_tiers_through_a_burst_keeps_interactive_within_both_clocks() -> None:
    """Bursty over four H100s, 30 s: sent at once, the standard and batch requests of a burst
    queue in the engines ahead of interactive ones; held at the gateways while a queue past
    half of interactive's TTFT stands, they go after it, each within its tier's deferral and
    a telemetry refresh, and none is refused."""
    requests = FAMILIES["bursty"].generate(duration_s=30.0)
    fleet = homogeneous(H100, 4)
    deferred = simulate(fleet, requests, DEFERRED)
    sent = simulate(fleet, requests)
    with_deferral, without = summarize(deferred), summarize(sent)
    assert with_deferral.tiers["interactive"].slo_attainment >= 0.99
    assert without.tiers["interactive"].slo_attainment < 0.97
    assert with_deferral.refused == 0
    router = DEFERRED.router
    refresh = DEFERRED.scrape_interval_s
    looser = [
        r for r in deferred.records if r.queued_s is not None and r.request.tier != "interactive"
    ]
    assert looser
    for record in looser:
        held = record.sent_s - record.queued_s  # type: ignore[operator]
        assert held <= router.deferral_s(record.request.tier) + refresh + 1e-9
    # Every tier is still served, within the benchmark's 30 s.
    assert all(t.ttft_p99_s < 30.0 for t in with_deferral.tiers.values())


def test_an_overloaded_gateway_refuses_past_its_queue_and_its_wait_limit() -> None:
    """One H100 under twice what it can carry, interactive only: the router advises waiting,
    the queue fills (429) and its waiters time out (503), as the gateway answers."""
    lengths = LengthMix(classes=(LengthClass(1.0, 2000, 100),))
    requests = [
        replace(r, tier="interactive") for r in poisson(80.0, 20.0, lengths=lengths, seed=2)
    ]
    result = simulate(homogeneous(H100, 1), requests, SimConfig(queue_max=16, queue_timeout_s=2.0))
    failed = {r.failed for r in result.records if r.failed}
    assert failed == set(REFUSED)
    summary = summarize(result)
    assert summary.refused == summary.failed > 0
    for record in result.records:
        if record.failed == "queue_timeout":
            assert record.sent_s is None and record.first_token_s is None
    # No queue (as the peers ship): nothing refused, nothing held.
    plain = simulate(homogeneous(H100, 1), requests, SimConfig(admission_queue=False))
    assert not any(r.failed or r.queued_s is not None for r in plain.records)


def test_the_peers_routers_hold_nothing() -> None:
    result = simulate(
        homogeneous(H100, 4),
        FAMILIES["bursty"].generate(duration_s=20.0),
        SimConfig(policy="dynamo_kv"),
    )
    assert not any(r.queued_s is not None for r in result.records)
