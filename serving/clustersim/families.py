"""Workload families for the cluster simulator: six generated workloads, each a frozen set of
parameters and a seed, so a routing result is judged on kinds of traffic, not on two traces.

`FAMILIES[name].generate(seed=..., rate=..., duration_s=...)` builds the requests; every
argument left out takes the family's own value. Every family draws its tenants from
`DEFAULT_TENANTS` (acme and globex interactive, initech standard, umbrella batch), per
session where a family has sessions, so a session's shared prefix stays one tenant's. Shared
prefixes are whole 512-token chunks (`MOONCAKE_BLOCK_TOKENS`) hashed by `salted_blocks`, as the
gateway salts them per tenant: a system prompt, a repository or a document is a run of chunk
ids, and two prompts that begin with the same ids share those KV blocks. A chunk that a
conversation keeps extending keeps its id, so turn k's blocks begin with all of turn k-1's.

Lengths are log-normal around a median, clipped to a range (`TokenSpan`). Where they come
from (the Azure 2023 conversation hour shipped in data/traces/ has prompts median 1,020 tokens,
p10 207, p90 2,735, outputs median 129, p10 54, p90 424, as Splitwise, Patel et al. ISCA 2024,
report; Splitwise's coding trace has prompts median ~1,500 and outputs median 13):

- code (prefill-heavy; 96 requests/s): sessions of 1-8 requests (10 s apart on average) on one
  of the tenant's 4 repositories (Zipf s=1.2; 3-7 chunks of repository context each), one
  open file per session (1-3 chunks), an instruction of 50-400 tokens (median 150): prompts
  ~2,100-5,500 tokens; outputs 30-150 (median 60). Sessions start from 60 s before the
  window: over seeds 1-4 its first minute holds 1.00 of the family's rate. Longer prompts
  and outputs than Splitwise's coding trace medians: edits and agent steps rather than
  completions (a guess).
- generation (decode-heavy; 48 requests/s): prompts 100-500 (median 250), outputs 500-2,000
  (median 900): long-form writing and reasoning traces (a guess; no public trace separates
  them). No shared prefix.
- chat (multi-turn; 128 requests/s): conversations of 2-10 turns (uniform); a per-tenant
  system prompt of 1-2 chunks; user messages 30-400 tokens (median 100), replies 30-800
  (median 150, near Azure's median output); turn k's prompt is turn k-1's prompt, its reply
  and a new message; the next turn comes after the reply streams (25 ms a token) and a
  think time (exponential, mean 15 s: compressed; real think times are longer, a guess).
  Conversations start from 600 s before the window, longer than all but a vanishing share of
  them last (9 gaps of at most 20 s of reply and a think time), so the window opens at the
  family's rate. From 120 s before, as first built, the window opened at 85 % of it and
  reached it only after about 100 s.
- rag (shared documents; 96 requests/s): per tenant a system prompt of 1 chunk and 300
  documents of 1-3 chunks; a request retrieves 1-3 distinct documents by Zipf popularity
  (s=1.1, as retrieval hit rates are skewed; the exponent is a guess) and asks a 20-200 token
  question (median 60); outputs 50-500 (median 180).
- bursty (64 requests/s base): a Poisson base with bursts at 4x the base rate, 10 s long,
  one in every 30 s at a random offset within it (compressed from minutes; a guess), so the
  mean is 128 requests/s and any 30 s window holds a burst; short chat: prompts
  median 400, outputs median 120 (sigma 0.7), after a 512-token per-tenant system prompt.
- diurnal (128 requests/s mean): `workloads.diurnal` over one compressed day (the period is the
  window), peak-to-trough 4 (a guess of a business-hours service); chat lengths as Azure's
  (prompt median 1,000, output median 130, sigma 0.8), after the same system prompt.

Rates are a whole service's, sized so that the smallest H100 fleets are a few replicas and
the L40S ones a few tens (a fleet of two cannot show a 15 % difference). Default windows are
600 s; `bench/routing.py --quick` runs 30 s ones.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from serving.clustersim.workloads import (
    DEFAULT_TENANTS,
    MOONCAKE_BLOCK_TOKENS,
    LengthClass,
    LengthMix,
    SimRequest,
    Tenant,
    TenantPicker,
    diurnal,
    salted_blocks,
)

CHUNK = MOONCAKE_BLOCK_TOKENS  # a shared prefix is a whole number of these
DEFAULT_DURATION_S = 600.0


class FamilyError(Exception):
    """An unknown family name; the message lists the known ones."""


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """Token counts log-normal around `median`, clipped to [low, high]."""

    low: int
    median: int
    high: int
    sigma: float = 0.6

    def __str__(self) -> str:
        return f"{self.low}-{self.high} (median {self.median})"

    def draw(self, rng: random.Random) -> int:
        value = int(rng.lognormvariate(math.log(self.median), self.sigma))
        return max(self.low, min(self.high, value))


class FamilySpec(Protocol):
    """A family: its parameters (frozen dataclass fields) and the requests they generate."""

    @property
    def name(self) -> str: ...

    @property
    def rate_per_s(self) -> float: ...

    @property
    def duration_s(self) -> float: ...

    @property
    def seed(self) -> int: ...

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]: ...

    def describe(self) -> str: ...


def zipf_picker(count: int, exponent: float) -> list[float]:
    """Cumulative weights of ranks 1..count under Zipf(exponent), for `random.choices`."""
    return list(itertools.accumulate(1 / rank**exponent for rank in range(1, count + 1)))


def zipf_draw(rng: random.Random, cumulative: Sequence[float]) -> int:
    index = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
    return min(index, len(cumulative) - 1)


def session_starts(
    rate: float, start_s: float, end_s: float, rng: random.Random
) -> Iterator[float]:
    t = start_s + rng.expovariate(rate)
    while t < end_s:
        yield t
        t += rng.expovariate(rate)


@dataclass(frozen=True, slots=True)
class Draft:
    """A request before it has an id: arrivals are sorted before ids are given."""

    key: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: Tenant
    chunk_ids: tuple[int, ...] = ()


def finish(drafts: list[Draft], prefix: str, duration_s: float) -> list[SimRequest]:
    """The drafts arriving within [0, duration_s), in arrival order, with ids and hashes."""
    kept = sorted((d for d in drafts if 0 <= d.arrival_s < duration_s), key=lambda d: d.arrival_s)
    return [
        SimRequest(
            f"{prefix}{d.key}",
            d.arrival_s,
            d.prompt_tokens,
            d.output_tokens,
            d.tenant.name,
            d.tenant.tier,
            salted_blocks(d.tenant.name, d.chunk_ids, d.prompt_tokens) if d.chunk_ids else (),
        )
        for d in kept
    ]


def between(bounds: tuple[int, int]) -> str:
    return f"{bounds[0]}-{bounds[1]}"


def chunks_for(tokens: int) -> int:
    return -(-tokens // CHUNK)


@dataclass(frozen=True, slots=True)
class CodeFamily:
    """Prefill-heavy: long repository context shared within a tenant, short outputs."""

    name: str = "code"
    rate_per_s: float = 96.0
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 11
    tenants: tuple[Tenant, ...] = DEFAULT_TENANTS
    repositories_per_tenant: int = 4
    repository_zipf: float = 1.2
    repository_chunks: tuple[int, int] = (3, 7)
    file_chunks: tuple[int, int] = (1, 3)
    requests_per_session: tuple[int, int] = (1, 8)
    mean_gap_s: float = 10.0
    instruction: TokenSpan = TokenSpan(50, 150, 400)
    output: TokenSpan = TokenSpan(30, 60, 150)

    def describe(self) -> str:
        return (
            f"code: {self.rate_per_s:g} req/s, sessions of {between(self.requests_per_session)} requests "
            f"{self.mean_gap_s:g} s apart on one of {self.repositories_per_tenant} repositories "
            f"per tenant (Zipf {self.repository_zipf}, {between(self.repository_chunks)} x {CHUNK} "
            f"tokens) + a file {between(self.file_chunks)} chunks + instruction {self.instruction}; "
            f"output {self.output}; seed {self.seed}"
        )

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]:
        rng = random.Random(self.seed if seed is None else seed)
        rate = rate or self.rate_per_s
        duration = duration_s or self.duration_s
        ids = itertools.count(1)
        repos = {
            t.name: [
                tuple(itertools.islice(ids, rng.randint(*self.repository_chunks)))
                for _ in range(self.repositories_per_tenant)
            ]
            for t in self.tenants
        }
        popularity = zipf_picker(self.repositories_per_tenant, self.repository_zipf)
        picker = TenantPicker(self.tenants)
        low, high = self.requests_per_session
        per_session = (low + high) / 2
        drafts: list[Draft] = []
        for session, start in enumerate(session_starts(rate / per_session, -60, duration, rng)):
            tenant = picker.draw(rng)
            repo = repos[tenant.name][zipf_draw(rng, popularity)]
            open_file = tuple(itertools.islice(ids, rng.randint(*self.file_chunks)))
            t = start
            for turn in range(rng.randint(low, high)):
                instruction = self.instruction.draw(rng)
                own = next(ids)  # the instruction's chunk: this request's alone
                prompt = (len(repo) + len(open_file)) * CHUNK + instruction
                drafts.append(
                    Draft(
                        f"{session}.{turn}",
                        t,
                        prompt,
                        self.output.draw(rng),
                        tenant,
                        (*repo, *open_file, own),
                    )
                )
                t += rng.expovariate(1 / self.mean_gap_s)
        return finish(drafts, "co", duration)


@dataclass(frozen=True, slots=True)
class GenerationFamily:
    """Decode-heavy: short prompts, long outputs, nothing shared."""

    name: str = "generation"
    rate_per_s: float = 48.0
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 12
    tenants: tuple[Tenant, ...] = DEFAULT_TENANTS
    prompt: TokenSpan = TokenSpan(100, 250, 500)
    output: TokenSpan = TokenSpan(500, 900, 2000)

    def describe(self) -> str:
        return (
            f"generation: {self.rate_per_s:g} req/s Poisson, prompt {self.prompt}, "
            f"output {self.output}, no shared prefix; seed {self.seed}"
        )

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]:
        rng = random.Random(self.seed if seed is None else seed)
        duration = duration_s or self.duration_s
        picker = TenantPicker(self.tenants)
        drafts = [
            Draft(str(i), t, self.prompt.draw(rng), self.output.draw(rng), picker.draw(rng))
            for i, t in enumerate(session_starts(rate or self.rate_per_s, 0, duration, rng))
        ]
        return finish(drafts, "ge", duration)


@dataclass(frozen=True, slots=True)
class ChatFamily:
    """Multi-turn: every turn resends the conversation so far after a per-tenant system prompt."""

    name: str = "chat"
    rate_per_s: float = 128.0
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 13
    tenants: tuple[Tenant, ...] = DEFAULT_TENANTS
    turns: tuple[int, int] = (2, 10)
    system_chunks: tuple[int, int] = (1, 2)
    message: TokenSpan = TokenSpan(30, 100, 400)
    reply: TokenSpan = TokenSpan(30, 150, 800)
    mean_think_s: float = 15.0
    stream_s_per_token: float = 0.025
    warmup_s: float = 600.0

    def describe(self) -> str:
        return (
            f"chat: {self.rate_per_s:g} req/s in conversations of {between(self.turns)} turns, system "
            f"prompt {between(self.system_chunks)} x {CHUNK} tokens per tenant, message {self.message}, "
            f"reply {self.reply}, think time exp mean {self.mean_think_s:g} s; seed {self.seed}"
        )

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]:
        rng = random.Random(self.seed if seed is None else seed)
        rate = rate or self.rate_per_s
        duration = duration_s or self.duration_s
        ids = itertools.count(1)
        systems = {
            t.name: tuple(itertools.islice(ids, rng.randint(*self.system_chunks)))
            for t in self.tenants
        }
        picker = TenantPicker(self.tenants)
        per_conversation = sum(self.turns) / 2
        drafts: list[Draft] = []
        starts = session_starts(rate / per_conversation, -self.warmup_s, duration, rng)
        for conversation, start in enumerate(starts):
            tenant = picker.draw(rng)
            chunks = list(systems[tenant.name])
            history = len(chunks) * CHUNK  # tokens so far: system prompt, then turns
            t = start
            for turn in range(rng.randint(*self.turns)):
                prompt = history + self.message.draw(rng)
                chunks += [next(ids) for _ in range(chunks_for(prompt) - len(chunks))]
                reply = self.reply.draw(rng)
                drafts.append(
                    Draft(f"{conversation}.{turn}", t, prompt, reply, tenant, tuple(chunks))
                )
                history = prompt + reply
                t += reply * self.stream_s_per_token + rng.expovariate(1 / self.mean_think_s)
        return finish(drafts, "ch", duration)


@dataclass(frozen=True, slots=True)
class RagFamily:
    """Retrieval: a system prompt and 1-3 popular documents from the tenant's corpus."""

    name: str = "rag"
    rate_per_s: float = 96.0
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 14
    tenants: tuple[Tenant, ...] = DEFAULT_TENANTS
    system_chunks: int = 1
    documents_per_tenant: int = 300
    document_chunks: tuple[int, int] = (1, 3)
    documents_per_request: tuple[int, int] = (1, 3)
    popularity_zipf: float = 1.1
    question: TokenSpan = TokenSpan(20, 60, 200)
    output: TokenSpan = TokenSpan(50, 180, 500)

    def describe(self) -> str:
        return (
            f"rag: {self.rate_per_s:g} req/s Poisson, system prompt {self.system_chunks} x "
            f"{CHUNK} tokens + {between(self.documents_per_request)} of {self.documents_per_tenant} "
            f"documents per tenant ({between(self.document_chunks)} chunks, Zipf "
            f"{self.popularity_zipf}) + question {self.question}; output {self.output}; "
            f"seed {self.seed}"
        )

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]:
        rng = random.Random(self.seed if seed is None else seed)
        duration = duration_s or self.duration_s
        ids = itertools.count(1)
        systems = {t.name: tuple(itertools.islice(ids, self.system_chunks)) for t in self.tenants}
        corpora = {
            t.name: [
                tuple(itertools.islice(ids, rng.randint(*self.document_chunks)))
                for _ in range(self.documents_per_tenant)
            ]
            for t in self.tenants
        }
        popularity = zipf_picker(self.documents_per_tenant, self.popularity_zipf)
        picker = TenantPicker(self.tenants)
        drafts: list[Draft] = []
        for i, t in enumerate(session_starts(rate or self.rate_per_s, 0, duration, rng)):
            tenant = picker.draw(rng)
            wanted = rng.randint(*self.documents_per_request)
            picked: list[int] = []
            while len(picked) < wanted:
                document = zipf_draw(rng, popularity)
                if document not in picked:
                    picked.append(document)
            documents = [c for d in picked for c in corpora[tenant.name][d]]
            chunks = (*systems[tenant.name], *documents, next(ids))
            prompt = (len(chunks) - 1) * CHUNK + self.question.draw(rng)
            drafts.append(Draft(str(i), t, prompt, self.output.draw(rng), tenant, chunks))
        return finish(drafts, "ra", duration)


