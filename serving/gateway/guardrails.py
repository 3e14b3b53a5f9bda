"""Input guardrails: cheap checks that refuse a request before any GPU time is spent.

A guardrail is any callable `(GuardrailInput) -> str | None`: None lets the request through,
a string refuses it with a 400 carrying that message. `prompt_texts` holds every text of the
request the model reads: message contents and names, tool definitions and tool calls (see
`ChatCompletionRequest.prompt_texts`). The blocked patterns match them after Unicode
normalisation (`normalize_text`), so look-alike and invisible characters do not slip a word past. The chain is configurable in settings
(`GATEWAY_GUARDRAILS`, dotted paths), so an operator can add their own. On a large prompt the
chain runs on a worker thread, so a guardrail must not touch the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import import_module
from typing import Any

import re2

from serving.gateway.errors import ApiError

logger = logging.getLogger(__name__)

# A tenant's patterns run over every prompt of theirs, on a worker that serves everyone, so
# they run on RE2, whose matching time is linear in the prompt whatever the pattern (Python's
# backtracking `re` takes exponential time on `(a+)+$`); RE2 has no backreferences and no
# lookarounds. Linear times the program's size: on patterns its DFA gives up on, RE2 takes
# about 15 ns per prompt byte per instruction (measured), so one tenant's patterns together
# may compile to at most this many instructions. A dozen PII and secret patterns take ~1,000.
MAX_PATTERN_PROGRAM_SIZE = 2_000
# On a prompt longer than this (in characters, so at least as many UTF-8 bytes) the chain runs
# on a worker thread: the patterns above may take seconds on a prompt of megabytes, and RE2
# releases the GIL while it matches, so the event loop goes on serving everyone else. Shorter
# prompts take well under a millisecond, less than the hop to a thread.
OFF_LOOP_PROMPT_CHARS = 64 * 1024


@dataclass(frozen=True, slots=True)
class GuardrailInput:
    tenant_slug: str
    model: str
    prompt_texts: Sequence[str]
    prompt_tokens: int
    max_prompt_tokens: int | None
    blocked_patterns: Sequence[str]


Guardrail = Callable[[GuardrailInput], str | None]


def prompt_size(item: GuardrailInput) -> str | None:
    if item.max_prompt_tokens is not None and item.prompt_tokens > item.max_prompt_tokens:
        return (
            f"The prompt is about {item.prompt_tokens} tokens, over this key's limit of "
            f"{item.max_prompt_tokens}. Shorten it or ask your tenant admin for a larger limit."
        )
    return None


class PatternError(ValueError):
    """A blocked pattern RE2 cannot run, or patterns over the size limit; says which and why."""


def _pattern_options() -> Any:
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False  # a tenant's typo is not worth a line on stderr
    return options


def compile_pattern(pattern: str) -> Any:
    """`pattern` compiled for RE2, case-insensitive; PatternError if RE2 cannot run it.

    Compiled as the group it becomes in a tenant's combined program, so that one that
    compiles here also combines (`\\Qa` alone is fine, `(?:\\Qa)` is not).
    """
    try:
        return re2.compile(f"(?:{pattern})", _pattern_options())
    except re2.error as error:
        reason = error.args[0] if error.args else "unknown error"
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        raise PatternError(
            f"'{pattern}' is not a pattern the gateway can run: {reason}. Patterns use RE2 "
            "syntax, which has no backreferences (\\1) and no lookarounds ((?=, (?!, (?<=, (?<!)."
        ) from None


def check_blocked_patterns(patterns: Sequence[str]) -> None:
    """PatternError unless every pattern compiles under RE2 and together they fit the limit."""
    size = sum(compile_pattern(pattern).programsize for pattern in patterns)
    if size > MAX_PATTERN_PROGRAM_SIZE:
        raise PatternError(
            f"These patterns compile to {size} RE2 instructions together, over the limit of "
            f"{MAX_PATTERN_PROGRAM_SIZE}. Remove some, or shorten counted repetitions like "
            "{1,100}, which are the largest."
        )


@lru_cache(maxsize=1024)
def _compiled(tenant_slug: str, patterns: tuple[str, ...]) -> tuple[Any, ...]:
    """A tenant's patterns as one case-insensitive RE2 program (none when it has none).

    The API checks patterns as they are saved; ones saved before it checked them the same
    way are skipped here with a warning, not turned into a failure of every request.
    Cached, so each warning is logged once per process.
    """
    valid, size = [], 0
    for pattern in patterns:
        try:
            program_size = compile_pattern(pattern).programsize
        except PatternError as error:
            logger.warning("Blocked pattern of %s skipped: %s", tenant_slug, error)
            continue
        if size + program_size > MAX_PATTERN_PROGRAM_SIZE:
            logger.warning(
                "Blocked pattern %r of %s skipped: the patterns before it already compile to %d "
                "of the %d RE2 instructions allowed",
                pattern,
                tenant_slug,
                size,
                MAX_PATTERN_PROGRAM_SIZE,
            )
            continue
        valid.append(pattern)
        size += program_size
    if not valid:
        return ()
    try:
        return (re2.compile("|".join(f"(?:{p})" for p in valid), _pattern_options()),)
    except re2.error as error:  # not expected of groups that compile alone; stay safe
        logger.warning("Blocked patterns of %s checked one by one: %s", tenant_slug, error)
        return tuple(compile_pattern(pattern) for pattern in valid)


# Format characters (Unicode category Cf: zero-width spaces and joiners, bidi controls, soft
# hyphens, tag characters) render as nothing, so "b\u200bad" reads as "bad" to a person and,
# once tokenized, much the same to a model. RE2 knows the category.
_FORMAT_CHARACTERS = re2.compile(r"\p{Cf}")


@cache
def _format_character_table() -> dict[int, None]:
    """`str.translate`'s table deleting every Cf character (built on first need: ~0.15 s)."""
    return dict.fromkeys(
        code for code in range(sys.maxunicode + 1) if unicodedata.category(chr(code)) == "Cf"
    )


