"""The ledger of GPU time: ready intervals from replica events, and the invariants of the
cost-to-serve split over random fleets and traffic."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metering import ingest
from metering.cost import (
    ReplicaWindow,
    ServedRequest,
    gpu_time_usd_micros,
    mean_context,
    mean_decode_batch,
    work_cost_usd_micros,
    work_weights,
)
from metering.ledger import NEUTRAL_KINDS, READY_KINDS, overlap_us, ready_intervals
from metering.models import HourlyRollup, ReplicaHour, UsageEvent
from metering.prices import usd_to_micros
from metering.rollups import recompute_hour
from registry.models import Deployment
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.models import GpuClass, GpuPool, Node, Replica, ReplicaEvent
from tests.metering.helpers import event
from tests.registry.conftest import approved_version, make_model

HOUR = datetime(2026, 3, 2, 10, tzinfo=UTC)
NEXT = HOUR + timedelta(hours=1)
LATER = HOUR + timedelta(hours=3)
ENDING_KINDS = ("crashed", "failed", "started", "stopped", "state_failed", "node_lost", "oddity")


def at(minutes: float) -> datetime:
    return HOUR + timedelta(minutes=minutes)


# --- ready intervals, pure -------------------------------------------------------------------


def test_a_crash_pauses_the_meter_until_the_replica_is_ready_again_and_draining_keeps_it() -> None:
    events = [
        (at(2), "placed"),
        (at(3), "started"),
        (at(5), "ready"),
        (at(5.1), "state_ready"),  # the heartbeat's view of the same change
        (at(20), "crashed"),
        (at(21), "started"),
        (at(23), "ready"),
        (at(40), "draining"),
        (at(50), "stopped"),
    ]
    assert ready_intervals(events, LATER) == [(at(5), at(20)), (at(23), at(50))]


def test_an_open_interval_ends_now_or_at_the_recorded_stop() -> None:
    events = [(at(5), "ready")]
    assert ready_intervals(events, at(30)) == [(at(5), at(30))]
    assert ready_intervals(events, LATER, stopped_at=at(12)) == [(at(5), at(12))]


def test_a_replica_without_events_is_ready_from_ready_at() -> None:
    assert ready_intervals([], at(60), ready_at=at(15)) == [(at(15), at(60))]
    assert ready_intervals([], at(60)) == []


def test_an_unknown_kind_ends_the_interval_rather_than_charging_time_it_may_not_have_served() -> (
    None
):
    assert ready_intervals([(at(1), "ready"), (at(4), "oddity")], LATER) == [(at(1), at(4))]


kinds = st.sampled_from(sorted(READY_KINDS | NEUTRAL_KINDS) + list(ENDING_KINDS))


@given(
    drawn=st.lists(st.tuples(st.integers(0, 7200), kinds), max_size=30),
    until=st.integers(0, 7200),
    stopped=st.none() | st.integers(0, 7200),
)
def test_intervals_are_ordered_disjoint_and_open_only_at_ready_events(
    drawn: list[tuple[int, str]], until: int, stopped: int | None
) -> None:
    events = [(HOUR + timedelta(seconds=s), k) for s, k in drawn]
    end = HOUR + timedelta(seconds=until)
    stopped_at = None if stopped is None else HOUR + timedelta(seconds=stopped)
    intervals = ready_intervals(events, end, stopped_at=stopped_at)
    ready_times = {t for t, k in events if k in READY_KINDS}
    ending_times = {t for t, k in events if k not in READY_KINDS | NEUTRAL_KINDS}
    last = min(end, stopped_at) if stopped_at else end
    previous_end = None
    for start, finish in intervals:
        assert start < finish <= last
        assert start in ready_times
        assert finish in ending_times or finish == last
        assert previous_end is None or previous_end <= start
        previous_end = finish
        # Nothing in the middle of an interval ended it.
        assert not any(start < t < finish for t in ending_times)


def test_overlap_counts_whole_microseconds_inside_the_period() -> None:
    intervals = [(at(-10), at(10)), (at(50), at(70))]
    assert overlap_us(intervals, HOUR, NEXT) == 20 * 60 * 1_000_000


# --- the ledger in the database ------------------------------------------------------------


@dataclass
class Fleet:
    pools: list[GpuPool]
    deployments: list[Deployment]
    nodes: list[Node]


@pytest.fixture
def fleet(db: None) -> Fleet:
    version = approved_version(make_model("llama-3.1-8b"), "v1", "bf16")
    pools, deployments, nodes = [], [], []
    for name, gpu, price in (
        ("h100-east", "H100-SXM-80GB", "3.49"),
        ("l4-west", "L4-24GB", "0.71"),
    ):
        pool = GpuPool.objects.create(
            name=name,
            gpu_class=GpuClass.objects.get(name=gpu),
            region=name.split("-")[1],
            usd_per_gpu_hour=Decimal(price),
        )
        pools.append(pool)
        deployments.append(
            Deployment.objects.create(name=f"d-{name}", model_version=version, pool=pool)
        )
        nodes.append(Node.objects.create(pool=pool, hostname=name, agent_url="http://n:9100"))
    return Fleet(pools, deployments, nodes)


def make_replica(
    fleet: Fleet, which: int, gpus: int, events: list[tuple[datetime, str]]
) -> Replica:
    replica = Replica.objects.create(
        deployment=fleet.deployments[which],
        node=fleet.nodes[which],
        gpu_indices=list(range(gpus)),
        state=Replica.State.READY,
    )
    Replica.objects.filter(pk=replica.pk).update(created_at=HOUR - timedelta(hours=1))
    for when, kind in events:
        ReplicaEvent.objects.create(
            replica=replica, kind=kind, at=when, source=ReplicaEvent.Source.AGENT
        )
    return replica


def store(replica: Replica | None, started: datetime, baseline: Replica | None = None) -> str:
    e = event(
        7,
        replica_id=replica.replica_id if replica else "gone",
        pool=replica.deployment.pool.name if replica else "",
        baseline_replica_id=baseline.replica_id if baseline else "",
        started_at=started.timestamp(),
        ended_at=started.timestamp() + 1,
        total_ms=1500.0,
        ttft_ms=100.0,
        price_charged_usd_micros=20,
    )
    row = {k: getattr(e, k) for k in ingest.COLUMNS}
    row["started_at"] = started
    row["ended_at"] = started + timedelta(seconds=1)
    UsageEvent.objects.create(**row)
    return e.request_id


def test_a_replica_that_starts_crashes_restarts_and_drains_in_one_hour(fleet: Fleet) -> None:
    replica = make_replica(
        fleet,
        0,
        2,
        [
            (at(3), "started"),
            (at(5), "ready"),
            (at(20), "crashed"),
            (at(21), "started"),
            (at(23), "ready"),
            (at(40), "draining"),
            (at(50), "stopped"),
        ],
    )
    Replica.objects.filter(pk=replica.pk).update(state=Replica.State.STOPPED, stopped_at=at(50))
    served = store(replica, at(10))
    before_ready = store(replica, at(4))
    while_crashed = store(replica, at(22))
    after_stop = store(replica, at(55))
    recompute_hour(HOUR, LATER)
    recompute_hour(NEXT, LATER)

    [row] = ReplicaHour.objects.all()
    ready_us = (15 + 27) * 60 * 1_000_000
    assert (row.hour, row.ready_us, row.gpus) == (HOUR, ready_us, 2)
    assert row.cost_usd_micros == gpu_time_usd_micros(2 * ready_us, usd_to_micros("3.49"))
    assert row.gpu_seconds == pytest.approx(2 * 42 * 60)
    costs = dict(UsageEvent.objects.values_list("request_id", "cost_to_serve_usd_micros"))
    assert costs[served] > 0
    # Requests the replica's events do not cover still get their share of the hour (they ran
    # on it); what no request's work filled is idle.
    charged = sum(costs.values())
    assert charged + row.idle_usd_micros == row.cost_usd_micros
    assert {before_ready, while_crashed, after_stop} <= set(costs)


def test_an_idle_replica_is_charged_as_idle_time_every_hour_it_is_ready(fleet: Fleet) -> None:
    make_replica(fleet, 1, 1, [(at(30), "ready")])
    for hour in (HOUR, NEXT, NEXT + timedelta(hours=1)):
        recompute_hour(hour, NEXT + timedelta(minutes=15))
    rows = list(ReplicaHour.objects.order_by("hour").values_list("ready_us", "idle_usd_micros"))
    price = usd_to_micros("0.71")
    assert rows == [
        (30 * 60 * 1_000_000, gpu_time_usd_micros(30 * 60 * 1_000_000, price)),
        (15 * 60 * 1_000_000, gpu_time_usd_micros(15 * 60 * 1_000_000, price)),
    ]


def test_a_request_on_a_replica_the_ledger_does_not_know_is_charged_nothing(fleet: Fleet) -> None:
    request_id = store(None, at(10))
    UsageEvent.objects.filter(pk=request_id).update(cost_to_serve_usd_micros=999)
    recompute_hour(HOUR, LATER)
    assert UsageEvent.objects.get(pk=request_id).cost_to_serve_usd_micros == 0


def test_the_baseline_cost_prices_the_same_work_on_least_loads_replica(fleet: Fleet) -> None:
    cheap = make_replica(fleet, 1, 1, [(at(0), "ready")])
    dear = make_replica(fleet, 0, 2, [(at(0), "ready")])
    moved = store(cheap, at(10), baseline=dear)
    stayed = store(cheap, at(11), baseline=cheap)
    recompute_hour(HOUR, LATER)
    rows = {e.request_id: e for e in UsageEvent.objects.filter(pk__in=[moved, stayed])}
    served = [
        ServedRequest(r.request_id, r.prompt_tokens, 0, r.completion_tokens, 1400.0)
        for r in (rows[moved], rows[stayed])
    ]
    window = ReplicaWindow(cheap.replica_id, 3600 * 1_000_000, 1, usd_to_micros("0.71"))
    l4 = PerfModel(load_gpu_specs()["L4-24GB"], load_model_specs()["llama-3.1-8b"])
    h100x2 = PerfModel(
        load_gpu_specs()["H100-SXM-80GB"], load_model_specs()["llama-3.1-8b"], tensor_parallel=2
    )
    # Both priced at the L4 replica's batch and context: the hardware choice alone.
    batch, context = mean_decode_batch(window, served), mean_context(served)
    difference = work_cost_usd_micros(
        work_weights(h100x2, batch, context), 2, usd_to_micros("3.49"), served[0]
    ) - work_cost_usd_micros(work_weights(l4, batch, context), 1, usd_to_micros("0.71"), served[0])
    assert difference != 0
    assert rows[moved].baseline_cost_usd_micros == rows[moved].cost_to_serve_usd_micros + difference
    assert rows[stayed].baseline_cost_usd_micros == rows[stayed].cost_to_serve_usd_micros


# --- invariants over random fleets and traffic ---------------------------------------------


@st.composite
def lifetimes(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Ready intervals in minutes from HOUR, disjoint, within two hours, as an oracle."""
    edges = sorted(draw(st.sets(st.integers(-30, 150), max_size=6)))
    pairs = list(zip(edges[::2], edges[1::2], strict=False))
    return [(a, b) for a, b in pairs if a < b]


