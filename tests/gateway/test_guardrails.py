"""The guardrail chain on the event loop: a large prompt is checked on a worker thread, so a
tenant's patterns taking a while on it do not stall every other request; the answer is the
same either way."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from serving.gateway.errors import ApiError
from serving.gateway.guardrails import (
    DEFAULT_CHAIN,
    OFF_LOOP_PROMPT_CHARS,
    GuardrailInput,
    load_chain,
    run_guardrails,
)

CHAIN = load_chain(DEFAULT_CHAIN)
LARGE = OFF_LOOP_PROMPT_CHARS + 1


def prompt(texts: list[str], patterns: tuple[str, ...] = (r"project\s+falcon",)) -> GuardrailInput:
    return GuardrailInput(
        tenant_slug="acme",
        model="m",
        prompt_texts=texts,
        prompt_tokens=10,
        max_prompt_tokens=None,
        blocked_patterns=patterns,
    )


@pytest.mark.parametrize("size", [100, LARGE])
async def test_a_blocked_pattern_is_refused_whatever_the_prompts_size(size: int) -> None:
    text = "x" * (size - len("Project  Falcon")) + "Project  Falcon"
    with pytest.raises(ApiError) as raised:
        await run_guardrails(CHAIN, prompt([text]))
    assert raised.value.status == 400
    assert raised.value.code == "guardrail_refused"


@pytest.mark.parametrize("size", [100, LARGE])
async def test_a_clean_prompt_passes_whatever_its_size(size: int) -> None:
    await run_guardrails(CHAIN, prompt(["project " * (size // 8 + 1)]))


async def test_a_small_prompt_is_checked_on_the_event_loop_and_a_large_one_off_it() -> None:
    seen: list[threading.Thread] = []

    def where(item: GuardrailInput) -> None:
        seen.append(threading.current_thread())

    await run_guardrails([where], prompt(["x" * OFF_LOOP_PROMPT_CHARS]))
    # Several messages count together.
    await run_guardrails([where], prompt(["x" * (LARGE // 2), "x" * (LARGE // 2 + 1)]))
    assert seen[0] is threading.current_thread()
    assert seen[1] is not threading.current_thread()


async def test_the_event_loop_keeps_running_while_a_slow_pattern_checks_a_large_prompt() -> None:
    # A pattern RE2's DFA gives up on over varied text: about 0.5 us a byte (measured), so
    # some 0.3 s on 600 KB.
    text = "".join(random.Random(1).choices("ab ", k=600_000))
    item = prompt([text], patterns=(r"a[a-z\s]{30}q",))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    started = time.monotonic()
    await run_guardrails(CHAIN, item)
    took = time.monotonic() - started
    ticker.cancel()
    assert took > 0.05, "the pattern should take a while for this test to mean anything"
    # Inline, the loop would not have ticked once while the check ran.
    assert ticks >= 3
