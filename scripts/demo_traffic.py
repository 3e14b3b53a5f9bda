"""A trickle of chat traffic for the demo, so the console has something live to show.

`make run` starts it once the platform is ready (PLATFORM_DEMO_TRAFFIC=0 turns it off). It
uses the demo API key through the official `openai` client: Poisson arrivals, a mix of short
and long prompts, of models and priority tiers, most requests streamed.

It can start before any node has registered a model: it waits for /v1/models to list one
(polling with backoff, one line said while waiting), and it never sends a request without.
It lists them again every `MODELS_REFRESH_S`, so models deployed later get traffic too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import openai
from openai.types.chat import ChatCompletionMessageParam

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "engineers",
    "measure",
    "latency",
    "and",
    "cost",
    "across",
    "heterogeneous",
    "accelerators",
    "serving",
    "many",
    "tenants",
    "with",
    "strict",
    "objectives",
]
TIERS = ("interactive", "interactive", "standard", "standard", "batch")
FIRST_POLL_S = 1.0
LONGEST_POLL_S = 30.0
MODELS_REFRESH_S = 30.0


def prompt(rng: random.Random) -> str:
    length = int(rng.lognormvariate(4.0, 1.0)) + 5
    return " ".join(rng.choice(WORDS) for _ in range(min(length, 2000)))


async def one_request(client: openai.AsyncOpenAI, models: list[str], rng: random.Random) -> None:
    model = rng.choice(models)
    tier = rng.choice(TIERS)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt(rng)}]
    max_tokens = rng.choice((16, 32, 64, 128, 256))
    try:
        if rng.random() < 0.8:
            stream = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-priority": tier},
            )
            async for _ in stream:
                pass
        else:
            await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                extra_headers={"x-priority": tier},
            )
    except openai.APIError as error:
        print(f"demo request to {model} ({tier}) failed: {error}", flush=True)


async def list_models(client: openai.AsyncOpenAI) -> list[str]:
    """What /v1/models lists now; none when the gateway does not answer."""
    try:
        return [model.id async for model in client.models.list()]
    except openai.APIError:
        return []


async def wait_for_models(
    client: openai.AsyncOpenAI,
    first_poll_s: float = FIRST_POLL_S,
    longest_poll_s: float = LONGEST_POLL_S,
) -> list[str]:
    """The models of /v1/models once it lists any, polled with a doubling pause (a gateway
    not answering yet counts as none)."""
    pause_s = first_poll_s
    said = False
    while True:
        models = await list_models(client)
        if models:
            return models
        if not said:
            print("demo traffic: waiting for a model to be deployed (GET /v1/models)", flush=True)
            said = True
        await asyncio.sleep(pause_s)
        pause_s = min(pause_s * 2, longest_poll_s)


async def run(base_url: str, api_key: str, rate: float, seed: int) -> None:
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    models = await wait_for_models(client)
    print(f"demo traffic: {rate:g} requests/s over {', '.join(models)}", flush=True)
    pending: set[asyncio.Task[None]] = set()
    listed_at = time.monotonic()
    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.monotonic() - listed_at >= MODELS_REFRESH_S:
            # Models come and go (nodes register, a rollout adds a version): list them again.
            listed_at = time.monotonic()
            models = await list_models(client) or models
        task = asyncio.create_task(one_request(client, models, rng))
        pending.add(task)
        task.add_done_callback(pending.discard)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(run(args.base_url, args.api_key, args.rate, args.seed))


if __name__ == "__main__":
    main()
