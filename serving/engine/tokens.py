"""The prompt-token estimate shared by the engine simulator and the gateway.

There is no tokenizer here (no model files, no network). The rule: one token per 4 UTF-8 bytes,
rounded up, and at least one token per whitespace-separated word, so short-word text is not
undercounted. The gateway reserves with the same function, so both sides agree exactly.
"""

from __future__ import annotations

import hashlib

BYTES_PER_TOKEN = 4


def estimate_prompt_tokens(text: str) -> int:
    by_bytes = -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)
    by_words = len(text.split())
    return max(1, by_bytes, by_words)


def render_chat_prompt(messages: list[tuple[str, str]]) -> str:
    """The text a chat request is counted and prefix-hashed by: one "role: content" line per
    message, a stand-in for the model's chat template. The gateway estimates with
    estimate_prompt_tokens(render_chat_prompt(...)) and gets the engine's exact count."""
    return "".join(f"{role}: {content}\n" for role, content in messages)


def prompt_block_hashes(text: str, block_size: int = 16, salt: str = "") -> tuple[int, ...]:
    """Chained hashes of the prompt's full KV blocks, as vLLM's prefix cache keys them: block i's
    hash covers every byte up to its end, so equal hashes mean equal prefixes. A block is
    block_size estimated tokens, i.e. block_size x 4 bytes. The salt (a LoRA adapter's name, as
    vLLM mixes the adapter into its block keys) keeps equal text under different weights apart."""
    data = text.encode("utf-8")
    block_bytes = block_size * BYTES_PER_TOKEN
    full_blocks = min(len(data) // block_bytes, estimate_prompt_tokens(text) // block_size)
    hashes: list[int] = []
    digest = hashlib.blake2b(salt.encode("utf-8"), digest_size=8)
    for i in range(full_blocks):
        digest.update(data[i * block_bytes : (i + 1) * block_bytes])
        hashes.append(int.from_bytes(digest.copy().digest(), "big"))
    return tuple(hashes)
