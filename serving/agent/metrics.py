"""Reading a replica's Prometheus `/metrics` text into the telemetry the heartbeat carries.

Samples are matched by their full sample name, not their family: the parser strips `_total` from
counter families, and an exposition without `# TYPE` lines yields "unknown" families named
after the sample, so sample names are the one spelling that holds across both."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (production-stack #617), and its V1
# engine briefly called the prefix counters gpu_prefix_cache_*: each tuple is newest first.
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")

HISTOGRAMS: dict[str, str] = {
    "ttft_seconds": "vllm:time_to_first_token_seconds",
    "inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "request_queue_time_seconds": "vllm:request_queue_time_seconds",
}


class _Samples:
    """Every sample of one scrape, grouped by sample name."""

    def __init__(self, text: str) -> None:
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.by_name[sample.name].append((dict(sample.labels), float(sample.value)))

    def total(self, *names: str) -> float:
        """Summed over series (one per model_name/engine), from the first name present."""
        for name in names:
            if name in self.by_name:
                return sum(value for _, value in self.by_name[name])
        return 0.0

    def highest(self, *names: str) -> float:
        for name in names:
            if name in self.by_name:
                return max(value for _, value in self.by_name[name])
        return 0.0

    def by_label(self, name: str, label: str) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for labels, value in self.by_name.get(name, []):
            totals[labels.get(label, "")] += value
        return dict(totals)

    def histogram(self, name: str) -> dict[str, Any]:
        buckets: dict[str, float] = defaultdict(float)
        for labels, value in self.by_name.get(f"{name}_bucket", []):
            buckets[labels.get("le", "+Inf")] += value
        return {
            "sum": self.total(f"{name}_sum"),
            "count": _count(self.total(f"{name}_count")),
            "buckets": {le: _count(v) for le, v in sorted(buckets.items(), key=_bucket_order)},
        }

    def lora_info(self) -> tuple[list[str], int]:
        """Running adapters and max_lora from `vllm:lora_requests_info`, whose value is the
        time it was last set: only the newest series describes the engine now."""
        series = self.by_name.get("vllm:lora_requests_info", [])
        if not series:
            return [], 0
        labels, _ = max(series, key=lambda item: item[1])
        running = [name for name in labels.get("running_lora_adapters", "").split(",") if name]
        max_lora = labels.get("max_lora", "0")
        return running, int(float(max_lora)) if max_lora else 0


def parse_vllm_metrics(text: str, scraped_at: float) -> dict[str, Any]:
    """The heartbeat's `telemetry` object for one replica, from its `/metrics` text."""
    samples = _Samples(text)
    running_adapters, max_lora = samples.lora_info()
    telemetry: dict[str, Any] = {
        "num_requests_running": _count(samples.total("vllm:num_requests_running")),
        "num_requests_waiting": _count(samples.total("vllm:num_requests_waiting")),
        "kv_cache_usage_perc": samples.highest(*KV_CACHE_USAGE),
        "prefix_cache_queries_total": _count(samples.total(*PREFIX_QUERIES)),
        "prefix_cache_hits_total": _count(samples.total(*PREFIX_HITS)),
        "prompt_tokens_total": _count(samples.total("vllm:prompt_tokens_total")),
        "generation_tokens_total": _count(samples.total("vllm:generation_tokens_total")),
        "num_preemptions_total": _count(samples.total("vllm:num_preemptions_total")),
        "request_success_total": {
            reason: _count(value)
            for reason, value in samples.by_label(
                "vllm:request_success_total", "finished_reason"
            ).items()
        },
        "running_lora_adapters": running_adapters,
        "max_lora": max_lora,
        "scraped_at": scraped_at,
    }
    for key, name in HISTOGRAMS.items():
        telemetry[key] = samples.histogram(name)
    return telemetry


def _count(value: float) -> int:
    return round(value)


def _bucket_order(item: tuple[str, float]) -> float:
    return float(item[0])
