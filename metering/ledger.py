"""The ledger of GPU time: when each replica was ready, from its events, cut into hours.

A replica is ready from an event that says it became ready (the agent's `ready`, the control
plane's `state_ready`) until the next event that says it no longer serves: a crash, a failure,
a restart, a stop, its node lost or released. `placed`, `draining` and `state_draining` leave it
as it was (a draining replica still finishes its streams on its GPUs). Any other kind ends a
ready interval, so a kind added later can only make the ledger charge less, never time a
replica may not have served. A replica the control plane marked stopped is closed at its
`stopped_at` even if the event saying so was lost; one with no events at all (rows made before
the ledger, or by hand) is ready from `ready_at` to `stopped_at` or now.

The agent's events carry the agent's clock and arrive with its next heartbeat; the control
plane's carry its own. Both are on one timeline here; a skew between them moves an edge of an
interval by that skew, no more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Prefetch, Q

from metering.cost import Placement
from metering.prices import usd_to_micros
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs
from serving.models import Replica, ReplicaEvent

READY_KINDS = frozenset({"ready", "state_ready"})
NEUTRAL_KINDS = frozenset({"placed", "draining", "state_draining"})

Interval = tuple[datetime, datetime]


def ready_intervals(
    events: Iterable[tuple[datetime, str]],
    until: datetime,
    ready_at: datetime | None = None,
    stopped_at: datetime | None = None,
) -> list[Interval]:
    """The replica's ready intervals up to `until` (now), in time order, never overlapping."""
    end = min(until, stopped_at) if stopped_at is not None else until
    ordered = sorted(events)
    if not ordered:
        return [(ready_at, end)] if ready_at is not None and ready_at < end else []
    intervals: list[Interval] = []
    opened: datetime | None = None
    for at, kind in ordered:
        if at >= end:
            break
        if kind in READY_KINDS:
            opened = at if opened is None else opened
        elif kind not in NEUTRAL_KINDS and opened is not None:
            if at > opened:
                intervals.append((opened, at))
            opened = None
    if opened is not None and opened < end:
        intervals.append((opened, end))
    return intervals


def overlap_us(intervals: Sequence[Interval], start: datetime, end: datetime) -> int:
    """Whole microseconds of `intervals` inside [start, end)."""
    total = 0
    for first, last in intervals:
        lo, hi = max(first, start), min(last, end)
        if hi > lo:
            total += _us(hi - lo)
    return total


def _us(delta: timedelta) -> int:
    # Whole microseconds, not float seconds: the hours of an interval add up to it exactly.
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


@dataclass(frozen=True, slots=True)
class ReplicaLedger:
    """A replica as the ledger prices it: its GPUs, its pool's price and its ready time."""

    replica_id: str
    deployment_id: int
    model: str
    pool: str
    gpu_class: str
    gpus: int
    usd_micros_per_gpu_hour: int
    perf: PerfModel | None
    intervals: list[Interval]

    @property
    def placement(self) -> Placement | None:
        if self.perf is None:
            return None
        return Placement(self.perf, self.gpus, self.usd_micros_per_gpu_hour)

    def ready_us(self, start: datetime, end: datetime) -> int:
        return overlap_us(self.intervals, start, end)


def replicas_ready_in(start: datetime, end: datetime, now: datetime) -> list[ReplicaLedger]:
    """Every replica with ready time inside [start, end), as of `now`."""
    until = min(end, now)
    replicas = (
        Replica.objects.filter(created_at__lt=until)
        .filter(Q(stopped_at__isnull=True) | Q(stopped_at__gt=start))
        .select_related("deployment__pool__gpu_class", "deployment__model_version__model")
        .prefetch_related(
            Prefetch(
                "events",
                queryset=ReplicaEvent.objects.filter(at__lt=until).only("replica_id", "at", "kind"),
            )
        )
    )
    ledgers = []
    for replica in replicas:
        intervals = ready_intervals(
            [(e.at, e.kind) for e in replica.events.all()],
            until,
            ready_at=replica.ready_at,
            stopped_at=replica.stopped_at,
        )
        ledger = _ledger(replica, intervals)
        if ledger.ready_us(start, end) > 0:
            ledgers.append(ledger)
    return ledgers


def _ledger(replica: Replica, intervals: list[Interval]) -> ReplicaLedger:
    deployment = replica.deployment
    pool = deployment.pool
    gpus = max(1, len(replica.gpu_indices or []) or deployment.tensor_parallel)
    return ReplicaLedger(
        replica_id=replica.replica_id,
        deployment_id=deployment.pk,
        model=deployment.model_version.model.name,
        pool=pool.name,
        gpu_class=pool.gpu_class.name,
        gpus=gpus,
        usd_micros_per_gpu_hour=usd_to_micros(pool.price_per_gpu_hour),
        perf=_perf(replica, gpus),
        intervals=intervals,
    )


def _perf(replica: Replica, gpus: int) -> PerfModel | None:
    deployment = replica.deployment
    gpu = load_gpu_specs().get(deployment.pool.gpu_class.name)
    if gpu is None:
        return None
    try:
        return PerfModel(
            gpu,
            deployment.model_version.model.spec(),
            deployment.model_version.quantization,
            gpus,
        )
    except (ValueError, KeyError, LookupError):
        return None
