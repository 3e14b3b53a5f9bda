"""One deployment's failure in a fleet loop is that deployment's alone (config.loops).

The broken row is one the validators refuse today and an older release accepted: a model of
0 KV heads, written past them with `update()`. Every loop that sizes KV capacity divides by
zero on it; before, that ended the pass for every deployment.
"""

from __future__ import annotations

import pytest
import redis
from django.contrib.auth import get_user_model
from django.test import Client

from config.loops import LoopPass, loop_failures
from registry.actions import do_retire_deployment
from registry.controller import run_rollout_tick
from registry.models import Deployment, Model
from serving.actions.autoscale import do_autoscale
from serving.actions.reconcile import Launch, do_reconcile
from serving.actions.routing_table import publish_routing_table, read_routing_table
from serving.models import Replica
from serving.redis_contracts import LOOP_FAILURES_KEY
from tenants.models import Membership, Role, Tenant

from .conftest import (
    MakeDeployment,
    MakePool,
    Register,
    RegisteredNode,
    replica_report,
    send_heartbeat,
)

pytestmark = pytest.mark.django_db

Pair = tuple[Deployment, Deployment, RegisteredNode]


def _live(deployment: Deployment) -> list[Replica]:
    return list(deployment.replicas.filter(state__in=Replica.DESIRED_STATES))


def _break(deployment: Deployment) -> None:
    Model.objects.filter(pk=deployment.model_version.model_id).update(kv_heads=0)


def _mend(deployment: Deployment, kv_heads: int = 8) -> None:
    Model.objects.filter(pk=deployment.model_version.model_id).update(kv_heads=kv_heads)


@pytest.fixture
def pair(make_pool: MakePool, make_deployment: MakeDeployment, register: Register) -> Pair:
    """Two deployments of two models on one H100 pool, each with one Ready replica."""
    pool, secret = make_pool("h100", "H100-SXM-80GB")
    node = register(secret, "h100-1", gpus=8, name="H100-SXM-80GB", memory_mb=81559)
    good = make_deployment(pool, model="llama-3.1-8b")
    bad = make_deployment(pool, model="qwen2.5-7b")
    do_reconcile()
    reports = [
        replica_report(replica.replica_id, "Ready", port=18001 + n)
        for n, replica in enumerate(Replica.objects.order_by("pk"))
    ]
    assert send_heartbeat(node, replicas=reports).status_code == 200
    return good, bad, node


def test_reconcile_places_the_others_and_leaves_the_failing_deployments_replicas_be(
    pair: Pair, redis_client: redis.Redis
) -> None:
    good, bad, _ = pair
    bad_replicas = _live(bad)
    _break(bad)
    Deployment.objects.filter(pk=good.pk).update(replicas_desired=3)
    Deployment.objects.filter(pk=bad.pk).update(replicas_desired=3)

    report = do_reconcile()

    assert len(_live(good)) == 3
    assert _live(bad) == bad_replicas  # neither scaled up nor drained as an orphan
    assert list(report.failed) == [bad.pk]
    assert "ZeroDivisionError" in report.failed[bad.pk]
    (failure,) = loop_failures(redis_client, "deployment")[bad.pk]
    assert (failure.loop, failure.item_id) == ("reconcile", bad.pk)
    first_seen = failure.since

    do_reconcile()  # still failing: the failure keeps when it was first seen
    (again,) = loop_failures(redis_client, "deployment")[bad.pk]
    assert again.since == first_seen

    _mend(bad, kv_heads=4)
    assert do_reconcile().failed == {}
    assert len(_live(bad)) == 3
    assert loop_failures(redis_client, "deployment") == {}


def test_the_routing_table_keeps_a_failing_deployments_last_entry_and_updates_the_others(
    pair: Pair, redis_client: redis.Redis
) -> None:
    good, bad, _ = pair
    publish_routing_table()
    before = read_routing_table(redis_client)
    assert before is not None
    bad_entry = before["models"]["qwen2.5-7b"]["deployments"]
    _break(bad)
    Deployment.objects.filter(pk=good.pk).update(traffic_weight=40)

    assert publish_routing_table() == before["version"] + 1

    after = read_routing_table(redis_client)
    assert after is not None
    (good_entry,) = after["models"]["llama-3.1-8b"]["deployments"]
    assert good_entry["weight"] == 40
    assert after["models"]["qwen2.5-7b"]["deployments"] == bad_entry
    assert [f.loop for f in loop_failures(redis_client, "deployment")[bad.pk]] == ["routing_table"]


