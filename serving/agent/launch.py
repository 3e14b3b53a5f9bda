"""The command line of one replica: `vllm serve` on real GPUs, the engine simulator otherwise.

Both get the same flags (DESIGN.md's list), so a replica behaves the same under either apart
from speed and text, and the flags the control plane asked for are visible in `ps`."""

from __future__ import annotations

from .specs import ReplicaSpec

ENGINE_SIMULATOR_MODULE = "serving.enginesim"


def build_launch_command(
    spec: ReplicaSpec,
    simulated: bool,
    python: str,
    *,
    default_time_scale: float = 1.0,
    default_gpu_class: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment to start the replica `spec` describes.

    `spec.port` must be set by now: the agent picks a free one before it calls this. The
    defaults stand in for a spec whose `sim` block leaves the simulator's class or speed out:
    the node's simulated GPU class and the agent's --sim-time-scale."""
    if spec.port is None:
        raise ValueError(f"replica {spec.replica_id} has no port yet")
    if simulated:
        argv = [python, "-m", ENGINE_SIMULATOR_MODULE, spec.model, *_engine_flags(spec)]
        argv += _simulator_flags(spec, default_time_scale, default_gpu_class)
    else:
        argv = ["vllm", "serve", spec.model, *_engine_flags(spec)]
    return argv, _engine_env(spec)


def _engine_flags(spec: ReplicaSpec) -> list[str]:
    flags = [
        "--served-model-name", spec.served_model_name,
        "--port", str(spec.port),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
    ]  # fmt: skip
    if spec.quantization is not None:
        flags += ["--quantization", spec.quantization]
    # "auto" is vLLM's default; leaving it out keeps the command line to what was asked for.
    if spec.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", spec.kv_cache_dtype]
    # vLLM's V1 engine caches prefixes unless told not to, so "off" has to be said out loud.
    flags.append(
        "--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if spec.enable_lora:
        flags += [
            "--enable-lora",
            "--max-loras", str(spec.max_loras),
            "--max-lora-rank", str(spec.max_lora_rank),
        ]  # fmt: skip
    return flags


def _simulator_flags(
    spec: ReplicaSpec, default_time_scale: float, default_gpu_class: str | None
) -> list[str]:
    gpu_class = spec.sim.gpu_class or default_gpu_class
    if gpu_class is None:
        raise ValueError(f"replica {spec.replica_id} is simulated but names no GPU class")
    flags = ["--sim-gpu-class", gpu_class]
    if spec.sim.model_spec is not None:
        flags += ["--sim-model-spec", spec.sim.model_spec]
    time_scale = spec.sim.time_scale if spec.sim.time_scale is not None else default_time_scale
    flags += ["--sim-time-scale", _number(time_scale)]
    return [*flags, *spec.sim.extra_args]


def _engine_env(spec: ReplicaSpec) -> dict[str, str]:
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices)}
    if spec.enable_lora:
        # Without it vLLM refuses /v1/load_lora_adapter, and adapters arrive at run time.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
