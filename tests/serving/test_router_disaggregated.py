"""The disaggregated policy: a prefill and a decode replica chosen together, the KV transfer
in the TTFT prediction, and colocated replicas where they are predicted cheaper."""

from __future__ import annotations

import pytest

from serving.router import Reason, RouterConfig
from serving.router.contracts import DECODE, PREFILL, KvLink
from serving.router.disaggregated import Disaggregated
from tests.serving.test_router import H100, L40S, NOW, fleet, replica, request

IB = KvLink(gbytes_per_s=50, latency_s=1e-6)
CONFIG = RouterConfig()


def colocated_and_split_fleet() -> Disaggregated:
    """An H100 serving both phases, and an L40S prefilling for an H100 decoding."""
    return Disaggregated(
        fleet(
            replica("both", H100, kv_link=IB),
            replica("prefill", L40S, role=PREFILL, kv_link=IB),
            replica("decode", H100, role=DECODE, kv_link=IB),
        ),
        CONFIG,
    )


def h100_pair() -> Disaggregated:
    return Disaggregated(
        fleet(
            replica("prefill", H100, role=PREFILL, kv_link=IB),
            replica("decode", H100, role=DECODE, kv_link=IB),
        ),
        CONFIG,
    )


def test_a_short_prompt_stays_on_the_colocated_replica() -> None:
    decision = colocated_and_split_fleet().choose(request(prompt_tokens=300), NOW)
    assert decision.replica is not None and decision.replica.replica_id == "both"
    assert decision.prefill_replica is None
    assert decision.reason == Reason.CHEAPEST_MEETING_SLO


def test_a_long_prompt_prefills_on_the_cheaper_flops_and_decodes_on_the_h100() -> None:
    decision = colocated_and_split_fleet().choose(request(prompt_tokens=16_000, max_tokens=20), NOW)
    assert decision.reason == Reason.DISAGGREGATED
    assert decision.prefill_replica is not None
    assert decision.prefill_replica.replica_id == "prefill"
    assert decision.replica is not None and decision.replica.replica_id == "decode"


def test_the_kv_transfer_is_in_the_predicted_ttft() -> None:
    policy = h100_pair()
    decision = policy.choose(request(prompt_tokens=8000), NOW)
    # llama-3.1-8b bf16: 131072 KV bytes a token over 50 GB/s.
    assert decision.predicted_transfer_s == pytest.approx(1e-6 + 8000 * 131072 / 50e9)
    slow = Disaggregated(
        fleet(
            replica("prefill", H100, role=PREFILL, kv_link=KvLink(1.0, 1e-6)),
            replica("decode", H100, role=DECODE, kv_link=IB),
        ),
        CONFIG,
    ).choose(request(prompt_tokens=8000), NOW)
    assert slow.predicted_transfer_s == pytest.approx(1e-6 + 8000 * 131072 / 1e9)
    assert slow.predicted_ttft_s is not None and decision.predicted_ttft_s is not None
    gap = slow.predicted_ttft_s - decision.predicted_ttft_s
    assert gap == pytest.approx(slow.predicted_transfer_s - decision.predicted_transfer_s)


def test_a_colocated_replica_slowed_by_other_prompts_loses_a_long_prompt_to_a_pair() -> None:
    both = replica("both", H100, kv_link=IB, running=64, prompt_rate=30_000.0, prompt_rate_at=NOW)
    policy = Disaggregated(
        fleet(
            both,
            replica("prefill", H100, role=PREFILL, kv_link=IB),
            replica("decode", H100, role=DECODE, kv_link=IB, running=64),
        ),
        CONFIG,
    )
    decision = policy.choose(request(tier="interactive", prompt_tokens=6000), NOW)
    # Others' prefill takes most of the colocated replica's time: its TPOT misses 50 ms.
    assert decision.reason == Reason.DISAGGREGATED
    assert decision.predicted_tpot_s is not None and decision.predicted_tpot_s < 0.04


def test_a_decode_replica_without_kv_room_for_the_request_is_not_chosen() -> None:
    policy = Disaggregated(
        fleet(
            replica("prefill", H100, role=PREFILL, kv_link=IB),
            replica("full", H100, role=DECODE, kv_link=IB, kv_usage=0.999),
            replica("roomy", H100, role=DECODE, kv_link=IB, running=20, kv_usage=0.5),
        ),
        CONFIG,
    )
    decision = policy.choose(request(prompt_tokens=8000), NOW)
    assert decision.replica is not None and decision.replica.replica_id == "roomy"


def test_replicas_without_a_kv_link_are_never_paired() -> None:
    policy = Disaggregated(
        fleet(replica("prefill", H100, role=PREFILL), replica("decode", H100, role=DECODE)),
        CONFIG,
    )
    assert policy.choose(request(), NOW).replica is None


def test_the_prefix_is_recorded_against_the_replica_that_prefilled_it() -> None:
    policy = h100_pair()
    policy.choose(request(prompt_tokens=4000, prefix_hashes=(1, 2, 3)), NOW)
    matches = policy.state.prefix_index.longest_matches("acme", (1, 2, 3))
    assert matches == {"prefill": 3}
