"""Gateways count each other's requests in flight through Redis: what one sends, the others
count within milliseconds; what it sent that they do not know yet it takes once per
gateway; a lost message or a dead gateway is mended by the snapshots."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import replace

import orjson
import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from serving.gateway import inflight_sync
from serving.gateway.inflight_sync import InflightSync
from serving.gateway.service import Gateway, GatewayConfig
from serving.router import ReplicaState, RouterState
from tenants.keys import KeyPrincipal
from tests.gateway.conftest import free_port
from tests.gateway.redis_proxy import RedisProxy
from tests.serving.test_router import H100, fleet, replica

# As the gateway's client retries (serving.gateway.service._redis_client): once, at once.
ONE_RETRY = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def counts(state: RouterState, replica_id: str = "r1") -> tuple[int, int, int, int, float]:
    target = state.replica(replica_id)
    assert target is not None
    return (
        target.inflight,
        target.inflight_context_tokens,
        target.prefill_pending_tokens,
        target.unsynced,
        target.tightest_tpot_s,
    )


def holding(state: RouterState) -> Callable[[], RouterState]:
    return lambda: state


def two_replicas() -> RouterState:
    return fleet(replica("r1", H100), replica("r2", H100))


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + 5
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.005)


async def test_what_one_gateway_sends_the_other_counts_and_the_sender_stops_doubling_it(
    redis_client: redis.Redis,
) -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    states = {"a": two_replicas(), "b": two_replicas()}
    channel = f"routing:inflight:test:{uuid.uuid4().hex}"  # no other gateway on it
    syncs = {
        name: InflightSync(client, name, holding(state), channel=channel)
        for name, state in states.items()
    }
    try:
        for sync in syncs.values():
            await sync.start()
        await asyncio.wait_for(
            asyncio.gather(*(s.subscribed.wait() for s in syncs.values())), timeout=5
        )
        a, b = states["a"], states["b"]
        # Gateway a sends an interactive request to r1, as the service does.
        a.request_started("r1", 600, 1.0, context_tokens=900, tpot_objective_s=0.05, unsynced=True)
        syncs["a"].started("r1", 600, 900, 0.05)
        assert counts(a) == (1, 900, 600, 1, 0.05)
        await until(lambda: counts(b)[0] == 1, "b never counted a's request")
        assert counts(b) == (1, 900, 600, 0, 0.05)
        # a's own message came back: the others have it, so a takes it once.
        await until(lambda: counts(a)[3] == 0, "a's start never synced")
        assert counts(a) == (1, 900, 600, 0, 0.05)
        # a's snapshot agrees with what b added up: nothing to correct.
        await syncs["a"].publish_snapshot()
        await until(
            lambda: "a" in syncs["b"].heard and syncs["b"].others["a"] == syncs["a"].own,
            "b never heard a's snapshot",
        )
        assert counts(b) == (1, 900, 600, 0, 0.05)
        # First token, then the finish.
        a.request_first_token("r1", 600)
        syncs["a"].first_token("r1", 600)
        await until(lambda: counts(b)[2] == 0, "b never saw the first token")
        assert not syncs["a"].finished("r1", 600, 900, 0.05, True)  # synced long ago
        a.request_finished("r1", 600, context_tokens=900, tpot_objective_s=0.05)
        await until(lambda: counts(b)[0] == 0, "b never saw the finish")
        assert counts(b) == (0, 0, 0, 0, float("inf"))
        assert counts(b, "r2")[0] == 0
    finally:
        for sync in syncs.values():
            await sync.close()
        await client.aclose()


def test_a_start_that_ends_before_its_message_returns_was_unsynced() -> None:
    sync = InflightSync(None, "a", holding(two_replicas()))  # type: ignore[arg-type]  # no Redis
    sync.started("r1", 600, 900, None)
    sync.started("r1", 600, 900, None)
    assert sync.finished("r1", 600, 900, None, False)  # refused before its first token
    # Its own batch comes back: one start left to sync, the other had finished.
    state = sync.state()
    state.request_started("r1", 600, 1.0, unsynced=True)
    batch = orjson.dumps(
        {"g": "a", "e": [["s", "r1", 600, 900, None], ["s", "r1", 600, 900, None]]}
    )
    assert sync.apply(batch, 2.0) == 1
    assert counts(state)[3] == 0
    assert not sync.finished("r1", 600, 900, None, True)


def test_a_lost_finish_and_a_dead_gateway_are_mended_by_the_snapshots() -> None:
    state = two_replicas()
    sync = InflightSync(None, "b", holding(state))  # type: ignore[arg-type]  # no Redis
    started = ["s", "r1", 600, 900, 0.05]
    sync.apply(orjson.dumps({"g": "a", "e": [started, started, ["s", "r2", 0, 100, None]]}), 1.0)
    sync.apply(orjson.dumps({"g": "c", "e": [["s", "r2", 50, 50, 0.1]]}), 1.0)
    assert counts(state) == (2, 1800, 1200, 0, 0.05)
    assert counts(state, "r2")[:2] == (2, 150)
    # a's finish of one r1 request was lost; its snapshot says one is left, first token seen.
    snapshot = {"r1": [1, 600, 900, 0, [[0.05, 1]]], "r2": [1, 0, 100, 0, []]}
    assert sync.apply(orjson.dumps({"g": "a", "c": snapshot}), 1.5) == 2
    assert counts(state) == (1, 900, 0, 0, 0.05)
    assert counts(state, "r2")[:2] == (2, 150)  # unchanged: a's count there was right
    # A finish for a start never heard of (b listened late) takes nothing away.
    sync.apply(orjson.dumps({"g": "c", "e": [["x", "r1", 10, 10, None, True]]}), 1.6)
    assert counts(state)[0] == 1
    # c keeps talking; a falls silent and dies: its requests are forgotten.
    sync.apply(orjson.dumps({"g": "c", "c": {"r2": [1, 50, 50, 50, [[0.1, 1]]]}}), 11.0)
    assert sync.forget_silent(12.0) == ["a"]
    assert counts(state) == (0, 0, 0, 0, float("inf"))
    assert counts(state, "r2")[:2] == (1, 50)


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b"[1]",
        b'{"e": []}',
        b'{"g": "z"}',
        b'{"g": "z", "e": [["s", "r1", 600, 900, null], ["q", "r1"]]}',
        b'{"g": "z", "e": [["s", "r1", "many", 900, null]]}',
        b'{"g": "z", "c": {"r1": [1, 2]}}',
    ],
)
def test_a_malformed_message_is_refused_and_changes_nothing(bad: bytes) -> None:
    state = two_replicas()
    sync = InflightSync(None, "b", holding(state))  # type: ignore[arg-type]  # no Redis
    with pytest.raises((ValueError, TypeError, KeyError)):
        sync.apply(bad, 1.0)
    assert counts(state) == (0, 0, 0, 0, float("inf"))
    assert sync.others == {}


def test_with_redis_away_every_start_stays_unsynced_and_counts_n_times() -> None:
    state = two_replicas()
    sync = InflightSync(None, "a", holding(state))  # type: ignore[arg-type]  # no Redis
    for _ in range(3):
        state.request_started("r1", 100, 1.0, unsynced=True)
        sync.started("r1", 100, 100, None)
    target: ReplicaState | None = state.replica("r1")
    assert target is not None and target.unsynced == 3  # never echoed
    assert sync.finished("r1", 100, 100, None, True)
    state.request_finished("r1", 100, unsynced=True)
    assert (target.inflight, target.unsynced) == (2, 2)


async def test_starts_lost_while_redis_was_away_are_synced_by_the_next_snapshot_back(
    redis_client: redis.Redis,
) -> None:
    # Gateway a reaches Redis through a proxy that goes down; b reaches it directly.
    proxy = RedisProxy(settings.REDIS_URL).start()
    through_proxy = aioredis.Redis.from_url(proxy.url, socket_timeout=1, retry=ONE_RETRY)
    direct = aioredis.Redis.from_url(settings.REDIS_URL)
    states = {"a": two_replicas(), "b": two_replicas()}
    channel = f"routing:inflight:test:{uuid.uuid4().hex}"
    syncs = {
        "a": InflightSync(
            through_proxy, "a", holding(states["a"]), channel=channel, snapshot_s=0.2
        ),
        "b": InflightSync(direct, "b", holding(states["b"]), channel=channel, snapshot_s=0.2),
    }
    a, b = states["a"], states["b"]
    try:
        for sync in syncs.values():
            await sync.start()
        await asyncio.wait_for(
            asyncio.gather(*(s.subscribed.wait() for s in syncs.values())), timeout=5
        )
        proxy.go_down()
        for _ in range(2):
            a.request_started("r1", 600, 1.0, context_tokens=900, unsynced=True)
            syncs["a"].started("r1", 600, 900, 0.05)
        await until(lambda: syncs["a"].lost == {("r1", 600): 2}, "a's starts were never lost")
        assert counts(b)[0] == 0  # b never heard of them
        assert counts(a)[3] == 2  # a takes them once per gateway meanwhile
        proxy.come_back()
        await asyncio.wait_for(syncs["a"].subscribed.wait(), timeout=5)
        # a's next snapshot tells b; when it comes back, b has them, and so a syncs them.
        await until(lambda: counts(b)[0] == 2, "b never counted a's lost starts")
        await until(lambda: counts(a)[3] == 0, "a's lost starts stayed unsynced")
        assert counts(a)[:3] == (2, 1800, 1200)
        assert syncs["a"].lost == {} and syncs["a"].unsynced == {}
        assert not syncs["a"].finished("r1", 600, 900, 0.05, False)  # synced: taken once
    finally:
        for sync in syncs.values():
            await sync.close()
        await through_proxy.aclose()
        await direct.aclose()
        proxy.stop()


async def test_a_lost_start_that_finished_before_the_snapshot_came_back_is_not_synced_twice(
    redis_client: redis.Redis,
) -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    state = two_replicas()
    channel = f"routing:inflight:test:{uuid.uuid4().hex}"  # nobody listens: apply by hand
    sync = InflightSync(client, "a", holding(state), channel=channel)
    try:
        for prefill in (600, 600, 50):
            state.request_started("r1", prefill, 1.0, unsynced=True)
            sync.started("r1", prefill, prefill, None)
        sync._drop_pending()  # Redis was away when they were to be published
        assert sync.lost == {("r1", 600): 2, ("r1", 50): 1}
        assert sync.finished("r1", 600, 600, None, False)  # still unsynced at its end
        state.request_finished("r1", 600, unsynced=True)
        await sync.publish_snapshot()
        assert sync.lost == {}
        # An unnumbered snapshot of a's (an older gateway's) syncs nothing.
        assert sync.apply(orjson.dumps({"g": "a", "c": {}}), 2.0) == 0
        assert counts(state)[3] == 2
        assert sync.apply(orjson.dumps({"g": "a", "c": {}, "n": 1}), 2.0) == 2
        assert (counts(state)[0], counts(state)[3]) == (2, 0)
        assert sync.unsynced == {}
        # Its own later messages still come back; none syncs anything twice.
        batch = orjson.dumps({"g": "a", "e": [["s", "r1", 600, 600, None]]})
        assert sync.apply(batch, 2.1) == 0
        assert counts(state)[3] == 0
    finally:
        await client.aclose()


async def test_an_outage_loses_no_more_starts_than_are_in_flight_and_a_failed_snapshot_is_covered_by_the_next(
    redis_client: redis.Redis,
) -> None:
    state = two_replicas()
    channel = f"routing:inflight:test:{uuid.uuid4().hex}"
    away = aioredis.Redis(host="127.0.0.1", port=free_port(), retry=Retry(NoBackoff(), 0))
    sync = InflightSync(away, "a", holding(state), channel=channel)
    back = aioredis.Redis.from_url(settings.REDIS_URL)
    try:
        # Redis away for ten snapshots, a request starting and finishing between each.
        for _ in range(10):
            state.request_started("r1", 600, 1.0, unsynced=True)
            sync.started("r1", 600, 600, None)
            with pytest.raises(RedisConnectionError):
                await sync.publish_snapshot()  # its events fail first: lost
            assert sync.finished("r1", 600, 600, None, True)
            state.request_finished("r1", 600, unsynced=True)
            assert sync.lost == {}  # the finished start is lost no more
        state.request_started("r1", 600, 1.0, unsynced=True)
        sync.started("r1", 600, 600, None)
        with pytest.raises(RedisConnectionError):
            await sync.flush()
        sync._drop_pending()
        assert sync.lost == {("r1", 600): 1}  # one in flight, one lost
        # A snapshot whose own publish fails covers nothing; the next one covers it.
        sync.redis = away
        with pytest.raises(RedisConnectionError):
            await sync.publish_snapshot()
        assert sync.lost == {("r1", 600): 1} and sync._covered == {}
        sync.redis = back
        await sync.publish_snapshot()  # number 2 (1 failed; the failed flushes took none)
        assert sync.lost == {} and list(sync._covered) == [2]
        # Its echo is lost (a's subscription was away); the next one's, 3, comes back.
        await sync.publish_snapshot()
        assert sync.apply(orjson.dumps({"g": "a", "c": {}, "n": 3}), 3.0) == 1
        assert (counts(state)[0], counts(state)[3]) == (1, 0)
        assert sync._covered == {} and sync.unsynced == {}
    finally:
        await away.aclose()
        await back.aclose()


def test_a_start_past_the_pending_cap_is_lost_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inflight_sync, "MAX_PENDING", 2)
    state = two_replicas()
    sync = InflightSync(None, "a", holding(state))  # type: ignore[arg-type]  # no Redis
    for _ in range(3):
        state.request_started("r1", 100, 1.0, unsynced=True)
        sync.started("r1", 100, 100, None)
    assert len(sync._pending) == 2 and sync.lost == {("r1", 100): 1}


async def test_the_gateway_tells_the_others_of_each_start_first_token_and_finish(
    redis_client: redis.Redis,
) -> None:
    gateway = Gateway(GatewayConfig(redis_url=settings.REDIS_URL), load_principal=no_principal)
    state = two_replicas()
    gateway.routing.snapshot = replace(gateway.routing.snapshot, state=state)
    try:
        gateway.request_started("r1", 600, 900, tpot_objective_s=0.05)
        assert counts(state) == (1, 900, 600, 1, 0.05)  # the others do not know it yet
        gateway.request_first_token("r1", 600)
        gateway.request_finished(
            "r1", 600, first_token_seen=True, context_tokens=900, tpot_objective_s=0.05
        )
        # It ended before its start came back on the channel: unsynced no more, either way.
        assert counts(state) == (0, 0, 0, 0, float("inf"))
        assert gateway.inflight_sync._pending == [
            ["s", "r1", 600, 900, 0.05],
            ["f", "r1", 600],
            ["x", "r1", 600, 900, 0.05, True],
        ]
    finally:
        await gateway.redis.aclose()


async def no_principal(secret: str) -> KeyPrincipal | None:
    return None  # no key is looked up here
