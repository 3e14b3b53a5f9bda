"""The capacity planner: GPUs per pool for a workload and its SLO. Pure, no Django.

Two levels:

* `textbook_estimate`: the back-of-envelope of the design literature. Demand in output tokens
  per second over one GPU's throughput, then headroom for traffic spikes (30 %), rollouts that
  run two versions side by side (20 %) and nodes out for maintenance (15 %). The factors add:

      gpus              = round(users x requests/user/s x output tokens / tokens/s per GPU)
      gpus_with_headroom = round(raw x (1 + 0.30 + 0.20 + 0.15))

  10,000 users x 0.1 req/s x 500 tokens = 500,000 tokens/s; at 4,500 tokens/s per GPU that is
  111.1 GPUs, so 111, and 111.1 x 1.65 = 183.3, so 183. (Multiplying the factors instead,
  1.3 x 1.2 x 1.15 = 1.794, would give 199; rounding up instead of to nearest, 112 and 184.)

* `plan_capacity`: the same arithmetic with each pool's throughput taken from the engine
  model under the SLO (the largest decode batch whose TPOT meets the objective and whose KV
  fits, with each request's prefill stalling the batch once, and an idle TTFT within the
  objective), whole replicas rounded up, and the cheapest mix: pools ranked by price per
  token, each filled up to the GPUs it has before the next is used (one demand over linear
  costs, so greedy by unit cost is optimal up to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs


@dataclass(frozen=True, slots=True)
class Headroom:
    spikes: float = 0.30
    rollouts: float = 0.20
    maintenance: float = 0.15

    @property
    def factor(self) -> float:
        return 1.0 + self.spikes + self.rollouts + self.maintenance


@dataclass(frozen=True, slots=True)
class GpuEstimate:
    demand_tokens_per_s: float
    raw_gpus: float
    gpus: int
    headroom_factor: float
    gpus_with_headroom: int


def textbook_estimate(
    users: int,
    requests_per_user_s: float,
    output_tokens: float,
    tokens_per_s_per_gpu: float,
    headroom: Headroom | None = None,
) -> GpuEstimate:
    headroom = headroom or Headroom()
    if tokens_per_s_per_gpu <= 0:
        raise ValueError("tokens_per_s_per_gpu must be positive")
    demand = users * requests_per_user_s * output_tokens
    raw = demand / tokens_per_s_per_gpu
    return GpuEstimate(demand, raw, round(raw), headroom.factor, round(raw * headroom.factor))


@dataclass(frozen=True, slots=True)
class Workload:
    users: int
    requests_per_user_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo_s: float | None = 1.0
    tpot_slo_s: float | None = 0.05
    model: str = "llama-3.1-8b"
    quantization: str = "bf16"

    @property
    def requests_per_s(self) -> float:
        return self.users * self.requests_per_user_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.requests_per_s * self.output_tokens


@dataclass(frozen=True, slots=True)
class PoolOption:
    name: str
    gpu_class: str
    usd_per_gpu_hour: float | None = None
    # GPUs the pool can give this workload; None: as many as needed.
    available_gpus: int | None = None
    tensor_parallel: int = 1

    @property
    def price_per_gpu_hour(self) -> float:
        if self.usd_per_gpu_hour is not None:
            return self.usd_per_gpu_hour
        return load_gpu_specs()[self.gpu_class].usd_per_hour


@dataclass(frozen=True, slots=True)
class ReplicaThroughput:
    """What one replica sustains within the SLO."""

    batch: int
    tpot_s: float
    ttft_idle_s: float
    output_tokens_per_s: float


def slo_throughput(
    perf: PerfModel, workload: Workload, max_num_seqs: int = 256
) -> ReplicaThroughput | str:
    """One replica's output tokens per second within the SLO, or why it cannot meet it."""
    prompt, output = workload.prompt_tokens, workload.output_tokens
    if perf.kv_capacity_tokens < prompt + output:
        return "the KV cache cannot hold one request"
    avg_context = prompt + output / 2
    ttft_idle = perf.ttft_s(prompt)
    tpot_limit = math.inf if workload.tpot_slo_s is None else workload.tpot_slo_s
    ttft_limit = math.inf if workload.ttft_slo_s is None else workload.ttft_slo_s
    if perf.tpot_s(1, avg_context) > tpot_limit:
        return f"TPOT {perf.tpot_s(1, avg_context) * 1000:.0f} ms even at batch 1"
    if ttft_idle > ttft_limit:
        return f"TTFT {ttft_idle:.2f} s even when idle"
    largest = max(1, min(max_num_seqs, int(perf.kv_capacity_tokens // (prompt + output))))

    def fits(batch: int) -> bool:
        step = perf.tpot_s(batch, avg_context)
        # A newcomer waits for the step in flight, then for its own prefill.
        return step <= tpot_limit and step + ttft_idle <= ttft_limit

    low, high = 1, largest
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    step = perf.tpot_s(low, avg_context)
    prefill = perf.compute_time_s(prompt)
    # Per request: `output` steps shared by the batch, plus its prefill, which stalls it.
    requests_per_s = low / (output * step + low * prefill)
    return ReplicaThroughput(low, step, ttft_idle, requests_per_s * output)


@dataclass(frozen=True, slots=True)
class PoolLine:
    pool: str
    gpu_class: str
    replicas: int
    gpus: int
    batch: int
    tokens_per_s_per_gpu: float
    usd_per_hour: float
    share_of_demand: float


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    workload: Workload
    headroom_factor: float
    demand_tokens_per_s: float
    lines: tuple[PoolLine, ...]
    infeasible: dict[str, str]
    # Demand (tokens/s, before headroom) that no pool could take: capacity ran out.
    unmet_tokens_per_s: float
    textbook: GpuEstimate | None = field(default=None)

    @property
    def gpus(self) -> int:
        return sum(line.gpus for line in self.lines)

    @property
    def usd_per_hour(self) -> float:
        return sum(line.usd_per_hour for line in self.lines)

    @property
    def meets_demand(self) -> bool:
        return self.unmet_tokens_per_s <= 1e-9


def default_pools() -> list[PoolOption]:
    return [PoolOption(name.split("-")[0].lower(), name) for name in load_gpu_specs()]


def plan_capacity(
    workload: Workload,
    pools: Sequence[PoolOption] | None = None,
    headroom: Headroom | None = None,
    max_num_seqs: int = 256,
) -> CapacityPlan:
    headroom = headroom or Headroom()
    pools = list(pools) if pools is not None else default_pools()
    model = load_model_specs()[workload.model]
    gpus = load_gpu_specs()
    ranked: list[tuple[float, PoolOption, ReplicaThroughput]] = []
    infeasible: dict[str, str] = {}
    for pool in pools:
        if pool.gpu_class not in gpus:
            infeasible[pool.name] = f"unknown GPU class {pool.gpu_class}"
            continue
        perf = PerfModel(gpus[pool.gpu_class], model, workload.quantization, pool.tensor_parallel)
        if perf.kv_capacity_tokens <= 0:
            infeasible[pool.name] = "the weights do not fit"
            continue
        result = slo_throughput(perf, workload, max_num_seqs)
        if isinstance(result, str):
            infeasible[pool.name] = result
            continue
        per_gpu = result.output_tokens_per_s / pool.tensor_parallel
        ranked.append((pool.price_per_gpu_hour / per_gpu, pool, result))
    ranked.sort(key=lambda item: item[0])

    demand = workload.output_tokens_per_s
    left = demand
    lines = []
    for _, pool, throughput in ranked:
        if left <= 1e-9:
            break
        per_replica = throughput.output_tokens_per_s
        wanted = math.ceil(left * headroom.factor / per_replica - 1e-9)
        if pool.available_gpus is not None:
            wanted = min(wanted, pool.available_gpus // pool.tensor_parallel)
        if wanted <= 0:
            continue
        covered = min(left, wanted * per_replica / headroom.factor)
        left -= covered
        lines.append(
            PoolLine(
                pool.name,
                pool.gpu_class,
                wanted,
                wanted * pool.tensor_parallel,
                throughput.batch,
                per_replica / pool.tensor_parallel,
                wanted * pool.tensor_parallel * pool.price_per_gpu_hour,
                covered / demand if demand else 0.0,
            )
        )
    return CapacityPlan(workload, headroom.factor, demand, tuple(lines), infeasible, max(0.0, left))


def plan_for(data: Mapping[str, Any]) -> CapacityPlan:
    """The plan for a validated request: its workload fields and `pools` (PoolOption)."""
    workload = Workload(
        users=data["users"],
        requests_per_user_s=data["requests_per_user_s"],
        prompt_tokens=data["prompt_tokens"],
        output_tokens=data["output_tokens"],
        ttft_slo_s=data.get("ttft_slo_s"),
        tpot_slo_s=data.get("tpot_slo_s"),
        model=data.get("model", "llama-3.1-8b"),
        quantization=data.get("quantization", "bf16"),
    )
    plan = plan_capacity(workload, list(data["pools"]))
    if data.get("tokens_per_s_per_gpu"):
        textbook = textbook_estimate(
            workload.users,
            workload.requests_per_user_s,
            workload.output_tokens,
            data["tokens_per_s_per_gpu"],
        )
        plan = replace(plan, textbook=textbook)
    return plan
