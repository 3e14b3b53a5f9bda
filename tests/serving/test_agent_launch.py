"""The replica's command line: exactly DESIGN.md's vLLM flags on GPU and CPU nodes, the CPU
build's environment, and the simulator takes the same flags too."""

from __future__ import annotations

import pytest

from serving.agent.launch import (
    LaunchSettings,
    build_launch_command,
    core_list,
    engine_path,
    replica_cores,
)
from serving.agent.specs import SpecError, parse_replica_spec
from serving.enginesim import parse_args as parse_simulator_args

GPU_NODE = LaunchSettings(simulated=False, vllm_python="/node/bin/python", host="10.0.0.7")
SIMULATED = LaunchSettings(simulated=True, python="/venv/bin/python", host="127.0.0.1")
CPU_NODE = LaunchSettings(
    simulated=False,
    device="cpu",
    vllm_python="/opt/vllm-cpu/bin/python",
    host="10.0.0.9",
    cpu_slots=((0, 1), (2, 3)),
    cpu_kv_cache_gib=2,
)


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
        "api_key": "ek_secret",
    }
    raw.update(overrides)
    return raw


def _cpu_spec(**overrides: object) -> dict[str, object]:
    cpu: dict[str, object] = {
        "model": "file:///var/models/tiny/base",
        "gpu_indices": [1],
        "tensor_parallel_size": 1,
        "quantization": None,
        "kv_cache_dtype": "auto",
    }
    return _spec(**{**cpu, **overrides})


def test_a_tp2_fp8_lora_deployment_gets_exactly_the_vllm_argv() -> None:
    argv, _ = build_launch_command(parse_replica_spec(_spec()), GPU_NODE)

    assert argv == [
        "/node/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/llama-3.1-70b-fp8",
        "--served-model-name",
        "llama-70b",
        "--host",
        "10.0.0.7",
        "--port",
        "8123",
        "--tensor-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.92",
        "--max-model-len",
        "16384",
        "--max-num-seqs",
        "128",
        "--quantization",
        "fp8",
        "--kv-cache-dtype",
        "fp8",
        "--enable-prefix-caching",
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "32",
    ]


def test_a_prefill_budget_set_on_the_deployment_reaches_vllm_and_none_leaves_its_own() -> None:
    told, _ = build_launch_command(parse_replica_spec(_spec(max_num_batched_tokens=512)), GPU_NODE)
    at = told.index("--max-num-batched-tokens")
    assert told[at + 1] == "512"
    untold, _ = build_launch_command(parse_replica_spec(_spec()), GPU_NODE)
    assert "--max-num-batched-tokens" not in untold
    # The simulator takes the flag, and without it vLLM's default for the GPU it plays.
    simulated, _ = build_launch_command(
        parse_replica_spec(_spec(max_num_batched_tokens=512)), SIMULATED
    )
    assert parse_simulator_args(simulated[3:]).max_num_batched_tokens == 512
    l40s = _spec(sim={"gpu_class": "L40S-48GB", "model_spec": "llama-3.1-8b"})
    l40s.update(gpu_indices=[0], tensor_parallel_size=1, quantization=None, kv_cache_dtype="auto")
    simulated, _ = build_launch_command(parse_replica_spec(l40s), SIMULATED)
    assert parse_simulator_args(simulated[3:]).max_num_batched_tokens == 2048


def test_the_replica_sees_only_its_gpus_and_gets_its_engine_key_outside_the_argv() -> None:
    argv, env = build_launch_command(parse_replica_spec(_spec()), GPU_NODE)

    assert env == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_API_KEY": "ek_secret",
    }
    assert not any("ek_secret" in arg for arg in argv)


def test_an_unquantized_replica_without_lora_says_prefix_caching_is_off_out_loud() -> None:
    spec = parse_replica_spec(
        _spec(
            quantization=None,
            kv_cache_dtype="auto",
            enable_lora=False,
            enable_prefix_caching=False,
            gpu_indices=[0],
            tensor_parallel_size=1,
            api_key=None,
        )
    )

    argv, env = build_launch_command(spec, GPU_NODE)

    assert argv[-1] == "--no-enable-prefix-caching"
    assert not {"--quantization", "--kv-cache-dtype", "--enable-lora", "--max-loras"} & set(argv)
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_a_cpu_replica_runs_the_same_flags_with_the_cpu_builds_environment() -> None:
    spec = parse_replica_spec(_cpu_spec())
    on_gpu, _ = build_launch_command(spec, GPU_NODE)

    argv, env = build_launch_command(spec, CPU_NODE)

    assert argv[0] == "/opt/vllm-cpu/bin/python"
    assert argv[1:5] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/var/models/tiny/base",
    ]
    assert argv[argv.index("--host") + 1] == "10.0.0.9"
    assert [a for a in argv if a.startswith("--")] == [a for a in on_gpu if a.startswith("--")]
    assert env == {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "2-3",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_API_KEY": "ek_secret",
    }


