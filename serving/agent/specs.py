"""The replica spec the control plane sends, parsed into frozen dataclasses.

The control plane owns the spec; the agent only checks what it needs to launch safely, so a bad
spec is refused with a message instead of producing a process that dies at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

QUANTIZATIONS: frozenset[str] = frozenset({"fp8", "awq"})
KV_CACHE_DTYPES: frozenset[str] = frozenset({"auto", "fp8"})
# The KV connectors a disaggregated replica may run, with the roles each takes (vLLM's names).
KV_CONNECTOR_ROLES: dict[str, frozenset[str]] = {
    "NixlConnector": frozenset({"kv_both"}),
    "ExampleConnector": frozenset({"kv_producer", "kv_consumer"}),
}


class SpecError(ValueError):
    """A replica spec the agent cannot launch."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class SimSpec:
    """How to run the engine simulator in place of vLLM when the node's GPUs are simulated."""

    gpu_class: str | None = None
    model_spec: str | None = None
    time_scale: float | None = None
    # Simulator-only flags such as fault injection (--sim-hang, --sim-crash-after-tokens N).
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KvTransferSpec:
    """A disaggregated replica's KV hand-over: vLLM's connector and its role."""

    connector: str
    role: str


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    replica_id: str
    deployment_id: str
    model: str
    served_model_name: str
    gpu_indices: tuple[int, ...]
    port: int | None = None
    tensor_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: vLLM's own default for the GPU
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    adapters: tuple[AdapterSpec, ...] = ()
    sim: SimSpec = field(default_factory=SimSpec)
    # The replica's own engine key: the engine refuses /v1 requests without it, so only the
    # gateways (which read it from the routing table) and this agent can call it.
    api_key: str | None = field(default=None, repr=False)
    # Set on the prefill and decode replicas of a disaggregated deployment.
    kv_transfer: KvTransferSpec | None = None

    def launch_identity(self) -> ReplicaSpec:
        """The spec without what can change on a live process (adapters) or that the agent
        fills in (a port of None), so two specs compare equal when a relaunch is not needed."""
        return replace(self, adapters=(), port=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "deployment_id": self.deployment_id,
            "model": self.model,
            "served_model_name": self.served_model_name,
            "gpu_indices": list(self.gpu_indices),
            "port": self.port,
            "tensor_parallel_size": self.tensor_parallel_size,
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enable_lora": self.enable_lora,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "adapters": [{"name": a.name, "path": a.path} for a in self.adapters],
            "sim": {
                "gpu_class": self.sim.gpu_class,
                "model_spec": self.sim.model_spec,
                "time_scale": self.sim.time_scale,
                "extra_args": list(self.sim.extra_args),
            },
            # Reported specs never carry the engine key back out.
            "api_key": None if self.api_key is None else "***",
            "kv_transfer": None
            if self.kv_transfer is None
            else {"connector": self.kv_transfer.connector, "role": self.kv_transfer.role},
        }


def with_port(spec: ReplicaSpec, port: int) -> ReplicaSpec:
    return replace(spec, port=port)