def test_a_deployment_failing_before_it_was_ever_published_is_left_out_of_the_table(
    pair: Pair, redis_client: redis.Redis
) -> None:
    _, bad, _ = pair
    _break(bad)
    publish_routing_table()
    table = read_routing_table(redis_client)
    assert table is not None
    assert set(table["models"]) == {"llama-3.1-8b"}


def test_the_autoscaler_scales_the_others(pair: Pair, redis_client: redis.Redis) -> None:
    good, bad, _ = pair
    Deployment.objects.filter(pk__in=[good.pk, bad.pk]).update(replicas_min=1, replicas_max=4)
    _break(bad)
    outcomes = do_autoscale(redis_client)
    assert [outcome.deployment_id for outcome in outcomes] == [good.pk]
    assert [f.loop for f in loop_failures(redis_client, "deployment")[bad.pk]] == ["autoscale"]


def test_a_pass_rolls_back_the_failing_items_writes_alone(redis_client: redis.Redis) -> None:
    this_pass = LoopPass("test_loop", "deployment")
    user_model = get_user_model()
    with this_pass.item(1):
        user_model.objects.create_user("kept")
    with this_pass.item(2):
        user_model.objects.create_user("rolled-back")
        raise RuntimeError("half way")
    this_pass.record(redis_client)
    assert list(user_model.objects.values_list("username", flat=True)) == ["kept"]
    assert this_pass.failed == {2: "RuntimeError: half way"}
    assert set(redis_client.hkeys(LOOP_FAILURES_KEY)) == {b"test_loop:deployment:2"}


