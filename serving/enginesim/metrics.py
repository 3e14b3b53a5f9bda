"""vLLM's Prometheus metrics, same names, labels and buckets, in a private registry."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.engine.core import LOCAL_COMPUTE, PROMPT_TOKEN_SOURCES, Engine

LABELS = ["model_name", "engine"]
# The finished_reason values vLLM exports (vllm/v1/metrics/loggers.py), all created at start.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile reads alike on both.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


class EngineMetrics:
    def __init__(self, model_name: str, max_loras: int) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": "0"}
        self.max_loras = max_loras
        r = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the batch.", LABELS, registry=r
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting.", LABELS, registry=r)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage, 0..1.", LABELS, registry=r
        )
        # The pre-v0.10 name; the platform reads both, so both are served.
        self.gpu_cache = Gauge(
            "vllm:gpu_cache_usage_perc", "KV cache usage, 0..1.", LABELS, registry=r
        )
        # vLLM's has no model_name or engine label.
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", LABELS, registry=r
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", LABELS, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", LABELS, registry=r
        )
        # vLLM's PromptTokenStats: every prompt token once, by where its KV came from.
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*LABELS, "source"],
            registry=r,
        )
        for source in PROMPT_TOKEN_SOURCES:
            self.prompt_tokens_by_source.labels(**self.labels, source=source)
        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            LABELS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens.", LABELS, registry=r
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative preemptions.", LABELS, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", [*LABELS, "finished_reason"], registry=r
        )
        # vLLM creates every reason's series at 0 before the first request.
        for reason in FINISHED_REASONS:
            self.request_success.labels(**self.labels, finished_reason=reason)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "TTFT.", LABELS, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "ITL.", LABELS, buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "E2E latency.",
            LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Queue time.",
            LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self._synced = {"queries": 0, "hits": 0, "prompt": 0, "generation": 0, "preemptions": 0}
        self._synced_sources = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        # vLLM exports every series from the start, at zero, before the first request.
        for family in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.gpu_cache,
            self.prefix_queries,
            self.prefix_hits,
            self.prompt_tokens,
            self.prompt_tokens_cached,
            self.generation_tokens,
            self.preemptions,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
        ):
            family.labels(**self.labels)

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(**self.labels).observe(ttft_s)

    def observe_token_gap(self, itl_s: float) -> None:
        self.itl.labels(**self.labels).observe(itl_s)

    def observe_queue(self, queue_s: float) -> None:
        self.queue.labels(**self.labels).observe(queue_s)

    def observe_finish(self, reason: str, e2e_s: float) -> None:
        self.request_success.labels(**self.labels, finished_reason=reason).inc()
        self.e2e.labels(**self.labels).observe(e2e_s)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.labels(**self.labels).set(running)
        self.waiting.labels(**self.labels).set(waiting)
        self.kv_usage.labels(**self.labels).set(kv_usage)
        self.gpu_cache.labels(**self.labels).set(kv_usage)

    def set_loras(self, running: list[str], waiting: list[str]) -> None:
        # As vLLM: one series per combination ever seen, never removed, each valued at the
        # time it was last set, so only the newest describes the engine now.
        self.lora_info.labels(
            max_lora=str(self.max_loras),
            waiting_lora_adapters=",".join(waiting),
            running_lora_adapters=",".join(running),
        ).set(time.time())

    def add_tokens(self, prompt: int, generation: int) -> None:
        """For the fixed-latency mode, which has no engine to sync from."""
        self.prompt_tokens.labels(**self.labels).inc(prompt)
        self.prompt_tokens_by_source.labels(**self.labels, source=LOCAL_COMPUTE).inc(prompt)
        self.generation_tokens.labels(**self.labels).inc(generation)

    def sync_engine(self, engine: Engine) -> None:
        self.set_load(engine.num_running, engine.num_waiting, engine.kv_usage)
        self.set_loras(engine.running_loras, engine.waiting_loras)
        totals = {
            "queries": engine.prefix_queries_tokens,
            "hits": engine.prefix_hits_tokens,
            "prompt": engine.prompt_tokens_total,
            "generation": engine.generation_tokens_total,
            "preemptions": engine.preemptions_total,
        }
        counters = {
            "queries": self.prefix_queries,
            "hits": self.prefix_hits,
            "prompt": self.prompt_tokens,
            "generation": self.generation_tokens,
            "preemptions": self.preemptions,
        }
        for key, total in totals.items():
            delta = total - self._synced[key]
            if delta > 0:
                counters[key].labels(**self.labels).inc(delta)
                self._synced[key] = total
        for source, total in engine.prompt_tokens_by_source.items():
            delta = total - self._synced_sources[source]
            if delta > 0:
                self.prompt_tokens_by_source.labels(**self.labels, source=source).inc(delta)
                if source != LOCAL_COMPUTE:
                    self.prompt_tokens_cached.labels(**self.labels).inc(delta)
                self._synced_sources[source] = total

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
