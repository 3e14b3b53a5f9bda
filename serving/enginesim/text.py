"""Deterministic filler text and output lengths."""

from __future__ import annotations

import hashlib
import math
import random

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "can",
    "has",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "token",
    "engine",
    "batch",
    "cache",
    "prefix",
    "latency",
    "stream",
    "request",
    "reply",
]

# EOS emulation when a request sets no max_tokens: a log-normal length with a median of 128
# tokens, close to the Azure conversation trace's median of 129 generated tokens.
EOS_MEDIAN_TOKENS = 128
EOS_SIGMA = 0.9


def request_rng(seed: int | None, prompt_text: str) -> random.Random:
    """Seeded by the request's `seed`, else by its prompt, so equal requests get equal replies."""
    if seed is not None:
        return random.Random(seed)
    digest = hashlib.blake2b(prompt_text.encode("utf-8"), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def eos_length(rng: random.Random, limit: int) -> int:
    drawn = math.exp(rng.gauss(math.log(EOS_MEDIAN_TOKENS), EOS_SIGMA))
    return max(1, min(limit, round(drawn)))


def next_word(rng: random.Random) -> str:
    return " " + rng.choice(WORDS)
