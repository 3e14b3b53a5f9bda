"""Workloads for the cluster simulator: trace replays and synthetic arrival processes.

A workload is a time-ordered list of `SimRequest`: arrival time, prompt and output token
counts, tenant, tier, and the tenant-salted hashes of the prompt's 16-token KV blocks (what the
gateway computes with `prompt_block_hashes`, and what the engine's prefix cache keys on). No
text is generated: the engine model only needs counts and block identities.

Traces (see /work/shared/traces/README.md):
- Azure LLM 2023 conversation: one hour of (timestamp, context tokens, generated tokens). It
  carries no prefix information, so its requests have no block hashes.
- Mooncake synthetic: `hash_ids` name 512-token prompt blocks; equal ids at the same position
  mean an equal prefix. Each id becomes 32 chained 16-token blocks salted with the tenant.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

BLOCK_TOKENS = 16  # vLLM's KV block size; the gateway hashes prompts in blocks of this many
MOONCAKE_BLOCK_TOKENS = 512
SHARED_TRACES = Path("/work/shared/traces")
AZURE_CONV_CSV = "azure_llm_2023_conv.csv"
MOONCAKE_JSONL = "mooncake_synthetic.jsonl"


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: str
    tier: str
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    tier: str
    weight: float = 1.0


DEFAULT_TENANTS: tuple[Tenant, ...] = (
    Tenant("acme", "interactive", 0.4),
    Tenant("globex", "interactive", 0.2),
    Tenant("initech", "standard", 0.25),
    Tenant("umbrella", "batch", 0.15),
)


class TenantPicker:
    """Draws tenants by weight; `for_key` is deterministic per key (a shared prompt root
    always belongs to one tenant, as a tenant's system prompt does)."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        if not tenants:
            raise ValueError("a workload needs at least one tenant")
        self.tenants = list(tenants)
        total = sum(t.weight for t in tenants)
        acc = 0.0
        self._edges: list[float] = []
        for tenant in tenants:
            acc += tenant.weight / total
            self._edges.append(acc)

    def draw(self, rng: random.Random) -> Tenant:
        index = bisect.bisect_left(self._edges, rng.random())
        return self.tenants[min(index, len(self.tenants) - 1)]

    def for_key(self, key: int) -> Tenant:
        return self.draw(random.Random(key))


def tenant_salt(tenant: str) -> int:
    # Python's str hash is randomised per process; a blake2b digest is stable everywhere.
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "big")


def salted_blocks(tenant: str, block_ids: Iterable[int], prompt_tokens: int) -> tuple[int, ...]:
    """Chained 16-token block hashes of a prompt made of 512-token blocks `block_ids`.

    Chained like vLLM's keys: a block's hash covers every block before it, so equal hashes
    mean equal prefixes. Only full 16-token blocks are hashed (vLLM caches full blocks only).
    """
    full = prompt_tokens // BLOCK_TOKENS
    per_id = MOONCAKE_BLOCK_TOKENS // BLOCK_TOKENS
    chain = tenant_salt(tenant)
    hashes: list[int] = []
    for block_id in block_ids:
        chain = hash((chain, block_id))
        for sub in range(per_id):
            if len(hashes) == full:
                return tuple(hashes)
            hashes.append(hash((chain, sub)))
    return tuple(hashes)


def _trace_path(name: str, path: Path | None) -> Path:
    if path is not None:
        return path
    local = Path(__file__).resolve().parents[3] / "shared" / "traces" / name
    return local if local.exists() else SHARED_TRACES / name


