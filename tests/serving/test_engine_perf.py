"""The roofline against the sanity figures of PERFORMANCE_MODEL.md."""

from __future__ import annotations

import pytest

from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs, normalize_quantization
from serving.router.coefficients import coefficients_from_perf


def perf(gpu: str, model: str = "llama-3.1-8b", **kwargs: object) -> PerfModel:
    return PerfModel(load_gpu_specs()[gpu], load_model_specs()[model], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("gpu", "expected_ms"),
    [
        ("H100-SXM-80GB", 7),
        ("A100-SXM-80GB", 11),
        ("RTX-PRO-6000-96GB", 13),
        ("L40S-48GB", 27),
        ("L4-24GB", 76),
    ],
)
def test_decode_floor_matches_the_documented_sanity_figures(gpu: str, expected_ms: float) -> None:
    assert perf(gpu).decode_floor_s() * 1e3 == pytest.approx(expected_ms, rel=0.10)


@pytest.mark.parametrize(
    ("gpu", "budget"),
    [
        ("H200-SXM-141GB", 8192),
        ("H100-SXM-80GB", 8192),
        ("RTX-PRO-6000-96GB", 8192),
        ("A100-SXM-80GB", 2048),  # 80 GB, but vLLM names the A100 out (its PR #17885)
        ("L40S-48GB", 2048),
        ("L4-24GB", 2048),
    ],
)
def test_each_gpu_gets_the_prefill_budget_vllm_gives_it_and_the_router_knows_it(
    gpu: str, budget: int
) -> None:
    # What vLLM picks when --max-num-batched-tokens is not passed (a tier without TPOT, a
    # disaggregated phase, a CPU class): the coefficients use it unless told another.
    assert load_gpu_specs()[gpu].default_max_num_batched_tokens == budget
    assert coefficients_from_perf(perf(gpu)).max_num_batched_tokens == budget
    assert (
        coefficients_from_perf(perf(gpu), max_num_batched_tokens=512).max_num_batched_tokens == 512
    )


def test_a_single_decode_step_adds_the_step_overhead_to_the_floor() -> None:
    model = perf("H100-SXM-80GB")
    assert model.decode_step_s(1, 0) == pytest.approx(model.decode_floor_s() + 0.003)


def test_an_8b_model_in_bf16_on_an_l4_cannot_meet_a_40ms_tpot() -> None:
    assert perf("L4-24GB").tpot_s(1, 1000) > 0.040


def test_lighter_quantization_brings_the_l4_closer_to_40ms() -> None:
    assert perf("L4-24GB", quantization="awq-int4").tpot_s(1, 1000) < 0.040


def test_a_typical_prompt_prefills_in_tens_of_milliseconds_on_h100() -> None:
    ttft = perf("H100-SXM-80GB").ttft_s(2000)
    assert 0.030 < ttft < 0.150


def test_prefill_is_slower_on_older_gpus() -> None:
    assert perf("A100-SXM-80GB").ttft_s(1500) > perf("H100-SXM-80GB").ttft_s(1500)


def test_the_attention_term_makes_long_prefills_superlinear() -> None:
    model = perf("H100-SXM-80GB")
    assert model.prefill_s(32000) > 16 * model.prefill_s(2000)


def test_kv_capacity_is_memory_times_utilisation_minus_weights_and_overhead() -> None:
    model = perf("H100-SXM-80GB")
    expected = (80e9 * 0.9 - 3e9 - 16e9) / 131072
    assert model.kv_capacity_tokens == int(expected)


def test_fp8_kv_cache_doubles_the_capacity_in_tokens() -> None:
    assert perf("H100-SXM-80GB", kv_cache_dtype="fp8").kv_capacity_tokens == pytest.approx(
        2 * perf("H100-SXM-80GB").kv_capacity_tokens, abs=2
    )


def test_tensor_parallel_splits_weights_and_kv_across_ranks() -> None:
    single = perf("H100-SXM-80GB", "llama-3.1-70b", quantization="fp8")
    pair = perf("H100-SXM-80GB", "llama-3.1-70b", quantization="fp8", tensor_parallel=2)
    assert pair.weights_bytes_per_gpu == single.weights_bytes / 2
    assert pair.kv_capacity_tokens > 0
    assert pair.decode_floor_s() == pytest.approx(single.decode_floor_s() / 2)


def test_fp8_weights_use_fp8_flops_only_where_the_gpu_has_them() -> None:
    h100 = perf("H100-SXM-80GB", quantization="fp8")
    a100 = perf("A100-SXM-80GB", quantization="fp8")
    assert h100.compute_time_s(1000) == pytest.approx(
        perf("H100-SXM-80GB").compute_time_s(1000) / 2, rel=0.01
    )
    assert a100.compute_time_s(1000) == pytest.approx(perf("A100-SXM-80GB").compute_time_s(1000))


def test_throughput_grows_with_batching() -> None:
    model = perf("H100-SXM-80GB")
    assert model.max_throughput_tokens_per_s(1000, 200) > 20 / model.decode_step_s(1, 1000)


def test_throughput_is_capped_by_max_num_seqs() -> None:
    model = perf("H100-SXM-80GB")
    assert model.max_throughput_tokens_per_s(1000, 200, max_num_seqs=8) < (
        model.max_throughput_tokens_per_s(1000, 200, max_num_seqs=256)
    )


def test_vllm_quantization_names_map_onto_weight_formats() -> None:
    assert [normalize_quantization(q) for q in (None, "fp8", "awq_marlin")] == [
        "bf16",
        "fp8",
        "awq-int4",
    ]


def test_tensor_parallel_must_be_a_power_of_two_up_to_eight() -> None:
    with pytest.raises(ValueError, match="tensor_parallel"):
        perf("H100-SXM-80GB", tensor_parallel=3)
