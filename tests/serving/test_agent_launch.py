"""The replica's command line: exactly DESIGN.md's vLLM flags, and the simulator takes them too."""

from __future__ import annotations

import pytest

from serving.agent.launch import build_launch_command
from serving.agent.specs import SpecError, parse_replica_spec
from serving.enginesim import parse_args as parse_simulator_args


def _spec(**overrides: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "replica_id": "r-1",
        "deployment_id": "d-1",
        "model": "/models/llama-3.1-70b-fp8",
        "served_model_name": "llama-70b",
        "gpu_indices": [2, 3],
        "port": 8123,
        "tensor_parallel_size": 2,
        "quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "max_model_len": 16384,
        "max_num_seqs": 128,
        "gpu_memory_utilization": 0.92,
        "enable_prefix_caching": True,
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 32,
        "adapters": [{"name": "sql", "path": "/adapters/sql"}],
        "sim": {"gpu_class": "H100-SXM-80GB", "model_spec": "llama-3.1-70b", "time_scale": 20},
    }
    raw.update(overrides)
    return raw


def test_a_tp2_fp8_lora_deployment_gets_exactly_the_vllm_serve_argv() -> None:
    argv, _ = build_launch_command(parse_replica_spec(_spec()), simulated=False, python="py")

    assert argv == [
        "vllm", "serve", "/models/llama-3.1-70b-fp8",
        "--served-model-name", "llama-70b",
        "--port", "8123",
        "--tensor-parallel-size", "2",
        "--gpu-memory-utilization", "0.92",
        "--max-model-len", "16384",
        "--max-num-seqs", "128",
        "--quantization", "fp8",
        "--kv-cache-dtype", "fp8",
        "--enable-prefix-caching",
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
    ]  # fmt: skip


def test_the_replica_sees_only_its_gpus_and_may_load_adapters_at_run_time() -> None:
    _, env = build_launch_command(parse_replica_spec(_spec()), simulated=False, python="py")

    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def test_an_unquantized_replica_without_lora_says_prefix_caching_is_off_out_loud() -> None:
    spec = parse_replica_spec(
        _spec(
            quantization=None,
            kv_cache_dtype="auto",
            enable_lora=False,
            enable_prefix_caching=False,
            gpu_indices=[0],
            tensor_parallel_size=1,
        )
    )

    argv, env = build_launch_command(spec, simulated=False, python="py")

    assert argv[-1] == "--no-enable-prefix-caching"
    assert not {"--quantization", "--kv-cache-dtype", "--enable-lora", "--max-loras"} & set(argv)
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_the_simulator_runs_with_the_same_engine_flags_plus_its_own() -> None:
    spec = parse_replica_spec(_spec())
    real, _ = build_launch_command(spec, simulated=False, python="py")

    simulated, _ = build_launch_command(spec, simulated=True, python="/venv/bin/python")

    assert simulated[:4] == ["/venv/bin/python", "-m", "serving.enginesim", spec.model]
    assert simulated[4 : len(real) + 1] == real[3:]
    assert simulated[len(real) + 1 :] == [
        "--sim-gpu-class", "H100-SXM-80GB",
        "--sim-model-spec", "llama-3.1-70b",
        "--sim-time-scale", "20",
    ]  # fmt: skip


def test_the_simulator_accepts_every_flag_the_launcher_writes() -> None:
    simulated, _ = build_launch_command(parse_replica_spec(_spec()), simulated=True, python="py")

    config = parse_simulator_args(simulated[3:])

    assert (config.tensor_parallel_size, config.quantization, config.kv_cache_dtype) == (
        2,
        "fp8",
        "fp8",
    )
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 4, 32)
    assert config.port == 8123


def test_a_spec_without_a_sim_block_falls_back_to_the_nodes_gpu_class_and_time_scale() -> None:
    spec = parse_replica_spec(_spec(sim=None))

    argv, _ = build_launch_command(
        spec, simulated=True, python="py", default_time_scale=50, default_gpu_class="L4-24GB"
    )

    assert argv[-4:] == ["--sim-gpu-class", "L4-24GB", "--sim-time-scale", "50"]


def test_a_replica_without_a_port_cannot_be_launched_yet() -> None:
    with pytest.raises(ValueError, match="no port"):
        build_launch_command(parse_replica_spec(_spec(port=None)), simulated=False, python="py")


def test_a_tensor_parallel_degree_that_does_not_match_the_gpus_is_refused() -> None:
    with pytest.raises(SpecError, match="tensor_parallel_size 2"):
        parse_replica_spec(_spec(gpu_indices=[0]))


def test_a_quantization_vllm_would_not_take_is_refused() -> None:
    with pytest.raises(SpecError, match="quantization"):
        parse_replica_spec(_spec(quantization="int3"))
