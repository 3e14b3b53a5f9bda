"""Command-line flags: the vLLM ones the platform sets, plus --sim-* flags of our own.

Unknown flags are an error, as they are for `vllm serve`: a typo in the agent's launcher must
fail loudly here rather than pass silently in tests and break on a GPU node.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from dataclasses import dataclass

from serving.engine.placement import check_placement
from serving.engine.specs import (
    GpuSpec,
    ModelSpec,
    find_model_spec,
    load_gpu_specs,
    load_model_specs,
    normalize_quantization,
)

# vLLM's KVTransferConfig roles (vllm/config/kv_transfer.py).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The connectors whose hand-over the simulator models: NIXL's pull mode, the one llm-d and
# vLLM's disaggregated proxy drive with kv_transfer_params (NixlConnector is its alias).
NIXL_CONNECTORS = ("NixlConnector", "NixlPullConnector")


@dataclass(frozen=True)
class KvTransferConfig:
    """What the simulator reads of --kv-transfer-config."""

    connector: str
    role: str
    # vLLM draws a uuid4 when the config names none; the simulator derives a stable one.
    engine_id: str
    # Where a decode engine would reach this one's NIXL side channel: vLLM's
    # VLLM_NIXL_SIDE_CHANNEL_HOST/_PORT. Nothing listens there in the simulator, so unset
    # they default to its own --host/--port (vLLM's localhost:5600 would name every replica
    # alike).
    side_channel_host: str
    side_channel_port: int

    @property
    def is_nixl(self) -> bool:
        return self.connector in NIXL_CONNECTORS


@dataclass(frozen=True)
class SimConfig:
    model: str
    served_model_names: tuple[str, ...]
    host: str
    port: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    quantization: str
    kv_cache_dtype: str
    enable_prefix_caching: bool
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    gpu: GpuSpec
    model_spec: ModelSpec
    time_scale: float = 1.0
    crash_after_tokens: int | None = None
    error_rate: float = 0.0
    error_status: int = 500
    error_after_tokens: int | None = None
    # Fail (error_status) every request whose prompt contains this text: content an engine
    # chokes on, the same on every replica, whoever sends it.
    error_on_text: str | None = None
    hang: bool = False
    slow_start_s: float = 0.0
    fixed_ttft_ms: float | None = None
    fixed_itl_ms: float | None = None
    seed: int = 0
    # Stop at a drawn EOS even when max_tokens is set, as a real model does (ignore_eos
    # aside); off, a request given max_tokens writes exactly that many, as a benchmark's do.
    stop_at_eos: bool = False
    # Bearer keys of /v1 (vLLM's --api-key, or VLLM_API_KEY); none means open, as in vLLM.
    api_keys: tuple[str, ...] = ()
    kv_transfer: KvTransferConfig | None = None

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def fixed_latency(self) -> bool:
        return self.fixed_ttft_ms is not None


class ConfigError(ValueError):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serving.enginesim",
        description="A stand-in for `vllm serve MODEL` driven by the engine model.",
    )
    # vLLM's api_server takes --model; `vllm serve` a positional model tag. Either works here.
    p.add_argument("model_tag", nargs="?", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", action="append", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    # Loopback unless told: the agent always names the node's address (vLLM's own default
    # is every interface, which would put an engine in reach of the whole network).
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    # None: what vLLM picks for the GPU (`GpuSpec.default_max_num_batched_tokens`).
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    # vLLM v1 caches prefixes unless told not to.
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16)
    # With NixlConnector, a prefill (do_remote_decode) answers kv_transfer_params as vLLM's
    # connector builds them and a decode (do_remote_prefill) skips its prompt's prefill;
    # other connectors are accepted and serve every request whole.
    p.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None)
    sim = p.add_argument_group("simulator")
    sim.add_argument("--sim-gpu-class", required=True, help="a gpus.csv row, e.g. L4-24GB")
    sim.add_argument("--sim-model-spec", default=None, help="a models.csv row")
    sim.add_argument("--sim-time-scale", type=float, default=1.0, help="10 = ten times faster")
    sim.add_argument("--sim-crash-after-tokens", type=int, default=None)
    sim.add_argument("--sim-error-rate", type=float, default=0.0)
    sim.add_argument(
        "--sim-error-status", type=int, default=500, help="HTTP status of the simulated errors"
    )
    sim.add_argument(
        "--sim-error-after-tokens",
        type=int,
        default=None,
        metavar="N",
        help="fail every generation after N tokens, as vLLM does mid-stream",
    )
    sim.add_argument(
        "--sim-error-on-text",
        default=None,
        metavar="TEXT",
        help="fail every request whose prompt contains TEXT (content the engine chokes on)",
    )
    sim.add_argument("--sim-hang", action="store_true")
    sim.add_argument("--sim-slow-start", type=float, default=0.0, metavar="SECONDS")
    sim.add_argument("--sim-fixed-ttft-ms", type=float, default=None)
    sim.add_argument("--sim-fixed-itl-ms", type=float, default=None)
    sim.add_argument("--sim-seed", type=int, default=0)
    sim.add_argument(
        "--sim-stop-at-eos",
        action="store_true",
        help="stop at a drawn EOS length even when max_tokens is set, as a real model does",
    )
    return p


def _kv_transfer_config(value: str) -> dict[str, object]:
    try:
        config = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(config, dict) or not config.get("kv_connector") or not config.get("kv_role"):
        raise argparse.ArgumentTypeError("a JSON object with kv_connector and kv_role")
    if config["kv_role"] not in KV_ROLES:
        # vLLM's KVTransferConfig refuses it at start-up, in these words.
        raise argparse.ArgumentTypeError(
            f"Unsupported kv_role: {config['kv_role']}. Supported roles are {KV_ROLES}"
        )
    return config


def _kv_transfer(raw: dict[str, object] | None, host: str, port: int) -> KvTransferConfig | None:
    if raw is None:
        return None
    engine_id = raw.get("engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        # Stable across restarts of one replica, distinct between replicas.
        engine_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"enginesim://{host}:{port}"))
    side_port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or str(port)
    if not side_port.isdigit():
        raise ConfigError(f"VLLM_NIXL_SIDE_CHANNEL_PORT={side_port!r}: not a port number")
    return KvTransferConfig(
        connector=str(raw["kv_connector"]),
        role=str(raw["kv_role"]),
        engine_id=engine_id,
        side_channel_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or host,
        side_channel_port=int(side_port),
    )


def parse_args(argv: list[str]) -> SimConfig:
    """Parse and validate; argparse exits with status 2 on unknown flags, and a ConfigError
    names any value that makes no sense (as vLLM refuses to start)."""
    args = _parser().parse_args(argv)
    args.model = args.model_tag or args.model
    if not args.model:
        raise ConfigError("name the model: --model PATH (or a positional model tag)")
    gpus = load_gpu_specs()
    if args.sim_gpu_class not in gpus:
        raise ConfigError(f"--sim-gpu-class {args.sim_gpu_class!r}: use one of {', '.join(gpus)}")
    served = tuple(args.served_model_name or [args.model])
    model_spec = _model_spec(args.sim_model_spec, args.model, served)
    quantization = normalize_quantization(args.quantization)
    max_model_len = args.max_model_len or model_spec.max_context
    if args.sim_time_scale <= 0:
        raise ConfigError("--sim-time-scale must be positive")
    if not 0.0 <= args.sim_error_rate <= 1.0:
        raise ConfigError("--sim-error-rate must be between 0 and 1")
    if not 400 <= args.sim_error_status <= 599:
        raise ConfigError("--sim-error-status must be an HTTP error status (400-599)")
    if args.sim_error_after_tokens is not None and args.sim_error_after_tokens < 0:
        raise ConfigError("--sim-error-after-tokens must be 0 or more")
    if (args.sim_fixed_ttft_ms is None) != (args.sim_fixed_itl_ms is None):
        raise ConfigError("--sim-fixed-ttft-ms and --sim-fixed-itl-ms go together")
    gpu = gpus[args.sim_gpu_class]
    budget = args.max_num_batched_tokens or gpu.default_max_num_batched_tokens
    if budget < args.max_num_seqs:
        # vLLM's SchedulerConfig refuses the same.
        raise ConfigError(
            f"max_num_batched_tokens ({budget}) must be greater than or equal to "
            f"max_num_seqs ({args.max_num_seqs})."
        )
    placement = check_placement(
        gpu,
        model_spec,
        quantization,
        args.tensor_parallel_size,
        max_model_len,
        args.gpu_memory_utilization,
    )
    if not placement.ok:
        raise ConfigError(placement.message)
    return SimConfig(
        model=args.model,
        served_model_names=served,
        host=args.host,
        port=args.port,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        quantization=quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        gpu=gpu,
        model_spec=model_spec,
        time_scale=args.sim_time_scale,
        crash_after_tokens=args.sim_crash_after_tokens,
        error_rate=args.sim_error_rate,
        error_status=args.sim_error_status,
        error_on_text=args.sim_error_on_text,
        error_after_tokens=args.sim_error_after_tokens,
        hang=args.sim_hang,
        slow_start_s=args.sim_slow_start,
        fixed_ttft_ms=args.sim_fixed_ttft_ms,
        fixed_itl_ms=args.sim_fixed_itl_ms,
        seed=args.sim_seed,
        stop_at_eos=args.sim_stop_at_eos,
        api_keys=tuple(key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key),
        kv_transfer=_kv_transfer(args.kv_transfer_config, args.host, args.port),
    )


def _model_spec(explicit: str | None, model: str, served: tuple[str, ...]) -> ModelSpec:
    if explicit is not None:
        specs = load_model_specs()
        if explicit not in specs:
            raise ConfigError(f"--sim-model-spec {explicit!r}: use one of {', '.join(specs)}")
        return specs[explicit]
    for name in (model, *served):
        spec = find_model_spec(name)
        if spec is not None:
            return spec
    raise ConfigError(f"cannot tell which models.csv row {model!r} is; pass --sim-model-spec")
