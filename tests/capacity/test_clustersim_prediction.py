"""The router's predictions against what the engine model did, in the cluster simulator.

Shared system prompts are where cost-aware routing used to fail: prefix affinity packs a
prompt's requests onto its holder, and a prediction that counted each sequence's KV read as
the scraped KV use (shared blocks once) saw half the decode step it then got (TPOT p99 76 ms
against 50 ms; 81 % of interactive requests within both clocks on 8 H100, where least load
reached 100 %). Predicted with every sequence's whole context, the holder's TPOT is seen
coming.
"""

from __future__ import annotations

from bench.freshness import shared_prefix
from serving.clustersim import SimConfig, homogeneous, simulate, summarize
from serving.clustersim.report import format_summary, summary_rows
from serving.clustersim.workloads import poisson


def test_cost_aware_meets_both_clocks_on_shared_system_prompts_and_says_how_well_it_predicted() -> (
    None
):
    requests = shared_prefix(70, 25)
    config = SimConfig(policy="cost_aware", telemetry_interval_s=0.05)
    summary = summarize(simulate(homogeneous("H100-SXM-80GB", 8), requests, config))
    assert summary.tiers["interactive"].slo_attainment >= 0.99
    error = summary.prediction
    assert error is not None and error.requests == len(requests)
    # Within a few milliseconds at the median, and not one-sided: no longer under-predicted
    # for nearly every request.
    assert error.tpot_abs_p50_s < 0.005
    assert error.tpot_under_share < 0.9
    assert "router's prediction error" in format_summary(summary)


def test_the_prediction_error_is_reported_per_tier_as_well() -> None:
    # A tier gathered behind a deep queue can own the run's p99 alone: each tier's own
    # figures say which.
    requests = poisson(20, 30, seed=2)
    summary = summarize(simulate(homogeneous("L40S-48GB", 2), requests, SimConfig()))
    assert summary.prediction is not None
    per_tier = {name: figures.prediction for name, figures in summary.tiers.items()}
    assert all(error is not None for error in per_tier.values())
    assert sum(error.requests for error in per_tier.values() if error is not None) == (
        summary.prediction.requests
    )
    worst = max(e.ttft_abs_p99_s for e in per_tier.values() if e is not None)
    assert summary.prediction.ttft_abs_p99_s <= worst
    text = format_summary(summary)
    assert text.count("TTFT |err| p50/p99") == 1 + len(per_tier)
    rows = summary_rows(summary)
    assert all("prediction_ttft_abs_p50_s" in row for row in rows if row["scope"] != "all")