SHORT_CHAT = LengthMix(classes=(LengthClass(1.0, 400, 120, 0.7),))
AZURE_CHAT = LengthMix(classes=(LengthClass(1.0, 1000, 130, 0.8),))


def with_system_prompt(
    requests: list[SimRequest], tenants: Sequence[Tenant], prefix: str
) -> list[SimRequest]:
    """Each request after its tenant's one-chunk system prompt: shared blocks, as a chat
    service's requests have, on a workload drawn without them."""
    system = {t.name: index for index, t in enumerate(tenants, start=1)}
    own = itertools.count(len(tenants) + 1)
    out = []
    for index, r in enumerate(requests):
        prompt = CHUNK + r.prompt_tokens
        chunks = (system[r.tenant], *itertools.islice(own, chunks_for(r.prompt_tokens)))
        out.append(
            replace(
                r,
                request_id=f"{prefix}{index}",
                prompt_tokens=prompt,
                block_hashes=salted_blocks(r.tenant, chunks, prompt),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class BurstyFamily:
    """A Poisson base with on/off bursts of several times its rate."""

    name: str = "bursty"
    rate_per_s: float = 64.0
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 15
    tenants: tuple[Tenant, ...] = DEFAULT_TENANTS
    burst_multiplier: float = 4.0
    burst_every_s: float = 30.0
    burst_length_s: float = 10.0
    lengths: LengthMix = field(default=SHORT_CHAT)

    def describe(self) -> str:
        c = self.lengths.classes[0]
        return (
            f"bursty: {self.rate_per_s:g} req/s base, bursts at {self.burst_multiplier:g}x for "
            f"{self.burst_length_s:g} s, one in every {self.burst_every_s:g} s; prompt median "
            f"{c.prompt_median} + {CHUNK} system, output median {c.output_median}; "
            f"seed {self.seed}"
        )

    def bursts(self, duration_s: float, rng: random.Random) -> list[tuple[float, float]]:
        """One burst in every period of `burst_every_s`, at a random offset within it, so a
        window as short as one period still holds a burst."""
        starts = []
        t = 0.0
        while t < duration_s:
            starts.append(t + rng.uniform(0, self.burst_every_s - self.burst_length_s))
            t += self.burst_every_s
        return [(start, start + self.burst_length_s) for start in starts if start < duration_s]

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]:
        rng = random.Random(self.seed if seed is None else seed)
        rate = rate or self.rate_per_s
        duration = duration_s or self.duration_s
        arrivals = list(session_starts(rate, 0, duration, rng))
        extra = rate * (self.burst_multiplier - 1)  # on top of the base within a burst
        for start, end in self.bursts(duration, rng):
            arrivals += session_starts(extra, start, min(end, duration), rng)
        picker = TenantPicker(self.tenants)
        drafts = []
        for i, t in enumerate(sorted(arrivals)):
            prompt, output = self.lengths.draw(rng)
            drafts.append(Draft(str(i), t, prompt, output, picker.draw(rng)))
        return with_system_prompt(finish(drafts, "", duration), self.tenants, "bu")


@dataclass(frozen=True, slots=True)
class DiurnalFamily:
    """A sinusoidal day compressed into the window."""

    name: str = "diurnal"
    rate_per_s: float = 128.0
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 16
    tenants: tuple[Tenant, ...] = DEFAULT_TENANTS
    peak_to_trough: float = 4.0
    lengths: LengthMix = field(default=AZURE_CHAT)

    def describe(self) -> str:
        c = self.lengths.classes[0]
        return (
            f"diurnal: {self.rate_per_s:g} req/s mean, peak/trough {self.peak_to_trough:g} over "
            f"one day compressed into the window; prompt median {c.prompt_median} + {CHUNK} "
            f"system, output median {c.output_median}; seed {self.seed}"
        )

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]:
        seed = self.seed if seed is None else seed
        duration = duration_s or self.duration_s
        requests = diurnal(
            rate or self.rate_per_s,
            duration,
            peak_to_trough=self.peak_to_trough,
            period_s=duration,
            lengths=self.lengths,
            tenants=self.tenants,
            seed=seed,
        )
        return with_system_prompt(requests, self.tenants, "di")


FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        CodeFamily(),
        GenerationFamily(),
        ChatFamily(),
        RagFamily(),
        BurstyFamily(),
        DiurnalFamily(),
    )
}


@dataclass(frozen=True, slots=True)
class Blend:
    """Several families on one model at once: one service's applications sharing a fleet,
    prefill-heavy code beside decode-heavy generation, say. Written `code:48+generation:24`
    (each family at that many requests a second; a part without `:rate` runs at its family's
    own). Each part is its family's requests exactly as generated alone, at seed `family's
    own + seed` (the blend's seed is an offset, 0 by default), merged in arrival order, so a
    blend holds nothing its parts do not; `rate` rescales every part alike."""

    parts: tuple[tuple[str, float], ...]
    seed: int = 0

    @property
    def name(self) -> str:
        return "+".join(f"{name}:{rate:g}" for name, rate in self.parts)

    @property
    def rate_per_s(self) -> float:
        return sum(rate for _, rate in self.parts)

    @property
    def duration_s(self) -> float:
        return max(FAMILIES[name].duration_s for name, _ in self.parts)

    def describe(self) -> str:
        return "blend of " + "; ".join(
            f"{name} at {rate:g} req/s ({FAMILIES[name].describe()})" for name, rate in self.parts
        )

    def generate(
        self, *, seed: int | None = None, rate: float | None = None, duration_s: float | None = None
    ) -> list[SimRequest]:
        offset = self.seed if seed is None else seed
        scale = 1.0 if rate is None else rate / self.rate_per_s
        requests: list[SimRequest] = []
        for name, part_rate in self.parts:
            spec = FAMILIES[name]
            requests += spec.generate(
                seed=spec.seed + offset,
                rate=part_rate * scale,
                duration_s=duration_s or self.duration_s,
            )
        # Each family names its requests with a prefix of its own: ids stay unique.
        return sorted(requests, key=lambda request: request.arrival_s)


