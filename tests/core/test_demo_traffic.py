"""The demo traffic of `make run` against a real gateway: before any model is deployed it
waits (one line said, no traceback), and it starts once /v1/models lists one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis

from scripts import demo_traffic
from tests.gateway.conftest import (  # noqa: F401  (fixtures)
    MODEL,
    Fleet,
    GatewayServer,
    fleet,
    gateway_server,
    make_key,
    publish_catalog,
)

pytestmark = pytest.mark.slow


def test_it_waits_for_a_model_without_raising_then_uses_it(
    gateway_server: GatewayServer,  # noqa: F811
    fleet: Fleet,  # noqa: F811
    make_key: Callable[..., Any],  # noqa: F811
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = make_key("acme")

    def deploy_the_model() -> None:
        fleet.start()
        fleet.publish()
        publish_catalog(redis_client)

    async def scenario() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{gateway_server.url}/v1", api_key=key.secret, max_retries=0, timeout=10
        )
        waiting = asyncio.create_task(
            demo_traffic.wait_for_models(client, first_poll_s=0.05, longest_poll_s=0.2)
        )
        await asyncio.sleep(1.5)  # several polls of an empty /v1/models
        assert not waiting.done()  # had it raised, the task would be done with the exception
        await asyncio.to_thread(deploy_the_model)
        models = await asyncio.wait_for(waiting, timeout=10)
        await client.close()
        return models

    assert asyncio.run(scenario()) == [MODEL]
    said = capsys.readouterr().out.splitlines()
    assert said == ["demo traffic: waiting for a model to be deployed (GET /v1/models)"]


async def test_a_gateway_that_does_not_answer_yet_is_waited_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    client = openai.AsyncOpenAI(
        base_url="http://127.0.0.1:9/v1", api_key="sk-none", max_retries=0, timeout=1
    )
    waiting = asyncio.create_task(
        demo_traffic.wait_for_models(client, first_poll_s=0.05, longest_poll_s=0.1)
    )
    await asyncio.sleep(0.5)
    assert not waiting.done()  # had it raised, the task would be done with the exception
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert capsys.readouterr().out.count("waiting for a model") == 1
    await client.close()
