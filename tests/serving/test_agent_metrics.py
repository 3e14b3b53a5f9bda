"""Reading vLLM's /metrics: new and old KV metric names, counters, histograms, LoRA info."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.agent.metrics import parse_vllm_metrics

LABELS = {"model_name": "llama8", "engine": "0"}

# Written the way an older vLLM (before the rename) exposed it, by hand.
OLD_VLLM_TEXT = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="llama8"} 0.375
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama8"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama8"} 1.0
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of tokens.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="llama8"} 640.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of tokens.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="llama8"} 256.0
"""


def _new_vllm_text() -> str:
    """Written by prometheus_client itself, as vLLM does, so the suffixes are the real ones."""
    registry = CollectorRegistry()
    names = list(LABELS)
    Gauge("vllm:kv_cache_usage_perc", "KV use", names, registry=registry).labels(**LABELS).set(
        0.625
    )
    Gauge("vllm:num_requests_running", "running", names, registry=registry).labels(**LABELS).set(7)
    Gauge("vllm:num_requests_waiting", "waiting", names, registry=registry).labels(**LABELS).set(2)
    for name, value in (
        ("vllm:prefix_cache_queries", 1000),
        ("vllm:prefix_cache_hits", 400),
        ("vllm:prompt_tokens", 5000),
        ("vllm:generation_tokens", 1200),
        ("vllm:num_preemptions", 3),
    ):
        Counter(name, name, names, registry=registry).labels(**LABELS).inc(value)
    success = Counter(
        "vllm:request_success", "finished", [*names, "finished_reason"], registry=registry
    )
    success.labels(**LABELS, finished_reason="stop").inc(9)
    success.labels(**LABELS, finished_reason="length").inc(4)
    lora = Gauge(
        "vllm:lora_requests_info",
        "LoRA",
        ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        registry=registry,
    )
    lora.labels(max_lora="4", running_lora_adapters="", waiting_lora_adapters="").set(100.0)
    lora.labels(max_lora="4", running_lora_adapters="sql,chat", waiting_lora_adapters="").set(200.0)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "TTFT",
        names,
        buckets=(0.1, 0.5, 1.0),
        registry=registry,
    )
    for seconds in (0.05, 0.2, 0.3, 2.0):
        ttft.labels(**LABELS).observe(seconds)
    return generate_latest(registry).decode()


def test_it_reads_kv_cache_usage_under_the_new_name() -> None:
    assert parse_vllm_metrics(_new_vllm_text(), scraped_at=1.0)["kv_cache_usage_perc"] == 0.625


def test_it_reads_kv_cache_usage_under_the_old_name() -> None:
    assert parse_vllm_metrics(OLD_VLLM_TEXT, scraped_at=1.0)["kv_cache_usage_perc"] == 0.375


def test_it_reads_the_old_prefix_cache_counters() -> None:
    telemetry = parse_vllm_metrics(OLD_VLLM_TEXT, scraped_at=1.0)

    assert (telemetry["prefix_cache_queries_total"], telemetry["prefix_cache_hits_total"]) == (
        640,
        256,
    )


def test_it_reads_queue_gauges_and_counters_whose_families_lost_their_total_suffix() -> None:
    telemetry = parse_vllm_metrics(_new_vllm_text(), scraped_at=1.0)

    assert {
        key: telemetry[key]
        for key in (
            "num_requests_running",
            "num_requests_waiting",
            "prefix_cache_queries_total",
            "prefix_cache_hits_total",
            "prompt_tokens_total",
            "generation_tokens_total",
            "num_preemptions_total",
        )
    } == {
        "num_requests_running": 7,
        "num_requests_waiting": 2,
        "prefix_cache_queries_total": 1000,
        "prefix_cache_hits_total": 400,
        "prompt_tokens_total": 5000,
        "generation_tokens_total": 1200,
        "num_preemptions_total": 3,
    }


def test_it_counts_finished_requests_by_reason() -> None:
    telemetry = parse_vllm_metrics(_new_vllm_text(), scraped_at=1.0)

    assert telemetry["request_success_total"] == {"stop": 9, "length": 4}


def test_it_takes_running_adapters_from_the_newest_lora_info_series() -> None:
    telemetry = parse_vllm_metrics(_new_vllm_text(), scraped_at=1.0)

    assert (telemetry["running_lora_adapters"], telemetry["max_lora"]) == (["sql", "chat"], 4)


def test_it_keeps_ttft_as_a_cumulative_histogram() -> None:
    ttft = parse_vllm_metrics(_new_vllm_text(), scraped_at=1.0)["ttft_seconds"]

    assert ttft["count"] == 4
    assert abs(ttft["sum"] - 2.55) < 1e-9
    assert ttft["buckets"] == {"0.1": 1, "0.5": 3, "1.0": 3, "+Inf": 4}


def test_an_engine_that_has_served_nothing_reports_zeros_not_missing_keys() -> None:
    telemetry = parse_vllm_metrics(OLD_VLLM_TEXT, scraped_at=5.0)

    assert telemetry["inter_token_latency_seconds"] == {"sum": 0.0, "count": 0, "buckets": {}}
    assert telemetry["request_success_total"] == {}
    assert telemetry["scraped_at"] == 5.0
