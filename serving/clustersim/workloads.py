"""Workloads for the cluster simulator: trace replays and synthetic arrival processes.

A workload is a time-ordered list of `SimRequest`: arrival time, prompt and output token
counts, tenant, tier, and the tenant-salted hashes of the prompt's 16-token KV blocks (what the
gateway computes with `prompt_block_hashes`, and what the engine's prefix cache keys on). No
text is generated: the engine model only needs counts and block identities.

Traces, shipped in data/traces/ (its README gives their sources, licences and citations), and
any other file in either format (`load_trace`):
- Azure (CSV: TIMESTAMP, ContextTokens, GeneratedTokens; TIMESTAMP an ISO date and time as
  the 2023 and 2024 traces write it, zone or not, or plain seconds); the shipped one is an
  hour of the 2023 conversation service. It carries no prefix information, so its requests have no block
  hashes.
- Mooncake (JSON lines: timestamp in ms, input_length, output_length, hash_ids): `hash_ids`
  name 512-token prompt blocks; equal ids at the same position mean an equal prefix. Each id
  becomes 32 chained 16-token blocks salted with the tenant.

A multi-model workload is any of these with each request given a model by weight
(`assign_models`); a request without one asks for the fleet's model.

Tenants are spread by weight over every trace (`assign_tenants`): requests that share a first
block keep one tenant while some tenant has room for all of them, so a tenant's prefix hits
stay its own; a root shared by more requests than any tenant's share (a trace whose requests
all begin with one block) is drawn request by request instead.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import json
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

BLOCK_TOKENS = 16  # vLLM's KV block size; the gateway hashes prompts in blocks of this many
MOONCAKE_BLOCK_TOKENS = 512
TRACES_DIR = Path(__file__).resolve().parent / "data" / "traces"
AZURE_CONV_CSV = TRACES_DIR / "azure_llm_2023_conv.csv"
MOONCAKE_JSONL = TRACES_DIR / "mooncake_synthetic.jsonl"
TRACE_FORMATS = ("azure", "mooncake")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(Exception):
    """A trace that is missing, empty or does not parse as its format; the message says where."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: str
    tier: str
    block_hashes: tuple[int, ...] = ()
    # None: the fleet's model.
    model: str | None = None


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
    """Draws tenants by weight."""

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


def assign_tenants(
    roots: Sequence[int | None], tenants: Sequence[Tenant], rng: random.Random
) -> list[Tenant]:
    """A tenant per request, by weight, keeping requests with one root (first prompt block) on
    one tenant where that fits.

    Each tenant has room for its weight's share of the requests. Roots are placed largest
    first, each on the tenant with the most room left if all its requests fit there; the
    requests of roots that fit nowhere, and those without a root, are drawn one by one in
    proportion to the room left. Deterministic for a given trace and seed.
    """
    if not tenants:
        raise ValueError("a workload needs at least one tenant")
    total = sum(t.weight for t in tenants)
    room = [t.weight / total * len(roots) for t in tenants]
    chosen: list[Tenant | None] = [None] * len(roots)
    groups: dict[int, list[int]] = {}
    for index, root in enumerate(roots):
        if root is not None:
            groups.setdefault(root, []).append(index)
    for _, members in sorted(groups.items(), key=lambda group: (-len(group[1]), group[0])):
        best = max(range(len(tenants)), key=lambda i: room[i])
        if room[best] >= len(members):
            room[best] -= len(members)
            for index in members:
                chosen[index] = tenants[best]
    rest = [index for index, tenant in enumerate(chosen) if tenant is None]
    if rest:
        picker = TenantPicker(
            [Tenant(t.name, t.tier, r) for t, r in zip(tenants, room, strict=True)]
        )
        by_name = {t.name: t for t in tenants}
        for index in rest:
            chosen[index] = by_name[picker.draw(rng).name]
    return [tenant for tenant in chosen if tenant is not None]


def assign_models(
    requests: Sequence[SimRequest], shares: Mapping[str, float], seed: int = 0
) -> list[SimRequest]:
    """The same requests, each asking for a model drawn by `shares` (weights, any scale).
    The draws have their own random stream, so the arrivals and lengths stay the workload's."""
    if not shares or min(shares.values()) < 0 or sum(shares.values()) <= 0:
        raise ValueError(f"model shares must be non-negative weights with a positive sum: {shares}")
    # TenantPicker's weighted draw, with the models in the tenants' place.
    picker = TenantPicker([Tenant(model, "", weight) for model, weight in shares.items()])
    rng = random.Random(seed)
    return [replace(request, model=picker.draw(rng).name) for request in requests]


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


