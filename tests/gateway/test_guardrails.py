"""The guardrail chain on the event loop: a large prompt is checked on a worker thread, so a
tenant's patterns taking a while on it do not stall every other request; the answer is the
same either way. And what the blocked patterns see: every text the model reads (tool
definitions, tool calls, names), normalised so look-alike and invisible characters hide
nothing."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import orjson
import pytest

from serving.gateway.errors import ApiError
from serving.gateway.guardrails import (
    DEFAULT_CHAIN,
    OFF_LOOP_PROMPT_CHARS,
    GuardrailInput,
    blocked_patterns,
    load_chain,
    normalize_text,
    run_guardrails,
)
from serving.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_body

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


# --- what the patterns see: every text the model reads, normalised ------------------------------


def chat(**body: object) -> list[str]:
    request = parse_body(
        ChatCompletionRequest,
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}),
    )
    texts: list[str] = request.prompt_texts()
    return texts


def refused(texts: list[str], pattern: str = "bad") -> bool:
    return blocked_patterns(prompt(texts, patterns=(pattern,))) is not None


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "name": "bad"}}]},
        {
            "tools": [
                {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "description": "a bad"}}
            ]
        },
        {
            "tools": [
                {
                    **WEATHER_TOOL,
                    "function": {
                        **WEATHER_TOOL["function"],
                        "parameters": {"properties": {"bad_idea": {"type": "string"}}},
                    },
                }
            ]
        },
        {"tool_choice": {"type": "function", "function": {"name": "do_bad"}}},
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "bad"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        },
        {"messages": [{"role": "user", "name": "badger", "content": "hello"}]},
    ],
    ids=["tool name", "description", "parameters", "tool choice", "tool call", "message name"],
)
def test_a_blocked_pattern_is_found_outside_the_message_text_too(body: dict[str, object]) -> None:
    assert refused(chat(**body))
    assert not refused(chat(**body), pattern="nowhere-in-this-request")


def test_a_completions_suffix_is_checked_like_its_prompt() -> None:
    request = parse_body(CompletionRequest, b'{"model": "m", "prompt": "x", "suffix": "so bad"}')
    assert refused(request.prompt_texts())


@pytest.mark.parametrize(
    "text",
    [
        "ｂａｄ",
        "b\u200bad",
        "b\u200dad",
        "b\u00adad",
        "𝐛𝐚𝐝",
        "ＢＡＤ",
        "b\u2060a\ufeffd",
        "b\U000e0041ad",
    ],
    ids=[
        "fullwidth",
        "zwsp",
        "zwj",
        "soft hyphen",
        "bold maths",
        "fullwidth caps",
        "joiners",
        "tag",
    ],
)
def test_look_alike_and_invisible_characters_do_not_hide_a_blocked_word(text: str) -> None:
    assert refused([f"this is {text} news"])


def test_normalisation_leaves_other_text_alone() -> None:
    assert normalize_text("plain ascii") == "plain ascii"
    assert normalize_text("café naïve 日本語") == "café naïve 日本語"
    assert not refused(["a ｂａｎｄ of bards"])


async def test_a_large_prompt_is_normalised_on_the_worker_thread_too() -> None:
    text = "ｘ" * LARGE + " ｂａｄ"
    with pytest.raises(ApiError):
        await run_guardrails(CHAIN, prompt([text], patterns=("bad",)))
