"""The fleet a simulation runs on: pools of one GPU class each, each serving one model.

A pool serves the fleet's `model` unless it names its own (`PoolSpec.model`), so one fleet
can serve a 70B on H100s, an 8B on L40S and a 1B on L4 side by side; every per-pool figure
(the engine model, max_model_len, the router's coefficients) is the pool's model's.

Tensor parallelism is the engine model's (serving/engine/perf.py): a TP-n replica has n
GPUs' bandwidth and FLOPS, communication free, each GPU holding 1/n of the weights and of
every token's KV; it costs n GPUs. `smallest_tensor_parallel` is the smallest degree whose
weight shard leaves a GPU room for KV: a bf16 70B (141 GB of weights) needs TP 4 on an
80 GB GPU under the engine model's memory budget (90 % of memory less 3 GB), TP 2 on an H200.
"""

from __future__ import annotations

from argparse import ArgumentTypeError
from dataclasses import dataclass, field
from typing import Literal

from serving.capacity.step_budget import chosen_max_num_batched_tokens
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.router import DEFAULT_SLO_TIERS


@dataclass(frozen=True, slots=True)
class AutoscaleBounds:
    minimum: int
    maximum: int


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    gpu_class: str
    replicas: int
    # None: the GPU class's reference price from gpus.csv.
    usd_per_gpu_hour: float | None = None
    tensor_parallel: int = 1
    region: str = "local"
    # None: a static pool of `replicas`; otherwise `replicas` is the starting count.
    autoscale: AutoscaleBounds | None = None
    # "colocated", or "prefill" / "decode" for disaggregated serving (engine roles).
    role: str = "colocated"
    # None: the fleet's `model`.
    model: str | None = None

    @property
    def price_per_gpu_hour(self) -> float:
        if self.usd_per_gpu_hour is not None:
            return self.usd_per_gpu_hour
        return load_gpu_specs()[self.gpu_class].usd_per_hour

    @property
    def price_per_replica_hour(self) -> float:
        return self.price_per_gpu_hour * self.tensor_parallel

    @property
    def hourly_cost(self) -> float:
        return self.price_per_replica_hour * self.replicas


@dataclass(frozen=True, slots=True)
class FleetSpec:
    pools: tuple[PoolSpec, ...]
    model: str = "llama-3.1-8b"
    quantization: str = "bf16"
    max_num_seqs: int = 256
    # The prefill budget of an engine step: a number of tokens; "platform", what the platform
    # launches a deployment with when its engine arguments name none (serving.actions.
    # reconcile.launch_budget: chosen per class for `slo_tier`'s TPOT objective); "vllm",
    # vLLM's own default for each pool's GPU (`GpuSpec.default_max_num_batched_tokens`).
    max_num_batched_tokens: EngineBudget = "platform"
    # The tier the fleet's deployment is planned for, as `Deployment.slo_tier`.
    slo_tier: str = "interactive"
    enable_prefix_caching: bool = True
    # Engine flags per pool are derived: max_model_len is the model's context, or what the
    # pool's KV cache holds when that is less (vLLM refuses to start otherwise).
    engine_overrides: dict[str, int] = field(default_factory=dict)
    # The link KV is handed from prefill to decode replicas over (a row of links.csv): every
    # replica's port is one of these.
    kv_link: str = "infiniband-ndr-400"

    def __post_init__(self) -> None:
        budget = self.max_num_batched_tokens
        named = budget in ("platform", "vllm")
        if not named and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            # None once meant vLLM's own: refused rather than read as the platform's.
            raise ValueError(
                f"max_num_batched_tokens is 'platform', 'vllm' or a positive count, not {budget!r}"
            )
        if isinstance(budget, int) and budget < self.max_num_seqs:  # vLLM refuses to start too
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is below max_num_seqs ({self.max_num_seqs})"
            )

    @property
    def disaggregated(self) -> bool:
        return any(pool.role != "colocated" for pool in self.pools)

    @property
    def hourly_cost(self) -> float:
        return sum(pool.hourly_cost for pool in self.pools)

    @property
    def replicas(self) -> int:
        return sum(pool.replicas for pool in self.pools)

    def pool_model(self, pool: PoolSpec) -> str:
        return pool.model or self.model

    @property
    def models(self) -> tuple[str, ...]:
        """The models the pools serve, each once, in pool order."""
        return tuple(dict.fromkeys(self.pool_model(pool) for pool in self.pools))

    def perf(self, pool: PoolSpec) -> PerfModel:
        return PerfModel(
            load_gpu_specs()[pool.gpu_class],
            load_model_specs()[self.pool_model(pool)],
            quantization=self.quantization,
            tensor_parallel=pool.tensor_parallel,
        )

    def batched_tokens(self, pool: PoolSpec) -> int:
        """The prefill budget of one engine step on the pool's replicas."""
        if isinstance(self.max_num_batched_tokens, int):
            return self.max_num_batched_tokens
        vllm = load_gpu_specs()[pool.gpu_class].default_max_num_batched_tokens
        tier = DEFAULT_SLO_TIERS.get(self.slo_tier)
        if self.max_num_batched_tokens == "vllm" or pool.role != "colocated" or tier is None:
            return vllm
        chosen = chosen_max_num_batched_tokens(self.perf(pool), tier.tpot_s, self.max_num_seqs)
        return vllm if chosen is None else chosen

    def max_model_len(self, perf: PerfModel, block_size: int = 16) -> int:
        held = perf.kv_capacity_tokens // block_size * block_size
        return min(perf.model.max_context, held)

    def describe(self) -> str:
        # A one-model fleet reads as it always did; a multi-model one names each pool's model.
        several = len(self.models) > 1
        return " + ".join(
            f"{p.replicas}x {p.gpu_class}"
            + ("" if p.role == "colocated" else f" {p.role}")
            + (f" {self.pool_model(p)}" if several else "")
            + (f" TP{p.tensor_parallel}" if several and p.tensor_parallel > 1 else "")
            for p in self.pools
        )