def _clip(prompt: int, output: int, max_context: int) -> tuple[int, int]:
    """Fit a request into the model's context: keep the output, trim the prompt."""
    output = max(1, min(output, max_context // 2))
    prompt = max(1, min(prompt, max_context - output))
    return prompt, output


# --- traces ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request as the trace has it: arrival in seconds after its first request."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...] = ()


@contextmanager
def _opened(path: Path) -> Iterator[IO[str]]:
    try:
        with path.open(newline="") as f:
            yield f
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file") from None


def _from_first(path: Path, rows: list[TraceRow]) -> list[TraceRow]:
    """Arrivals counted from the earliest, in arrival order (a trace may start anywhere)."""
    if not rows:
        raise TraceError(f"{path}: no requests")
    start = min(row.arrival_s for row in rows)
    shifted = [
        TraceRow(row.arrival_s - start, row.prompt_tokens, row.output_tokens, row.block_ids)
        for row in rows
    ]
    return sorted(shifted, key=lambda row: row.arrival_s)


# An ISO timestamp's fraction past microseconds (the 2023 traces write seven digits), cut
# so that `datetime.fromisoformat` takes it; what follows the fraction (a zone) is kept.
_EXTRA_DIGITS = re.compile(r"(\.\d{6})\d+")


def azure_time(stamp: str) -> datetime | float:
    """A TIMESTAMP cell: an ISO date and time, with or without a fraction of any length and a
    zone (one without a zone is taken as UTC), or else a plain number of seconds."""
    text = stamp.strip()
    try:
        seconds = float(text)
    except ValueError:
        moment = datetime.fromisoformat(_EXTRA_DIGITS.sub(r"\1", text))
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    if not math.isfinite(seconds):
        raise ValueError(f"timestamp {text!r} is not a finite number")
    return seconds


def _seconds_after(start: datetime | float, at: datetime | float) -> float:
    # Differences of datetimes, not of epoch seconds: a float of 1.7e9 s keeps no
    # microseconds, and the trace's order of near arrivals would move.
    if isinstance(start, datetime) and isinstance(at, datetime):
        return (at - start).total_seconds()
    if isinstance(start, float) and isinstance(at, float):
        return at - start
    raise ValueError("timestamps mix dates and plain seconds")


def _counts(prompt: object, output: object) -> tuple[int, int]:
    prompt_tokens, output_tokens = int(prompt), int(output)  # type: ignore[call-overload]
    if prompt_tokens < 0 or output_tokens < 0:
        raise ValueError(f"negative token count ({prompt_tokens}, {output_tokens})")
    return prompt_tokens, output_tokens


def read_azure(path: Path) -> list[TraceRow]:
    rows: list[TraceRow] = []
    with _opened(path) as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(
                f"{path}: not an Azure trace: no column {', '.join(missing)} "
                f"(wants a CSV header {','.join(AZURE_COLUMNS)})"
            )
        start: datetime | float | None = None
        for row in reader:
            try:
                at = azure_time(row["TIMESTAMP"])
                start = at if start is None else start
                at_s = _seconds_after(start, at)
                prompt, output = _counts(row["ContextTokens"], row["GeneratedTokens"])
            except (AttributeError, TypeError, ValueError) as error:
                raise TraceError(
                    f"{path}, line {reader.line_num}: not an Azure row: {error}"
                ) from None
            rows.append(TraceRow(at_s, prompt, output))
    return _from_first(path, rows)


def read_mooncake(path: Path) -> list[TraceRow]:
    rows: list[TraceRow] = []
    with _opened(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, output = _counts(row["input_length"], row["output_length"])
                at_ms = float(row["timestamp"])
                if not math.isfinite(at_ms):
                    raise ValueError(f"timestamp {at_ms} is not a finite number")
                rows.append(
                    TraceRow(
                        at_ms / 1000.0,
                        prompt,
                        output,
                        tuple(int(block) for block in row.get("hash_ids", ())),
                    )
                )
            except KeyError as error:
                raise TraceError(f"{path}, line {number}: not a Mooncake row: no {error}") from None
            except (AttributeError, TypeError, ValueError) as error:
                raise TraceError(
                    f"{path}, line {number}: not a Mooncake row ({error}): want a JSON object "
                    "with timestamp (ms), input_length, output_length and hash_ids"
                ) from None
    return _from_first(path, rows)


READERS: dict[str, Callable[[Path], list[TraceRow]]] = {
    "azure": read_azure,
    "mooncake": read_mooncake,
}


def mean_rate(rows: Sequence[TraceRow]) -> float:
    """Requests per second: one over the mean time between arrivals."""
    span = rows[-1].arrival_s - rows[0].arrival_s
    if span <= 0:
        raise TraceError("every request of the trace arrives at once: it has no rate to rescale")
    return (len(rows) - 1) / span


def replay(
    rows: Sequence[TraceRow],
    *,
    prefix: str,
    rate_multiplier: float = 1.0,
    rate_per_s: float | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
    max_context: int = 131072,
    window_s: float | None = None,
) -> list[SimRequest]:
    """A trace's rows as requests: inter-arrival times divided by `rate_multiplier`, or
    rescaled to `rate_per_s` requests per second on average when that is given; `window_s`
    keeps only requests arriving in the first window_s seconds of the replay."""
    if rate_per_s is not None:
        rate_multiplier = rate_per_s / mean_rate(rows)
    kept = [row for row in rows if window_s is None or row.arrival_s / rate_multiplier < window_s]
    roots = [row.block_ids[0] if row.block_ids else None for row in kept]
    chosen = assign_tenants(roots, tenants, random.Random(seed))
    requests = []
    for index, (row, tenant) in enumerate(zip(kept, chosen, strict=True)):
        prompt, output = _clip(row.prompt_tokens, row.output_tokens, max_context)
        requests.append(
            SimRequest(
                f"{prefix}{index}",
                row.arrival_s / rate_multiplier,
                prompt,
                output,
                tenant.name,
                tenant.tier,
                salted_blocks(tenant.name, row.block_ids, prompt),
            )
        )
    return requests


def load_trace(
    path: Path,
    trace_format: str,
    *,
    rate_multiplier: float = 1.0,
    rate_per_s: float | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
    max_context: int = 131072,
    window_s: float | None = None,
) -> list[SimRequest]:
    """Any trace file in the Azure or the Mooncake format (module docstring), replayed."""
    if trace_format not in READERS:
        raise TraceError(f"unknown trace format {trace_format!r}: one of {', '.join(READERS)}")
    return replay(
        READERS[trace_format](path),
        prefix="az" if trace_format == "azure" else "mc",
        rate_multiplier=rate_multiplier,
        rate_per_s=rate_per_s,
        tenants=tenants,
        seed=seed,
        max_context=max_context,
        window_s=window_s,
    )


def load_azure_conversation(
    path: Path | None = None,
    *,
    rate_multiplier: float = 1.0,
    rate_per_s: float | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
    max_context: int = 131072,
    window_s: float | None = None,
) -> list[SimRequest]:
    """The shipped Azure conversation hour (or another Azure-format trace at `path`)."""
    return load_trace(
        path or AZURE_CONV_CSV,
        "azure",
        rate_multiplier=rate_multiplier,
        rate_per_s=rate_per_s,
        tenants=tenants,
        seed=seed,
        max_context=max_context,
        window_s=window_s,
    )


def load_mooncake(
    path: Path | None = None,
    *,
    rate_multiplier: float = 1.0,
    rate_per_s: float | None = None,
    tenants: Sequence[Tenant] = DEFAULT_TENANTS,
    seed: int = 0,
    max_context: int = 131072,
    window_s: float | None = None,
) -> list[SimRequest]:
    """The shipped Mooncake synthetic trace (or another Mooncake-format trace at `path`)."""
    return load_trace(
        path or MOONCAKE_JSONL,
        "mooncake",
        rate_multiplier=rate_multiplier,
        rate_per_s=rate_per_s,
        tenants=tenants,
        seed=seed,
        max_context=max_context,
        window_s=window_s,
    )


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
