"""GPU datasheet figures and model architecture facts, read from the CSVs beside this module."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"

# Bytes per weight parameter. int4 AWQ carries scales and zeros, so ~0.5 is a slight undercount.
BYTES_PER_PARAM: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "awq-int4": 0.5}
QUANTIZATIONS: tuple[str, ...] = tuple(BYTES_PER_PARAM)

# KV cache element size: vLLM's "auto" keeps the model dtype (bf16 here).
KV_BYTES_PER_ELEMENT: dict[str, int] = {"auto": 2, "bf16": 2, "fp8": 1}

# vLLM gives a GPU of at least this much memory its larger scheduling defaults.
VLLM_LARGE_GPU_BYTES = 70 * 2**30

# vLLM's --quantization values mapped onto our three weight formats. None means unquantized.
_VLLM_QUANTIZATION_ALIASES: dict[str, str] = {
    "bf16": "bf16",
    "none": "bf16",
    "fp8": "fp8",
    "awq": "awq-int4",
    "awq_marlin": "awq-int4",
    "awq-int4": "awq-int4",
    "gptq": "awq-int4",
    "gptq_marlin": "awq-int4",
}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_gb: float
    mem_bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: float | None
    tdp_w: float
    usd_per_hour: float

    @property
    def default_max_num_batched_tokens(self) -> int:
        """The prefill budget a step gets from vLLM's OpenAI server when the command line
        names none, as the node agent launches it: `EngineArgs.get_batch_defaults` in
        vllm/engine/arg_utils.py gives 8192 tokens on a GPU of 70 GiB or more that is not an
        A100 (H100, H200, RTX PRO 6000) and 2048 on the others (L40S, L4, A100)."""
        large = self.memory_gb * 1e9 >= VLLM_LARGE_GPU_BYTES and "a100" not in self.name.lower()
        return 8192 if large else 2048

    def tflops_for(self, quantization: str) -> float:
        # GPUs without fp8 tensor cores run fp8 weights weight-only: dequantised to bf16 math.
        if quantization == "fp8" and self.fp8_tflops is not None:
            return self.fp8_tflops
        return self.bf16_tflops


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params_b: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    max_context: int
    kv_bytes_per_token_bf16: int

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        return (
            2 * self.layers * self.kv_heads * self.head_dim * kv_bytes_per_element(kv_cache_dtype)
        )


def kv_bytes_per_element(kv_cache_dtype: str) -> int:
    try:
        return KV_BYTES_PER_ELEMENT[kv_cache_dtype]
    except KeyError:
        known = ", ".join(KV_BYTES_PER_ELEMENT)
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; use one of {known}") from None


def normalize_quantization(value: str | None) -> str:
    """Map a vLLM --quantization value (or None) onto bf16, fp8 or awq-int4."""
    if value is None:
        return "bf16"
    try:
        return _VLLM_QUANTIZATION_ALIASES[value.lower()]
    except KeyError:
        known = ", ".join(sorted(_VLLM_QUANTIZATION_ALIASES))
        raise ValueError(f"unknown quantization {value!r}; use one of {known}") from None


def _optional_float(text: str) -> float | None:
    return float(text) if text.strip() else None


@cache
def load_gpu_specs() -> dict[str, GpuSpec]:
    with (DATA_DIR / "gpus.csv").open(newline="") as f:
        return {
            row["gpu"]: GpuSpec(
                name=row["gpu"],
                memory_gb=float(row["memory_gb"]),
                mem_bandwidth_gbs=float(row["mem_bandwidth_gbs"]),
                bf16_tflops=float(row["bf16_dense_tflops"]),
                fp8_tflops=_optional_float(row["fp8_dense_tflops"]),
                tdp_w=float(row["tdp_w"]),
                usd_per_hour=float(row["usd_per_hour"]),
            )
            for row in csv.DictReader(f)
        }


@cache
def load_model_specs() -> dict[str, ModelSpec]:
    with (DATA_DIR / "models.csv").open(newline="") as f:
        return {
            row["model"]: ModelSpec(
                name=row["model"],
                params_b=float(row["params_b"]),
                layers=int(row["layers"]),
                hidden=int(row["hidden"]),
                kv_heads=int(row["kv_heads"]),
                head_dim=int(row["head_dim"]),
                max_context=int(row["max_context"]),
                kv_bytes_per_token_bf16=int(row["kv_bytes_per_token_bf16"]),
            )
            for row in csv.DictReader(f)
        }


def find_model_spec(name: str) -> ModelSpec | None:
    """The models.csv row a served name refers to: exact, then by a normalised substring
    (so "meta-llama/Llama-3.1-8B-Instruct" finds llama-3.1-8b)."""
    specs = load_model_specs()
    if name in specs:
        return specs[name]
    wanted = _squash(name)
    # Longest key first so llama-3.1-70b wins over a shorter key it contains.
    for key in sorted(specs, key=len, reverse=True):
        if _squash(key) in wanted:
            return specs[key]
    return None


def _squash(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")
