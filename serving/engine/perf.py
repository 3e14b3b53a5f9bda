"""The roofline of PERFORMANCE_MODEL.md: step times from datasheet bandwidth and FLOPS.

Decode is bound by the bytes read per step (weights plus the KV of every context token), prefill
by FLOPs. Tensor parallelism is modelled as ideal: bandwidth and FLOPS scale with the TP degree
and communication is free. Real all-reduces cost a few percent at TP 2 and more at TP 8; the
simplification keeps TP placements comparable without inventing interconnect figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.specs import BYTES_PER_PARAM, GpuSpec, ModelSpec, normalize_quantization

GB = 1e9  # datasheets and our budgets are in decimal gigabytes


@dataclass(frozen=True)
class PerfModel:
    gpu: GpuSpec
    model: ModelSpec
    quantization: str = "bf16"
    tensor_parallel: int = 1
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    engine_overhead_gb: float = 3.0
    step_overhead_s: float = 0.003
    mem_efficiency: float = 0.7
    compute_efficiency: float = 0.65
    # Derived constants, cached because the engine evaluates step times in hot loops.
    _s_per_byte: float = field(init=False, repr=False)
    _s_per_flop: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", normalize_quantization(self.quantization))
        if self.tensor_parallel not in (1, 2, 4, 8):
            raise ValueError(f"tensor_parallel must be 1, 2, 4 or 8, not {self.tensor_parallel}")
        bandwidth = self.gpu.mem_bandwidth_gbs * GB * self.tensor_parallel
        flops = self.gpu.tflops_for(self.quantization) * 1e12 * self.tensor_parallel
        object.__setattr__(self, "_s_per_byte", 1.0 / (self.mem_efficiency * bandwidth))
        object.__setattr__(self, "_s_per_flop", 1.0 / (self.compute_efficiency * flops))

    # --- memory -----------------------------------------------------------------------------

    @property
    def params(self) -> float:
        return self.model.params_b * 1e9

    @property
    def weights_bytes(self) -> float:
        return self.params * BYTES_PER_PARAM[self.quantization]

    @property
    def weights_bytes_per_gpu(self) -> float:
        return self.weights_bytes / self.tensor_parallel

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token for the whole model (all ranks together)."""
        return self.model.kv_bytes_per_token(self.kv_cache_dtype)

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        # KV heads are split across ranks the same way the weights are.
        return self.kv_bytes_per_token / self.tensor_parallel

    @property
    def usable_bytes_per_gpu(self) -> float:
        return self.gpu.memory_gb * GB * self.gpu_memory_utilization - self.engine_overhead_gb * GB

    @property
    def kv_budget_bytes_per_gpu(self) -> float:
        return self.usable_bytes_per_gpu - self.weights_bytes_per_gpu

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the paged KV cache holds. Every rank holds its slice of every token, so the
        per-GPU budget over the per-GPU bytes per token is the engine's capacity."""
        budget = self.kv_budget_bytes_per_gpu
        return max(0, int(budget // self.kv_bytes_per_token_per_gpu))

    # --- time ------------------------------------------------------------------------------

    def memory_time_s(self, context_tokens: float) -> float:
        return (self.weights_bytes + context_tokens * self.kv_bytes_per_token) * self._s_per_byte

    def compute_time_s(self, tokens: float, attention_units: float = 0.0) -> float:
        """attention_units is the sum over prefill chunks of n x (c + n) for n new tokens after c
        cached ones; for c = 0 it is the n^2 of the attention term in PERFORMANCE_MODEL.md."""
        flops = 2.0 * self.params * tokens
        flops += 2.0 * self.model.layers * self.model.hidden * attention_units
        return flops * self._s_per_flop

    def batch_step_s(self, tokens: int, context_tokens: int, attention_units: float = 0.0) -> float:
        """One engine step that computes `tokens` new tokens (decodes and prefill chunks mixed)
        while reading the KV of `context_tokens` already-cached tokens."""
        return self.step_overhead_s + max(
            self.memory_time_s(context_tokens), self.compute_time_s(tokens, attention_units)
        )

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """context_tokens: the KV tokens of the whole batch together."""
        return self.batch_step_s(batch_size, context_tokens)

    def prefill_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        attention = new_tokens * (context_tokens + new_tokens)
        return self.batch_step_s(new_tokens, context_tokens, attention)

    def decode_floor_s(self) -> float:
        """The datasheet floor per output token: the weights read once at 70% of peak bandwidth.
        It leaves out the per-step overhead t0, so it is the figure PERFORMANCE_MODEL.md quotes
        (llama-3.1-8b bf16 on H100 about 7 ms); tpot_s adds t0 on top."""
        return self.weights_bytes * self._s_per_byte

    def tpot_s(self, batch_size: int, avg_context: float) -> float:
        return self.decode_step_s(batch_size, int(batch_size * avg_context))

    def ttft_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Time to first token on an idle engine: the prefill of the uncached part."""
        return self.prefill_s(max(1, prompt_tokens - cached_tokens), cached_tokens)

    def max_batch(self, avg_context: float, max_num_seqs: int = 256) -> int:
        """The largest decode batch whose KV fits, capped by max_num_seqs."""
        per_seq = max(1.0, avg_context)
        return max(1, min(max_num_seqs, int(self.kv_capacity_tokens // per_seq)))

    def max_throughput_tokens_per_s(
        self, avg_prompt_tokens: float, avg_output_tokens: float, max_num_seqs: int = 256
    ) -> float:
        """Steady decode throughput of a full engine: the batch that KV capacity and
        max_num_seqs allow, each sequence at its mean context (prompt plus half the output),
        plus the prefill each finished sequence costs, amortised over its output tokens."""
        avg_context = avg_prompt_tokens + avg_output_tokens / 2
        peak_context = avg_prompt_tokens + avg_output_tokens
        batch = max(1, min(max_num_seqs, int(self.kv_capacity_tokens // max(1.0, peak_context))))
        step = self.tpot_s(batch, avg_context)
        prefill_per_token = self.compute_time_s(avg_prompt_tokens) / max(1.0, avg_output_tokens)
        return batch / (step + batch * prefill_per_token)