def parse_replica_spec(raw: Any) -> ReplicaSpec:
    if not isinstance(raw, dict):
        raise SpecError("a replica spec must be a JSON object")
    try:
        spec = ReplicaSpec(
            # The control plane's ids are database keys; accept them as numbers too.
            replica_id=str(raw["replica_id"]) if raw.get("replica_id") not in (None, "") else "",
            deployment_id=str(raw.get("deployment_id") or ""),
            model=_required_str(raw, "model"),
            served_model_name=str(raw.get("served_model_name") or raw["model"]),
            gpu_indices=tuple(int(i) for i in raw.get("gpu_indices") or ()),
            port=None if raw.get("port") is None else int(raw["port"]),
            tensor_parallel_size=int(raw.get("tensor_parallel_size") or 1),
            quantization=_optional_str(raw.get("quantization")),
            kv_cache_dtype=str(raw.get("kv_cache_dtype") or "auto"),
            max_model_len=int(raw.get("max_model_len") or 4096),
            max_num_seqs=int(raw.get("max_num_seqs") or 256),
            max_num_batched_tokens=(
                None
                if raw.get("max_num_batched_tokens") is None
                else int(raw["max_num_batched_tokens"])
            ),
            gpu_memory_utilization=float(raw.get("gpu_memory_utilization") or 0.9),
            enable_prefix_caching=bool(raw.get("enable_prefix_caching", True)),
            enable_lora=bool(raw.get("enable_lora", False)),
            max_loras=int(raw.get("max_loras") or 1),
            max_lora_rank=int(raw.get("max_lora_rank") or 16),
            adapters=tuple(_parse_adapter(a) for a in raw.get("adapters") or ()),
            sim=_parse_sim(raw.get("sim")),
            api_key=_optional_str(raw.get("api_key")),
            kv_transfer=_parse_kv_transfer(raw.get("kv_transfer")),
        )
    except (TypeError, ValueError, KeyError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(f"bad replica spec: {exc}") from exc
    if not spec.replica_id:
        raise SpecError("replica_id is required")
    _check(spec)
    return spec


def parse_desired_set_leniently(raw: Any) -> tuple[list[ReplicaSpec], dict[str, str]]:
    """For the heartbeat answer: the specs that parse, and why the others did not, by replica
    id. One bad row must not freeze every other change to the node."""
    if not isinstance(raw, list):
        raise SpecError("desired_replicas must be a list of specs")
    specs: list[ReplicaSpec] = []
    refused: dict[str, str] = {}
    for item in raw:
        try:
            specs.append(parse_replica_spec(item))
        except SpecError as exc:
            replica_id = item.get("replica_id") if isinstance(item, dict) else None
            refused[str(replica_id)] = str(exc)
    return specs, refused


def parse_desired_set(raw: Any) -> list[ReplicaSpec]:
    if not isinstance(raw, list):
        raise SpecError("replicas must be a list of specs")
    specs = [parse_replica_spec(item) for item in raw]
    ids = [s.replica_id for s in specs]
    if len(set(ids)) != len(ids):
        raise SpecError("replica ids must be unique in the desired set")
    return specs


def _check(spec: ReplicaSpec) -> None:
    if spec.quantization is not None and spec.quantization not in QUANTIZATIONS:
        raise SpecError(f"quantization {spec.quantization!r} is not one of fp8, awq or null")
    if spec.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SpecError(f"kv_cache_dtype {spec.kv_cache_dtype!r} is not auto or fp8")
    if not spec.gpu_indices:
        raise SpecError("gpu_indices must name at least one GPU")
    if len(set(spec.gpu_indices)) != len(spec.gpu_indices):
        raise SpecError("gpu_indices must not repeat a GPU")
    # vLLM shards over every visible GPU it is told to; a mismatch wastes or lacks GPUs.
    if spec.tensor_parallel_size != len(spec.gpu_indices):
        raise SpecError(
            f"tensor_parallel_size {spec.tensor_parallel_size} needs as many GPUs, "
            f"got {len(spec.gpu_indices)}"
        )
    if not 0.0 < spec.gpu_memory_utilization <= 1.0:
        raise SpecError("gpu_memory_utilization must be in (0, 1]")
    if spec.port is not None and not 0 < spec.port < 65536:
        raise SpecError(f"port {spec.port} is out of range")


def _required_str(raw: dict[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise SpecError(f"{key} is required")
    return value


def _optional_str(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return str(value)


def _parse_adapter(raw: Any) -> AdapterSpec:
    if not isinstance(raw, dict):
        raise SpecError("an adapter must be an object with name and path")
    return AdapterSpec(name=_required_str(raw, "name"), path=_required_str(raw, "path"))


def _parse_kv_transfer(raw: Any) -> KvTransferSpec | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("kv_transfer must be an object with connector and role")
    connector, role = _required_str(raw, "connector"), _required_str(raw, "role")
    roles = KV_CONNECTOR_ROLES.get(connector)
    if roles is None:
        raise SpecError(
            f"kv_transfer.connector {connector!r} is not one of {sorted(KV_CONNECTOR_ROLES)}"
        )
    if role not in roles:
        raise SpecError(f"kv_transfer.role {role!r} is not one of {sorted(roles)} for {connector}")
    return KvTransferSpec(connector=connector, role=role)


def _parse_sim(raw: Any) -> SimSpec:
    if not raw:
        return SimSpec()
    if not isinstance(raw, dict):
        raise SpecError("sim must be an object")
    scale = raw.get("time_scale")
    extra_args = tuple(str(arg) for arg in raw.get("extra_args") or ())
    # Only the simulator's own flags: the engine flags come from the spec and nowhere else.
    if any(arg.startswith("-") and not arg.startswith("--sim-") for arg in extra_args):
        raise SpecError("sim.extra_args may only carry --sim-* flags")
    return SimSpec(
        gpu_class=_optional_str(raw.get("gpu_class")),
        model_spec=_optional_str(raw.get("model_spec")),
        time_scale=None if scale is None else float(scale),
        extra_args=extra_args,
    )
