"""Input guardrails: cheap checks that refuse a request before any GPU time is spent.

A guardrail is any callable `(GuardrailInput) -> str | None`: None lets the request through,
a string refuses it with a 400 carrying that message. The chain is configurable in settings
(`GATEWAY_GUARDRAILS`, dotted paths), so an operator can add their own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module

from serving.gateway.errors import ApiError


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


@lru_cache(maxsize=1024)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    valid = []
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error:
            continue  # a bad pattern is the tenant's config error, not the caller's
        valid.append(f"(?:{pattern})")
    return re.compile("|".join(valid), re.IGNORECASE) if valid else None


def blocked_patterns(item: GuardrailInput) -> str | None:
    matcher = _compiled(tuple(item.blocked_patterns))
    if matcher is None:
        return None
    for text in item.prompt_texts:
        if matcher.search(text):
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


def run_guardrails(chain: Sequence[Guardrail], item: GuardrailInput) -> None:
    for guardrail in chain:
        refusal = guardrail(item)
        if refusal is not None:
            raise ApiError(400, refusal, code="guardrail_refused", param="messages")