def parse_blend(text: str) -> Blend:
    """`code:48+generation:24` -> Blend; FamilyError on an unknown or repeated family or a
    rate that is not a positive number."""
    parts: list[tuple[str, float]] = []
    for part in text.split("+"):
        name, colon, rate_text = part.partition(":")
        spec = family(name)
        try:
            rate = float(rate_text) if colon else spec.rate_per_s
        except ValueError:
            rate = math.nan
        if not (math.isfinite(rate) and rate > 0):
            raise FamilyError(f"{part!r}: a blend's part is FAMILY or FAMILY:RATE, RATE > 0")
        if name in (n for n, _ in parts):
            raise FamilyError(f"{text!r}: family {name!r} twice in one blend")
        parts.append((name, rate))
    return Blend(tuple(parts))


def family(name: str) -> FamilySpec:
    """The family of this name, or the blend it writes (`code:48+generation:24`, `Blend`);
    FamilyError naming the known families otherwise."""
    if "+" in name or ":" in name:
        return parse_blend(name)
    if name not in FAMILIES:
        raise FamilyError(f"unknown workload family {name!r}: one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def parse_families(text: str) -> list[str]:
    """`code,chat`, `all` or blends (`code:48+generation:24,chat`) -> names; FamilyError on
    an unknown one."""
    names = list(FAMILIES) if text == "all" else [n for n in text.split(",") if n]
    for name in names:
        family(name)
    return names
