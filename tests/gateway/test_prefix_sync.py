"""Gateways keep their prefix indexes in step through Redis: where one sends a prefix, the
others learn, so a shared document is not prefilled once per gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from serving.gateway.prefix_sync import PrefixSync
from serving.gateway.service import Gateway, GatewayConfig
from serving.router import Decision, PrefixIndex, Reason, ReplicaState, RouteRequest
from tenants.keys import KeyPrincipal
from tests.serving.test_router import MODEL, replica


async def test_what_one_gateway_records_the_others_learn_and_it_skips_its_own(
    redis_client: redis.Redis,
) -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    indexes = {"a": PrefixIndex(), "b": PrefixIndex()}
    syncs = {
        name: PrefixSync(client, name, holding(index), flush_s=0.01)
        for name, index in indexes.items()
    }
    try:
        for sync in syncs.values():
            await sync.start()
        await asyncio.wait_for(
            asyncio.gather(*(s.subscribed.wait() for s in syncs.values())), timeout=5
        )
        # Gateway a routed acme's prompt to r1 and recorded it; b has never seen it.
        indexes["a"].record("acme", (11, 12, 13), "r1")
        syncs["a"].recorded("acme", (11, 12, 13), "r1")
        syncs["a"].recorded("globex", (), "r2")  # no prefix: nothing to tell
        deadline = asyncio.get_running_loop().time() + 5
        while not indexes["b"].longest_matches("acme", (11, 12, 13, 14)):
            assert asyncio.get_running_loop().time() < deadline, "b never learnt the prefix"
            await asyncio.sleep(0.01)
        assert indexes["b"].longest_matches("acme", (11, 12, 13, 14)) == {"r1": 3}
        assert indexes["b"].longest_matches("globex", ()) == {}
        # a skipped its own message: its block kept one holder, recorded once.
        assert indexes["a"].longest_matches("acme", (11, 12, 13)) == {"r1": 3}
        assert len(indexes["a"]) == 3
    finally:
        for sync in syncs.values():
            await sync.close()
        await client.aclose()


def test_a_malformed_or_foreign_batch_is_refused_without_touching_the_index() -> None:
    index = PrefixIndex()
    sync = PrefixSync(None, "a", lambda: index)  # type: ignore[arg-type]  # no Redis needed
    assert sync.apply(b'{"g": "a", "r": [["acme", [1], "r1"]]}') == 0  # its own
    assert sync.apply(b'{"g": "b", "r": [["acme", [1, 2], "r9"]]}') == 1
    assert index.longest_matches("acme", (1, 2)) == {"r9": 2}
    for bad in (b"not json", b"[1]", b'{"g": "b", "r": [["acme", 7, "r1"]]}'):
        with pytest.raises((ValueError, TypeError)):
            sync.apply(bad)
    assert len(index) == 2


def holding(index: PrefixIndex) -> Callable[[], PrefixIndex]:
    return lambda: index


class Chooses:
    """A policy that sends everything to one replica (the gateway's own bookkeeping is
    what is under test)."""

    def __init__(self, replica: ReplicaState, prefill: ReplicaState | None = None) -> None:
        self.replica, self.prefill = replica, prefill

    def choose(self, request: RouteRequest, now: float) -> Decision:
        return Decision(
            self.replica, Reason.CHEAPEST_MEETING_SLO, "test", prefill_replica=self.prefill
        )


async def test_the_gateway_tells_the_others_where_it_sent_each_prefix(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = Gateway(GatewayConfig(redis_url=settings.REDIS_URL), load_principal=no_principal)
    colocated, prefill = replica("colocated"), replica("prefill-1")
    prompt = RouteRequest(
        model=MODEL,
        tenant="acme",
        tier="interactive",
        prompt_tokens=64,
        max_tokens=8,
        request_id="r1",
        prefix_hashes=(5, 6, 7, 8),
    )
    try:
        monkeypatch.setattr(gateway, "policy", lambda model="": Chooses(colocated))
        gateway.choose(prompt, frozenset())
        gateway.choose(replace(prompt, prefix_hashes=()), frozenset())  # nothing to tell
        # A disaggregated request's prefix is computed, and cached, on its prefill replica.
        monkeypatch.setattr(gateway, "policy", lambda model="": Chooses(colocated, prefill))
        gateway.choose(prompt, frozenset())
        assert gateway.prefix_sync._pending == [
            ("acme", (5, 6, 7, 8), "colocated"),
            ("acme", (5, 6, 7, 8), "prefill-1"),
        ]
    finally:
        await gateway.redis.aclose()


async def no_principal(secret: str) -> KeyPrincipal | None:
    return None  # no key is looked up here