def _clip(prompt: int, output: int, max_context: int) -> tuple[int, int]:
    """Fit a request into the model's context: keep the output, trim the prompt."""
    output = max(1, min(output, max_context // 2))
    prompt = max(1, min(prompt, max_context - output))
    return prompt, output


def load_azure_conversation(
    path: Path | None = None,
    *,
    rate_multiplier: float = 1.0,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
    max_context: int = 131072,
    window_s: float | None = None,
) -> list[SimRequest]:
    """The Azure conversation hour, inter-arrival times divided by `rate_multiplier`.

    `window_s` keeps only requests arriving in the first window_s seconds of the replay."""
    rng = random.Random(seed)
    picker = TenantPicker(tenants)
    requests: list[SimRequest] = []
    start: datetime | None = None
    with _trace_path(AZURE_CONV_CSV, path).open(newline="") as f:
        for row in csv.DictReader(f):
            # Seven fractional digits: more than datetime parses, so cut to microseconds.
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            start = start or stamp
            arrival = (stamp - start).total_seconds() / rate_multiplier
            if window_s is not None and arrival >= window_s:
                break
            prompt, output = _clip(
                int(row["ContextTokens"]), int(row["GeneratedTokens"]), max_context
            )
            tenant = picker.draw(rng)
            requests.append(
                SimRequest(f"az{len(requests)}", arrival, prompt, output, tenant.name, tenant.tier)
            )
    return requests


def load_mooncake(
    path: Path | None = None,
    *,
    rate_multiplier: float = 1.0,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    max_context: int = 131072,
    window_s: float | None = None,
) -> list[SimRequest]:
    """The Mooncake synthetic trace; a request's tenant follows its first prompt block, so
    requests that share a prefix share a tenant and its salt."""
    picker = TenantPicker(tenants)
    requests: list[SimRequest] = []
    with _trace_path(MOONCAKE_JSONL, path).open() as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            arrival = row["timestamp"] / 1000.0 / rate_multiplier
            if window_s is not None and arrival >= window_s:
                break
            prompt, output = _clip(row["input_length"], row["output_length"], max_context)
            ids: list[int] = row["hash_ids"]
            tenant = picker.for_key(ids[0] if ids else len(requests))
            requests.append(
                SimRequest(
                    f"mc{len(requests)}",
                    arrival,
                    prompt,
                    output,
                    tenant.name,
                    tenant.tier,
                    salted_blocks(tenant.name, ids, prompt),
                )
            )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


# --- synthetic ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthClass:
    """Log-normal prompt and output lengths around these medians."""

    weight: float
    prompt_median: int
    output_median: int
    sigma: float = 0.6


@dataclass(frozen=True, slots=True)
class LengthMix:
    classes: tuple[LengthClass, ...] = field(
        default=(
            LengthClass(0.6, 600, 150),  # chat turns
            LengthClass(0.3, 2500, 300),  # RAG answers over retrieved context
            LengthClass(0.1, 8000, 60),  # long-document summaries and classification
        )
    )
    max_context: int = 32768

    def draw(self, rng: random.Random) -> tuple[int, int]:
        total = sum(c.weight for c in self.classes)
        pick = rng.random() * total
        chosen = self.classes[-1]
        for length_class in self.classes:
            pick -= length_class.weight
            if pick <= 0:
                chosen = length_class
                break
        prompt = int(rng.lognormvariate(math.log(chosen.prompt_median), chosen.sigma))
        output = int(rng.lognormvariate(math.log(chosen.output_median), chosen.sigma))
        return _clip(prompt, output, self.max_context)


def _requests_at(
    arrivals: Iterable[float],
    lengths: LengthMix,
    tenants: Sequence[Tenant],
    rng: random.Random,
    prefix: str,
) -> list[SimRequest]:
    picker = TenantPicker(tenants)
    requests = []
    for index, arrival in enumerate(arrivals):
        prompt, output = lengths.draw(rng)
        tenant = picker.draw(rng)
        requests.append(
            SimRequest(f"{prefix}{index}", arrival, prompt, output, tenant.name, tenant.tier)
        )
    return requests


def _thinned(
    rate_at: Callable[[float], float], peak_rate: float, duration_s: float, rng: random.Random
) -> list[float]:
    """Arrivals of a non-homogeneous Poisson process by thinning (Lewis and Shedler)."""
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak_rate)
        if t >= duration_s:
            return arrivals
        if rng.random() * peak_rate <= rate_at(t):
            arrivals.append(t)


def poisson(
    rate_per_s: float,
    duration_s: float,
    *,
    lengths: LengthMix | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
) -> list[SimRequest]:
    rng = random.Random(seed)
    arrivals = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate_per_s)
    return _requests_at(arrivals, lengths or LengthMix(), tenants, rng, "po")


def diurnal_rate(mean_rate: float, peak_to_trough: float, period_s: float, t: float) -> float:
    """A sinusoidal day: the trough at t = 0, the peak at half the period."""
    trough = 2 * mean_rate / (1 + peak_to_trough)
    peak = trough * peak_to_trough
    return trough + (peak - trough) * (1 - math.cos(2 * math.pi * t / period_s)) / 2


def diurnal(
    mean_rate_per_s: float,
    duration_s: float,
    *,
    peak_to_trough: float = 4.0,
    period_s: float = 86400.0,
    lengths: LengthMix | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
) -> list[SimRequest]:
    rng = random.Random(seed)
    peak = diurnal_rate(mean_rate_per_s, peak_to_trough, period_s, period_s / 2)
    arrivals = _thinned(
        lambda t: diurnal_rate(mean_rate_per_s, peak_to_trough, period_s, t),
        peak,
        duration_s,
        rng,
    )
    return _requests_at(arrivals, lengths or LengthMix(), tenants, rng, "di")


def bursty(
    base_rate_per_s: float,
    duration_s: float,
    *,
    burst_rate_per_s: float,
    burst_every_s: float = 300.0,
    burst_length_s: float = 30.0,
    lengths: LengthMix | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
) -> list[SimRequest]:
    """A base Poisson stream with bursts of `burst_rate_per_s` at random times, on average
    one every `burst_every_s`, each `burst_length_s` long (a two-state modulated Poisson)."""
    rng = random.Random(seed)
    bursts: list[tuple[float, float]] = []
    t = rng.expovariate(1 / burst_every_s)
    while t < duration_s:
        bursts.append((t, t + burst_length_s))
        t += burst_length_s + rng.expovariate(1 / burst_every_s)

    def rate_at(at: float) -> float:
        index = bisect.bisect_right(bursts, (at, math.inf)) - 1
        in_burst = index >= 0 and bursts[index][0] <= at < bursts[index][1]
        return burst_rate_per_s if in_burst else base_rate_per_s

    peak = max(base_rate_per_s, burst_rate_per_s)
    arrivals = _thinned(rate_at, peak, duration_s, rng)
    return _requests_at(arrivals, lengths or LengthMix(), tenants, rng, "bu")
