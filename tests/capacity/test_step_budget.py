"""The prefill budget the platform launches engines with: the rule's figures, and what it
buys in the engine model (decodes within TPOT while a long prompt prefills, for little TTFT)."""

from __future__ import annotations

import pytest

from serving.capacity.step_budget import (
    LARGEST_BUDGET,
    candidate_budgets,
    chosen_max_num_batched_tokens,
    mixed_step_s,
)
from serving.engine.core import Engine, EngineRequest
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs

INTERACTIVE_TPOT_S = 0.05


def perf(gpu: str, model: str = "llama-3.1-8b", tensor_parallel: int = 1) -> PerfModel:
    return PerfModel(load_gpu_specs()[gpu], load_model_specs()[model], "bf16", tensor_parallel)


def test_candidates_are_powers_of_two_from_256_or_max_num_seqs_to_8192() -> None:
    assert candidate_budgets(32) == [256, 512, 1024, 2048, 4096, 8192]
    assert candidate_budgets(300) == [512, 1024, 2048, 4096, 8192]
    assert candidate_budgets(10_000) == [10_000]  # vLLM needs at least max_num_seqs


@pytest.mark.parametrize(
    ("gpu", "model", "tensor_parallel", "tpot_s", "budget"),
    [
        ("H100-SXM-80GB", "llama-3.1-8b", 1, 0.05, 1024),
        ("H200-SXM-141GB", "llama-3.1-8b", 1, 0.05, 1024),
        ("L40S-48GB", "llama-3.1-8b", 1, 0.05, 512),
        ("A100-SXM-80GB", "llama-3.1-8b", 1, 0.05, 512),
        ("RTX-PRO-6000-96GB", "llama-3.1-8b", 1, 0.05, 512),
        ("L40S-48GB", "llama-3.1-8b", 1, 0.1, 1024),  # the standard tier's 100 ms
        ("H100-SXM-80GB", "llama-3.1-8b", 1, 0.1, 2048),
        ("H100-SXM-80GB", "llama-3.2-1b", 1, 0.05, 8192),  # a 1B's 8192 chunk is 42 ms
        ("H100-SXM-80GB", "llama-3.1-70b", 4, 0.05, 512),
        # An L4's decode step alone outlasts 50 ms: the smallest chunk costs it least.
        ("L4-24GB", "llama-3.1-8b", 1, 0.05, 256),
    ],
)
def test_the_largest_chunk_whose_step_with_a_decode_batch_fits_the_tpot_objective(
    gpu: str, model: str, tensor_parallel: int, tpot_s: float, budget: int
) -> None:
    model_perf = perf(gpu, model, tensor_parallel)
    assert chosen_max_num_batched_tokens(model_perf, tpot_s) == budget
    if mixed_step_s(model_perf, budget) <= tpot_s and budget < LARGEST_BUDGET:
        assert mixed_step_s(model_perf, 2 * budget) > tpot_s  # the next one up does not fit


def test_a_tier_without_a_tpot_objective_keeps_vllms_own_budget() -> None:
    assert chosen_max_num_batched_tokens(perf("H100-SXM-80GB"), None) is None


def test_the_budget_is_at_least_max_num_seqs_as_vllm_requires() -> None:
    assert chosen_max_num_batched_tokens(perf("L40S-48GB"), 0.05, max_num_seqs=1024) == 1024


def _long_prompt_amid_decodes(budget: int) -> tuple[float, float]:
    """An L40S engine with 32 sequences decoding at about 1,000 tokens of context, and a
    6,000-token prompt arriving: the longest step while the prompt prefills, and its TTFT."""
    engine = Engine(perf("L40S-48GB"), max_num_batched_tokens=budget)
    for i in range(32):
        engine.add_request(EngineRequest(f"d{i}", 1000, 400, 0.0))
    decoding: set[str] = set()
    while len(decoding) < 32:
        decoding.update(engine.step(engine.clock_s).first_token)
    arrived = engine.clock_s
    engine.add_request(EngineRequest("long", 6000, 10, arrived))
    longest = 0.0
    while True:
        result = engine.step(engine.clock_s)
        longest = max(longest, result.duration_s)
        if "long" in result.first_token:
            return longest, engine.clock_s - arrived


def test_the_chosen_budget_keeps_decodes_within_tpot_while_a_long_prompt_prefills() -> None:
    chosen = chosen_max_num_batched_tokens(perf("L40S-48GB"), INTERACTIVE_TPOT_S)
    assert chosen == 512
    step_chosen, ttft_chosen = _long_prompt_amid_decodes(chosen)
    step_vllm, ttft_vllm = _long_prompt_amid_decodes(2048)  # vLLM's own on an L40S
    # Every decode waits for each step: at vLLM's budget a step with a full chunk is about
    # 150 ms, three TPOT objectives; at the chosen one it stays within one.
    assert step_chosen <= INTERACTIVE_TPOT_S < 2 * INTERACTIVE_TPOT_S < step_vllm
    # The prompt pays 12 steps instead of 3, each hiding part of its chunk under the decode
    # batch's read: its TTFT grows by a fifth at most, well within a second.
    assert ttft_vllm < ttft_chosen <= 1.2 * ttft_vllm < 1.0
