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

from config.loops import LOOP_FAILURES_KEY, LoopPass, loop_failures
from registry.controller import run_rollout_tick
from registry.models import Deployment, Model
from serving.actions.autoscale import do_autoscale
from serving.actions.reconcile import do_reconcile
from serving.actions.routing_table import publish_routing_table, read_routing_table
from serving.models import Replica

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


def test_the_rollout_controller_ticks_the_others(
    monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    """A rollout whose tick raises is noted and passed over; the next one still ticks."""
    from registry import controller

    ticked: list[int] = []

    def tick(rollout_id: int, metrics: object) -> None:
        ticked.append(rollout_id)
        if rollout_id == 1:
            raise ValueError("a gate's figures are broken")

    class Live:
        def filter(self, **_: object) -> Live:
            return self

        def values_list(self, *_: object, **__: object) -> list[int]:
            return [1, 2]

    monkeypatch.setattr(controller.Rollout, "objects", Live())
    monkeypatch.setattr(controller, "tick_rollout", tick)
    assert run_rollout_tick(metrics=object()) == []  # type: ignore[arg-type]
    assert ticked == [1, 2]
    (failure,) = loop_failures(redis_client, "rollout")[1]
    assert failure.error == "ValueError: a gate's figures are broken"


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
