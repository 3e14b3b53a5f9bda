"""The autoscaler policy: eager up, lazy down, warm buffer, bounds, forecast."""

from __future__ import annotations

import math

import pytest

from serving.capacity.autoscaler import (
    AutoscalerConfig,
    FleetSample,
    ReplicaBounds,
    daily_forecast,
    recommend,
)

CONFIG = AutoscalerConfig(target_running_per_replica=50.0)
WIDE = ReplicaBounds(1, 100)


def window(
    replicas: int, running_per_replica: float, now: float = 100.0, **kw: float
) -> list[FleetSample]:
    return [
        FleetSample(
            now - age,
            replicas,
            int(replicas * running_per_replica),
            0,
            kw.get("kv", 0.2),
            kw.get("ttft"),
        )
        for age in (40, 30, 20, 10, 0)
    ]


def test_it_scales_up_at_once_when_replicas_run_over_target() -> None:
    decision = recommend(window(4, 100), now_s=100, current=4, bounds=WIDE, config=CONFIG)
    assert decision.desired == 8  # twice the load; the step cap is x2
    assert decision.reason.startswith("up")


def test_the_warm_buffer_is_added_to_what_the_load_needs() -> None:
    decision = recommend(window(4, 50), now_s=100, current=4, bounds=WIDE, config=CONFIG)
    assert decision.desired == math.ceil(4 * (1 + CONFIG.warm_buffer))


def test_ttft_over_its_objective_scales_up_even_with_little_load() -> None:
    # ttft: the p95 of TTFT over each request's own objective; 2.0, missed twice over.
    decision = recommend(window(4, 5, ttft=2.0), now_s=100, current=4, bounds=WIDE, config=CONFIG)
    assert decision.desired == 8


def test_ttft_within_the_objectives_orders_nothing() -> None:
    decision = recommend(window(4, 5, ttft=0.8), now_s=100, current=4, bounds=WIDE, config=CONFIG)
    assert (decision.desired, decision.reason) == (4, "hold")


def test_a_fleet_whose_clock_ttft_is_not_ignores_it() -> None:
    # A disaggregated deployment's decode replicas never prefill.
    decode = AutoscalerConfig(target_running_per_replica=50.0, ttft_signal=False)
    decision = recommend(window(4, 5, ttft=2.0), now_s=100, current=4, bounds=WIDE, config=decode)
    assert (decision.desired, decision.reason) == (4, "hold")


def test_a_fleet_whose_signal_kv_is_not_ignores_kv_use() -> None:
    # A disaggregated deployment's prefill replicas: their KV waits for the decode side.
    prefill = AutoscalerConfig(target_running_per_replica=50.0, kv_target=None)
    decision = recommend(window(4, 5, kv=0.99), now_s=100, current=4, bounds=WIDE, config=prefill)
    assert (decision.desired, decision.reason) == (4, "hold")
    colocated = recommend(window(4, 5, kv=0.99), now_s=100, current=4, bounds=WIDE, config=CONFIG)
    assert colocated.reason == "up on kv"


def test_ttft_does_not_order_more_while_the_replicas_it_ordered_are_starting() -> None:
    # 4 ready, 4 starting: the slow first tokens are those of the fleet without the other 4.
    decision = recommend(
        window(4, 5, ttft=2.0), now_s=100, current=8, bounds=WIDE, config=CONFIG, starting=4
    )
    assert decision.desired == 8 and decision.reason == "hold"
    # Load still counts while they start: twice what 8 replicas carry asks for more.
    busy = recommend(
        window(4, 200, ttft=2.0), now_s=100, current=8, bounds=WIDE, config=CONFIG, starting=4
    )
    assert busy.desired == 16 and busy.reason == "up on load"
    # Once they are ready (or given up on: failed, never ready), the TTFT counts again.
    stuck = recommend(window(4, 5, ttft=3.0), now_s=100, current=8, bounds=WIDE, config=CONFIG)
    assert stuck.desired == 14 and stuck.reason == "up on ttft"