EngineBudget = int | Literal["platform", "vllm"]


def parse_engine_budget(text: str) -> EngineBudget:
    """A command line's --engine-budget (argparse's `type`): platform, vllm or a positive
    number of tokens."""
    if text in ("platform", "vllm"):
        return text  # type: ignore[return-value]
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ArgumentTypeError(f"{text!r}: platform, vllm or a positive number of tokens")


def pool_name(gpu_class: str) -> str:
    return gpu_class.split("-")[0].lower()


TENSOR_PARALLEL_DEGREES = (1, 2, 4, 8)


def smallest_tensor_parallel(gpu_class: str, model: str, quantization: str = "bf16") -> int | None:
    """The smallest TP degree at which `model`'s weight shard leaves each GPU of the class
    room for KV; None when not even TP 8 does."""
    gpu, spec = load_gpu_specs()[gpu_class], load_model_specs()[model]
    for degree in TENSOR_PARALLEL_DEGREES:
        if PerfModel(gpu, spec, quantization, degree).kv_capacity_tokens > 0:
            return degree
    return None


def homogeneous(gpu_class: str, replicas: int, model: str = "llama-3.1-8b") -> FleetSpec:
    return FleetSpec(pools=(PoolSpec(pool_name(gpu_class), gpu_class, replicas),), model=model)


def disaggregated(
    prefill_gpu: str,
    prefills: int,
    decode_gpu: str,
    decodes: int,
    *,
    kv_link: str = "infiniband-ndr-400",
    model: str = "llama-3.1-8b",
) -> FleetSpec:
    """A prefill pool and a decode pool, possibly of different GPU classes."""
    return FleetSpec(
        pools=(
            PoolSpec(f"{pool_name(prefill_gpu)}-prefill", prefill_gpu, prefills, role="prefill"),
            PoolSpec(f"{pool_name(decode_gpu)}-decode", decode_gpu, decodes, role="decode"),
        ),
        model=model,
        kv_link=kv_link,
    )


def with_budget(
    shares: dict[str, float], hourly_budget: float, model: str = "llama-3.1-8b"
) -> FleetSpec:
    """A heterogeneous fleet spending about `hourly_budget`: each GPU class gets its share of
    the budget in whole replicas (rounded down), and what is left buys the cheapest class that
    still fits, so the fleet never costs more than the budget."""
    gpus = load_gpu_specs()
    total = sum(shares.values())
    counts = {
        gpu: int(hourly_budget * share / total // gpus[gpu].usd_per_hour)
        for gpu, share in shares.items()
    }
    left = hourly_budget - sum(counts[g] * gpus[g].usd_per_hour for g in counts)
    for gpu in sorted(counts, key=lambda g: -gpus[g].usd_per_hour):
        while left >= gpus[gpu].usd_per_hour:
            counts[gpu] += 1
            left -= gpus[gpu].usd_per_hour
    pools = tuple(PoolSpec(pool_name(gpu), gpu, count) for gpu, count in counts.items() if count)
    return FleetSpec(pools=pools, model=model)
