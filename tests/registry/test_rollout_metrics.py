"""The Redis layout the gateway writes and the controller reads: exact windows, close p99s."""

from __future__ import annotations

import random

import redis

from registry.rollout_metrics import (
    RedisRolloutMetrics,
    exact_quantile,
    output_length_bucket,
    record_request,
)


def test_a_window_counts_only_what_came_after_its_mark(redis_client: redis.Redis) -> None:
    source = RedisRolloutMetrics(redis_client)
    for _ in range(30):
        record_request(redis_client, 7, ok=True, ttft_s=0.1, output_tokens=50, finish_reason="stop")
    mark = source.mark(7)
    for i in range(20):
        record_request(
            redis_client,
            7,
            ok=i % 4 != 0,
            ttft_s=0.1,
            output_tokens=50,
            finish_reason="length",
            refused=i == 1,
        )
    window = source.window_stats(7, mark)
    assert (window.requests, window.errors, window.refusals) == (20, 5, 1)
    assert dict(window.finish_reasons) == {"length": 15}
    assert sum(window.output_lengths.values()) == 15


def test_p99_from_the_buckets_is_within_five_percent_of_the_exact_one(
    redis_client: redis.Redis,
) -> None:
    rng = random.Random(4)
    ttfts = [rng.lognormvariate(-1.5, 0.5) for _ in range(2000)]
    for ttft in ttfts:
        record_request(redis_client, 8, ok=True, ttft_s=ttft, output_tokens=10)
    window = RedisRolloutMetrics(redis_client).window_stats(8, {})
    exact = exact_quantile(ttfts, 0.99)
    assert exact is not None and window.ttft_p99_s is not None
    assert abs(window.ttft_p99_s - exact) / exact < 0.05


def test_output_lengths_are_exact_when_short_and_bucketed_when_long() -> None:
    assert output_length_bucket(7) == 7
    assert output_length_bucket(1000) >= 1000
    assert output_length_bucket(1000) < 1200


def test_a_window_survives_the_hash_expiring_under_it(redis_client: redis.Redis) -> None:
    source = RedisRolloutMetrics(redis_client)
    for _ in range(10):
        record_request(redis_client, 9, ok=True, output_tokens=5)
    mark = source.mark(9)
    redis_client.delete("registry:rollout:stats:9")
    for _ in range(3):
        record_request(redis_client, 9, ok=True, output_tokens=5)
    assert source.window_stats(9, mark).requests == 3