def test_the_rollout_controller_ticks_the_others_and_holds_only_when_redis_is_away(
    monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    """A rollout whose tick raises is noted and passed over; the next one still ticks. Redis
    unreachable is a hold, not a failure; a rollout another tick holds keeps its note."""
    from registry import controller

    ticked: list[int] = []
    errors: dict[int, Exception] = {
        1: ValueError("a gate's figures are broken"),
        2: redis.ResponseError("WRONGTYPE Operation against a key"),
        3: redis.ConnectionError("Connection refused"),
    }

    def tick(rollout_id: int, metrics: object) -> None:
        ticked.append(rollout_id)
        if rollout_id in errors:
            raise errors[rollout_id]
        return None  # 4: another tick holds it (SKIP LOCKED)

    class Live:
        def filter(self, **_: object) -> Live:
            return self

        def values_list(self, *_: object, **__: object) -> list[int]:
            return [1, 2, 3, 4]

    held_before = LoopPass("rollout_tick", "rollout")
    held_before.failed = {3: "KeyError: 'old'", 4: "KeyError: 'older'"}
    held_before.record(redis_client)
    monkeypatch.setattr(controller.Rollout, "objects", Live())
    monkeypatch.setattr(controller, "tick_rollout", tick)
    assert run_rollout_tick(metrics=object()) == []  # type: ignore[arg-type]
    assert ticked == [1, 2, 3, 4]
    failing = loop_failures(redis_client, "rollout")
    assert {pk: failure.error for pk, (failure,) in failing.items()} == {
        1: "ValueError: a gate's figures are broken",
        2: "ResponseError: WRONGTYPE Operation against a key",
        3: "KeyError: 'old'",  # held while Redis is away: its note stays
        4: "KeyError: 'older'",  # not looked at this pass
    }


def test_a_failure_half_way_through_a_deployment_leaves_its_gpus_to_the_others(
    make_pool: MakePool,
    make_deployment: MakeDeployment,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
    redis_client: redis.Redis,
) -> None:
    """The first deployment places one replica, then fails on its second: the GPU it took
    is free again for the next deployment in the same pass, and no count or note of it is
    left behind."""
    from serving.actions import reconcile

    pool, secret = make_pool("h100", "H100-SXM-80GB")
    register(secret, "h100-1", gpus=2, name="H100-SXM-80GB", memory_mb=81559)
    bad = make_deployment(pool, model="qwen2.5-7b", replicas=2)
    good = make_deployment(pool, model="llama-3.1-8b", replicas=2)
    real_place = reconcile._place
    placed: list[int] = []

    def place(launch: Launch, node_id: int, gpus: tuple[int, ...]) -> Replica:
        placed.append(launch.deployment_id)
        if placed.count(bad.pk) == 2 and launch.deployment_id == bad.pk:
            raise RuntimeError("the database went away half way")
        return real_place(launch, node_id, gpus)

    monkeypatch.setattr(reconcile, "_place", place)
    report = do_reconcile()

    assert (len(_live(bad)), len(_live(good))) == (0, 2)
    assert (report.placed, report.unplaceable, report.placement_failures) == (2, 0, {})
    good.refresh_from_db()
    assert good.placement_failure == ""
    assert list(report.failed) == [bad.pk]


def test_a_failing_deployment_that_is_retired_still_drains_and_leaves_the_table(
    pair: Pair, redis_client: redis.Redis
) -> None:
    _, bad, _ = pair
    publish_routing_table()
    _break(bad)
    do_retire_deployment(bad)
    do_reconcile()
    assert _live(bad) == []
    assert bad.replicas.filter(state=Replica.State.DRAINING).count() == 1
    publish_routing_table()
    table = read_routing_table(redis_client)
    assert table is not None
    assert "qwen2.5-7b" not in table["models"]


def test_a_carried_entry_takes_the_weight_now_and_only_the_replicas_still_ready(
    pair: Pair, redis_client: redis.Redis
) -> None:
    _, bad, _ = pair
    publish_routing_table()
    _break(bad)
    Deployment.objects.filter(pk=bad.pk).update(traffic_weight=10)
    bad.replicas.update(state=Replica.State.FAILED)
    publish_routing_table()
    table = read_routing_table(redis_client)
    assert table is not None
    (entry,) = table["models"]["qwen2.5-7b"]["deployments"]
    assert (entry["deployment_id"], entry["weight"], entry["replicas"]) == (bad.pk, 10, [])


def test_a_tenant_sees_no_loop_failures(pair: Pair, redis_client: redis.Redis) -> None:
    """An exception's text is staff business, even on a deployment the tenant may see."""
    _, bad, _ = pair
    _break(bad)
    do_reconcile()
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    member = get_user_model().objects.create_user("dev")
    Membership.objects.create(user=member, tenant=tenant, role=Role.VIEWER)
    Model.objects.exclude(pk=bad.model_version.model_id).update(visibility="restricted")
    Model.objects.filter(pk=bad.model_version.model_id).update(visibility="public")
    client = Client()
    client.force_login(member)
    rows = client.get("/api/v1/deployments/").json()["results"]
    assert [row["id"] for row in rows] == [bad.pk]
    assert "loop_failures" not in rows[0]


def test_the_api_and_the_console_show_what_fails_on_a_deployment(
    pair: Pair, redis_client: redis.Redis
) -> None:
    good, bad, _ = pair
    _break(bad)
    do_reconcile()
    staff = Client()
    staff.force_login(get_user_model().objects.create_user("ops", is_staff=True))

    listed = {row["id"]: row for row in staff.get("/api/v1/deployments/").json()["results"]}
    assert listed[good.pk]["loop_failures"] == []
    (failure,) = listed[bad.pk]["loop_failures"]
    assert failure["loop"] == "reconcile"
    assert failure["error"].startswith("ZeroDivisionError")
    assert staff.get(f"/api/v1/deployments/{bad.pk}/").json()["loop_failures"] == [failure]

    page = staff.get("/console/models/").content.decode()
    assert "reconcile failing" in page
    assert page.count("loop-failure") == 1


def test_an_unreadable_stored_failure_is_skipped_and_a_loop_name_with_a_colon_refused(
    redis_client: redis.Redis,
) -> None:
    redis_client.hset(
        LOOP_FAILURES_KEY,
        mapping={
            "reconcile:deployment:7": b'{"error": "KeyError: 1", "since": 1700000000.0}',
            "reconcile:deployment:8": b"not json",
            "reconcile:deployment:9": b'{"since": 1700000000.0}',
            "no-colons": b"{}",
            "reconcile:deployment:\xef\xbc\x92": b'{"error": "x", "since": 1.0}',
        },
    )
    assert {
        pk: [f.error for f in found]
        for pk, found in loop_failures(redis_client, "deployment").items()
    } == {7: ["KeyError: 1"]}
    with pytest.raises(ValueError, match="no ':'"):
        LoopPass("re:concile", "deployment")