def test_a_cpu_replica_is_confined_to_its_slots_cores_and_a_gpu_replica_to_none() -> None:
    assert replica_cores(parse_replica_spec(_cpu_spec()), CPU_NODE) == [2, 3]
    assert replica_cores(parse_replica_spec(_spec()), GPU_NODE) is None


def test_a_cpu_replica_on_a_slot_the_node_does_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU slot 5"):
        build_launch_command(parse_replica_spec(_cpu_spec(gpu_indices=[5])), CPU_NODE)


def test_core_lists_are_written_as_ranges() -> None:
    assert core_list([3, 0, 1, 2, 7, 9, 8]) == "0-3,7-9"
    assert core_list([4]) == "4"


def test_artifact_uris_become_what_the_engine_loads() -> None:
    assert engine_path("file:///var/models/tiny%20llama/base") == "/var/models/tiny llama/base"
    assert engine_path("hf://meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert engine_path("/models/local") == "/models/local"


def test_the_simulator_runs_with_the_same_engine_flags_plus_its_own() -> None:
    spec = parse_replica_spec(_spec())
    real, _ = build_launch_command(spec, GPU_NODE)

    simulated, _ = build_launch_command(spec, SIMULATED)

    assert simulated[:3] == ["/venv/bin/python", "-m", "serving.enginesim"]
    flags = [a for a in real[3:] if a != "10.0.0.7"]
    assert [a for a in simulated[3 : len(real)] if a != "127.0.0.1"] == flags
    assert simulated[len(real) :] == [
        "--sim-gpu-class",
        "H100-SXM-80GB",
        "--sim-model-spec",
        "llama-3.1-70b",
        "--sim-time-scale",
        "20",
    ]


def test_the_simulator_accepts_every_flag_the_launcher_writes() -> None:
    simulated, _ = build_launch_command(parse_replica_spec(_spec()), SIMULATED)

    config = parse_simulator_args(simulated[3:])

    assert (config.tensor_parallel_size, config.quantization, config.kv_cache_dtype) == (
        2,
        "fp8",
        "fp8",
    )
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 4, 32)
    assert (config.host, config.port, config.model) == (
        "127.0.0.1",
        8123,
        "/models/llama-3.1-70b-fp8",
    )


def test_a_spec_without_a_sim_block_falls_back_to_the_nodes_gpu_class_and_time_scale() -> None:
    spec = parse_replica_spec(_spec(sim=None))
    node = LaunchSettings(simulated=True, default_time_scale=50, sim_gpu_class="L4-24GB")

    argv, _ = build_launch_command(spec, node)

    assert argv[-4:] == ["--sim-gpu-class", "L4-24GB", "--sim-time-scale", "50"]


def test_a_replica_without_a_port_cannot_be_launched_yet() -> None:
    with pytest.raises(ValueError, match="no port"):
        build_launch_command(parse_replica_spec(_spec(port=None)), GPU_NODE)


def test_a_reported_spec_never_carries_the_engine_key() -> None:
    assert parse_replica_spec(_spec()).to_json()["api_key"] == "***"


def test_a_tensor_parallel_degree_that_does_not_match_the_gpus_is_refused() -> None:
    with pytest.raises(SpecError, match="tensor_parallel_size 2"):
        parse_replica_spec(_spec(gpu_indices=[0]))


def test_a_quantization_vllm_would_not_take_is_refused() -> None:
    with pytest.raises(SpecError, match="quantization"):
        parse_replica_spec(_spec(quantization="int3"))


def test_a_node_given_a_traces_endpoint_has_vllm_export_its_spans_there_over_http() -> None:
    node = LaunchSettings(
        simulated=False,
        vllm_python="/node/bin/python",
        host="10.0.0.7",
        otlp_traces_endpoint="http://collector:4318/v1/traces",
    )
    argv, env = build_launch_command(parse_replica_spec(_spec()), node)

    assert argv[-2:] == ["--otlp-traces-endpoint", "http://collector:4318/v1/traces"]
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    # Without an endpoint vLLM is not told to trace at all.
    plain, plain_env = build_launch_command(parse_replica_spec(_spec()), GPU_NODE)
    assert "--otlp-traces-endpoint" not in plain
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in plain_env


def test_a_simulated_node_given_a_traces_endpoint_starts_the_simulator_as_before() -> None:
    node = LaunchSettings(
        simulated=True,
        python="/venv/bin/python",
        host="127.0.0.1",
        otlp_traces_endpoint="http://collector:4318/v1/traces",
    )
    argv, env = build_launch_command(parse_replica_spec(_spec()), node)

    assert argv == build_launch_command(parse_replica_spec(_spec()), SIMULATED)[0]
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in env
