"""Placement: weights plus one full sequence of KV must fit per GPU."""

from __future__ import annotations

from serving.engine.placement import check_placement, suggest_placements
from serving.engine.specs import load_gpu_specs, load_model_specs

GPUS = load_gpu_specs()
MODELS = load_model_specs()


def test_it_accepts_an_8b_model_in_bf16_on_one_l4() -> None:
    result = check_placement(GPUS["L4-24GB"], MODELS["llama-3.1-8b"], "bf16", 1)
    assert result.ok
    assert result.kv_capacity_tokens >= 8192


def test_it_accepts_a_70b_model_in_fp8_on_one_h200() -> None:
    assert check_placement(GPUS["H200-SXM-141GB"], MODELS["llama-3.1-70b"], "fp8", 1).ok


def test_it_accepts_a_70b_model_in_fp8_on_two_h100s() -> None:
    assert check_placement(GPUS["H100-SXM-80GB"], MODELS["llama-3.1-70b"], "fp8", 2).ok


def test_it_accepts_a_70b_model_in_bf16_on_four_h100s() -> None:
    assert check_placement(GPUS["H100-SXM-80GB"], MODELS["llama-3.1-70b"], "bf16", 4).ok


def test_it_refuses_a_70b_model_in_fp8_on_one_h100_and_names_what_fits() -> None:
    result = check_placement(GPUS["H100-SXM-80GB"], MODELS["llama-3.1-70b"], "fp8", 1)
    assert not result.ok
    assert "TP 2 on H100-SXM-80GB" in result.message
    assert "H200-SXM-141GB" in result.message
    assert "awq-int4 at TP 1" in result.message


def test_it_refuses_a_70b_model_in_bf16_on_one_l4_and_names_what_fits() -> None:
    result = check_placement(GPUS["L4-24GB"], MODELS["llama-3.1-70b"], "bf16", 1)
    assert not result.ok
    assert "Would fit" in result.message
    assert "TP 8 on L4-24GB" in result.message


def test_a_longer_max_model_len_can_break_a_placement() -> None:
    gpu, model = GPUS["L4-24GB"], MODELS["llama-3.1-8b"]
    assert check_placement(gpu, model, "bf16", 1, max_model_len=8192).ok
    assert not check_placement(gpu, model, "bf16", 1, max_model_len=32768).ok


def test_it_refuses_a_tensor_parallel_size_that_is_not_a_power_of_two() -> None:
    result = check_placement(GPUS["H100-SXM-80GB"], MODELS["llama-3.1-8b"], "bf16", 3)
    assert not result.ok
    assert "tensor parallel" in result.message


def test_suggestions_are_cheapest_first_and_all_fit() -> None:
    suggestions = suggest_placements(MODELS["llama-3.1-70b"], "fp8")
    prices = [s.usd_per_hour for s in suggestions]
    assert prices == sorted(prices)
    for s in suggestions:
        assert check_placement(GPUS[s.gpu], MODELS["llama-3.1-70b"], "fp8", s.tensor_parallel).ok