replicas_drawn = st.lists(
    st.tuples(st.integers(0, 1), st.sampled_from([1, 2]), lifetimes()), min_size=1, max_size=4
)
traffic_drawn = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 119)), max_size=25
)


@pytest.mark.django_db
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(drawn=replicas_drawn, traffic=traffic_drawn)
def test_cost_to_serve_adds_up_to_the_fleets_ready_gpu_time_at_its_prices(
    fleet: Fleet,
    drawn: list[tuple[int, int, list[tuple[int, int]]]],
    traffic: list[tuple[int, int, int]],
) -> None:
    UsageEvent.objects.all().delete()
    ReplicaHour.objects.all().delete()
    HourlyRollup.objects.all().delete()
    Replica.objects.all().delete()
    replicas, oracle = [], {}
    for which, gpus, intervals in drawn:
        events = []
        for start, end in intervals:
            events += [(at(start), "ready"), (at(end), "crashed" if end % 2 else "stopped")]
        replica = make_replica(fleet, which, gpus, events)
        replicas.append(replica)
        price = usd_to_micros(fleet.pools[which].price_per_gpu_hour)
        for hour in (HOUR, NEXT):
            us = overlap_us([(at(a), at(b)) for a, b in intervals], hour, hour + timedelta(hours=1))
            oracle[(replica.replica_id, hour)] = (us, gpus, price)
    for chosen, baseline, minute in traffic:
        store(replicas[chosen % len(replicas)], at(minute), replicas[baseline % len(replicas)])
    for hour in (HOUR, NEXT):
        recompute_hour(hour, LATER)

    for hour in (HOUR, NEXT):
        rows = ReplicaHour.objects.filter(hour=hour)
        expected = {
            rid: gpu_time_usd_micros(us * gpus, price)
            for (rid, h), (us, gpus, price) in oracle.items()
            if h == hour and us > 0
        }
        # No period charged before a replica was ready or after it stopped, to the micro-USD.
        assert dict(rows.values_list("replica_id", "cost_usd_micros")) == expected
        in_hour = UsageEvent.objects.filter(
            started_at__gte=hour, started_at__lt=hour + timedelta(hours=1)
        )
        charged = in_hour.aggregate(c=Sum("cost_to_serve_usd_micros"), g=Sum("gpu_seconds"))
        idle = rows.aggregate(
            c=Sum("idle_usd_micros"), g=Sum("idle_gpu_seconds"), t=Sum("gpu_seconds")
        )
        assert (charged["c"] or 0) + (idle["c"] or 0) == sum(expected.values())
        assert (charged["g"] or 0.0) + (idle["g"] or 0.0) == pytest.approx(
            idle["t"] or 0.0, rel=1e-9, abs=1e-6
        )
        for replica_id, cost in in_hour.values_list("replica_id", "cost_to_serve_usd_micros"):
            if oracle[(replica_id, hour)][0] == 0:
                assert cost == 0, "a replica with no ready time in the hour charges nothing"
        # Usage events and rollups agree.
        rolled = HourlyRollup.objects.filter(hour=hour).aggregate(
            c=Sum("cost_to_serve_usd_micros"), b=Sum("baseline_cost_usd_micros")
        )
        events_sum = in_hour.aggregate(b=Sum("baseline_cost_usd_micros"))
        assert (rolled["c"] or 0, rolled["b"] or 0) == (charged["c"] or 0, events_sum["b"] or 0)
    per_replica: dict[str, int] = defaultdict(int)
    for rid, cost in ReplicaHour.objects.values_list("replica_id", "cost_usd_micros"):
        per_replica[rid] += cost
    assert all(cost > 0 for cost in per_replica.values())