def normalize_text(text: str) -> str:
    """`text` as the blocked patterns see it: format characters removed, then NFKC, which
    folds compatibility forms onto their plain letters ("ｂａｄ" and "𝐛𝐚𝐝" become "bad";
    case is the patterns' own, insensitive). ASCII text is returned as it is, at once; other
    text costs about 0.1 s a MB (holding the GIL), on the worker thread for a large prompt."""
    if text.isascii():
        return text
    if _FORMAT_CHARACTERS.search(text):
        text = text.translate(_format_character_table())
    return unicodedata.normalize("NFKC", text)


def blocked_patterns(item: GuardrailInput) -> str | None:
    matchers = _compiled(item.tenant_slug, tuple(item.blocked_patterns))
    if not matchers:
        return None
    for text in item.prompt_texts:
        normalized = normalize_text(text)
        if any(matcher.search(normalized) for matcher in matchers):
            return "The prompt contains content your organisation has blocked for this API."
    return None


DEFAULT_CHAIN = (
    "serving.gateway.guardrails.prompt_size",
    "serving.gateway.guardrails.blocked_patterns",
)


def load_chain(paths: Sequence[str]) -> list[Guardrail]:
    chain: list[Guardrail] = []
    for path in paths:
        module_name, _, attribute = path.rpartition(".")
        chain.append(getattr(import_module(module_name), attribute))
    return chain


def first_refusal(chain: Sequence[Guardrail], item: GuardrailInput) -> str | None:
    for guardrail in chain:
        refusal = guardrail(item)
        if refusal is not None:
            return refusal
    return None


async def run_guardrails(chain: Sequence[Guardrail], item: GuardrailInput) -> None:
    """ApiError(400) with the first refusal of the chain; off the event loop for a large
    prompt."""
    if sum(len(text) for text in item.prompt_texts) > OFF_LOOP_PROMPT_CHARS:
        refusal = await asyncio.to_thread(first_refusal, chain, item)
    else:
        refusal = first_refusal(chain, item)
    if refusal is not None:
        raise ApiError(400, refusal, code="guardrail_refused", param="messages")