def test_it_does_not_scale_down_within_the_stabilization_window() -> None:
    recent = [(50.0, 10)]  # a busy recommendation 50 s ago
    decision = recommend(
        window(10, 5), now_s=100, current=10, bounds=WIDE, config=CONFIG, recent_raw=recent
    )
    assert decision.desired == 10


def test_it_scales_down_a_step_at_a_time_once_the_window_is_quiet() -> None:
    recent = [(100.0 - CONFIG.scale_down_stabilization_s - 1, 10)]
    decision = recommend(
        window(10, 5), now_s=100, current=10, bounds=WIDE, config=CONFIG, recent_raw=recent
    )
    assert decision.desired == 10 - CONFIG.max_step_down


def test_after_a_step_down_it_waits_for_a_window_taken_at_the_new_size() -> None:
    recent = [(100.0 - CONFIG.scale_down_stabilization_s - 1, 10)]
    # Just stepped 10 -> 8: the window still holds samples of the larger fleet, whose
    # requests ran faster, so its load understates what 8 replicas will see.
    mixed = window(10, 5)[:3] + window(8, 6)[3:]
    decision = recommend(mixed, now_s=100, current=8, bounds=WIDE, config=CONFIG, recent_raw=recent)
    assert decision.desired == 8 and decision.reason == "hold"
    settled = recommend(
        window(8, 6), now_s=100, current=8, bounds=WIDE, config=CONFIG, recent_raw=recent
    )
    assert settled.desired == 8 - CONFIG.max_step_down
    # A replica that never becomes ready does not pin the fleet: 7 of 8 ready, idle.
    short = recommend(
        window(7, 1), now_s=100, current=8, bounds=WIDE, config=CONFIG, recent_raw=recent
    )
    assert short.desired == 8 - CONFIG.max_step_down


def test_a_small_dip_inside_the_hysteresis_band_holds() -> None:
    # Load for 9.5 replicas with the buffer -> raw 10 of 11: within 10 %.
    recent = [(100.0 - CONFIG.scale_down_stabilization_s - 1, 10)]
    decision = recommend(
        window(11, 43), now_s=100, current=11, bounds=WIDE, config=CONFIG, recent_raw=recent
    )
    assert decision.desired == 11


def test_without_a_history_of_recommendations_it_does_not_scale_down() -> None:
    decision = recommend(window(10, 1), now_s=100, current=10, bounds=WIDE, config=CONFIG)
    assert decision.desired == 10


def test_it_never_leaves_the_pool_capacity() -> None:
    bounds = ReplicaBounds(1, 100, pool_capacity=5)
    decision = recommend(window(4, 200), now_s=100, current=4, bounds=bounds, config=CONFIG)
    assert decision.desired == 5


def test_a_forecast_is_a_floor() -> None:
    decision = recommend(window(2, 5), now_s=100, current=2, bounds=WIDE, config=CONFIG, forecast=6)
    assert decision.desired == 4  # up to the forecast, capped at x2 per step
    assert decision.reason == "up on forecast"
    # The history keeps what the signals asked for, not the forecast: no self-fulfilling peak.
    assert decision.raw == 6
    assert (
        decision.reactive
        == recommend(window(2, 5), now_s=100, current=2, bounds=WIDE, config=CONFIG).raw
    )
    assert decision.reactive < 6


def test_samples_older_than_the_window_are_ignored() -> None:
    stale = [FleetSample(0.0, 4, 1000, 500, 0.99, 5.0)]
    decision = recommend(stale, now_s=100, current=4, bounds=WIDE, config=CONFIG)
    assert decision.desired == 4
    assert decision.reason == "no telemetry"


def test_the_daily_forecast_reads_the_same_time_a_period_earlier() -> None:
    history = [(1000.0, 3), (1000.0 + 3600 * 0.5, 9)]
    forecast = daily_forecast(
        history, now_s=3600 + 1000 - 300, period_s=3600, lead_s=300, spread_s=60
    )
    assert forecast == 3


def test_the_window_must_be_thirty_to_sixty_seconds() -> None:
    with pytest.raises(ValueError, match="window_s"):
        AutoscalerConfig(window_s=10)
