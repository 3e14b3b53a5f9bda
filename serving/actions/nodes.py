"""Nodes joining, reporting and leaving: registration, heartbeats (states, events and
telemetry), loss of a silent node, cordon and drain. Views and tasks call these `do_*`
functions; nothing else writes node rows."""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from config.ids import row_id
from config.redis import redis_client
from serving import telemetry
from serving.actions.credentials import hash_token, node_token
from serving.actions.reconcile import (
    desired_replica_specs,
    drain_replicas,
    request_publish,
    request_reconcile,
    stop_replicas,
)
from serving.models import Gpu, JoinToken, Node, Replica, ReplicaEvent, TelemetrySample

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 2
# Three missed heartbeats plus slack for a slow network or a busy control plane.
NODE_LOST_AFTER_S = 3 * HEARTBEAT_INTERVAL_S + 2

# What the agent reports, mapped onto our states. Unknown words count as starting.
AGENT_STATES: dict[str, str] = {
    "pending": Replica.State.STARTING,
    "starting": Replica.State.STARTING,
    "launching": Replica.State.STARTING,
    "restarting": Replica.State.STARTING,
    "backoff": Replica.State.FAILED,
    "crashed": Replica.State.FAILED,
    "failed": Replica.State.FAILED,
    "ready": Replica.State.READY,
    "running": Replica.State.READY,
    "stopping": Replica.State.DRAINING,
    "stopped": Replica.State.STOPPED,
    "exited": Replica.State.STOPPED,
}


class RegistrationRefused(Exception):
    """A join token that is unknown, revoked, expired or used up, or a malformed registration."""


class NodeActionRefused(ValueError):
    """A cordon, drain, force or cancel that does not apply to the node as it is now."""


class NodeAlreadyRegistered(RegistrationRefused):
    """The hostname is a registered node and the registration does not carry its token."""


@transaction.atomic
def do_register_node(
    join_secret: str,
    hostname: str,
    agent_url: str,
    gpus: list[dict[str, Any]],
    presented_token: str | None = None,
) -> tuple[Node, str]:
    """Admit an agent into the join token's pool. A hostname that is already a registered node
    re-registers only with that node's current token (an agent whose token was refused keeps
    it for this), or after staff released the node (`do_release_node`): the pool's join token
    alone never takes over a node, its agent URL or its tenants' traffic."""
    join = _usable_join_token(join_secret)
    if not hostname or not agent_url:
        raise RegistrationRefused("hostname and agent_url are required")
    node, created = Node.objects.select_for_update().get_or_create(
        pool=join.pool, hostname=hostname, defaults={"agent_url": agent_url}
    )
    if (
        not created
        and node.token_hash
        and not hmac.compare_digest(node.token_hash, hash_token(presented_token or ""))
    ):
        raise NodeAlreadyRegistered(
            f"node {hostname} is already registered: re-register with its node token, "
            "or have staff release it in the console"
        )
    node.agent_url = agent_url
    node.token_nonce = secrets.token_hex(16)
    token = node_token(node)
    node.token_hash = hash_token(token)
    node.health = Node.Health.READY
    node.last_heartbeat_at = timezone.now()
    node.save()
    if join.single_use:
        join.used_at = node.last_heartbeat_at
        join.save(update_fields=["used_at"])
    _replace_inventory(node, gpus)
    # Replicas placed here stay: the next heartbeat answer tells the agent what to run, so an
    # agent that restarted without its processes relaunches them and one that kept them goes on.
    request_publish()
    logger.info("node %s registered in pool %s (%d GPUs)", hostname, join.pool.name, len(gpus))
    return node, token


def _usable_join_token(join_secret: str) -> JoinToken:
    """The join token this secret names, locked until the registration commits (so a
    single-use token admits one node however many agents race with it), or a refusal that
    says why."""
    join = (
        JoinToken.objects.select_for_update(of=("self",))
        .select_related("pool")
        .filter(token_hash=hash_token(join_secret))
        .first()
    )
    if join is None or join.revoked:
        raise RegistrationRefused("unknown or revoked join token")
    if join.expires_at is not None and join.expires_at <= timezone.now():
        raise RegistrationRefused("expired join token: mint a new one for this pool")
    if join.single_use and join.used_at is not None:
        raise RegistrationRefused(
            "this single-use join token has already registered a node: mint a new one"
        )
    return join


def _replace_inventory(node: Node, gpus: list[dict[str, Any]]) -> None:
    node.gpus.all().delete()
    Gpu.objects.bulk_create(
        Gpu(
            node=node,
            index=int(gpu["index"]),
            uuid=str(gpu.get("uuid") or ""),
            name=str(gpu.get("name") or ""),
            memory_mb=int(gpu.get("memory_mb") or 0),
        )
        for gpu in gpus
    )


# --- heartbeats ---------------------------------------------------------------------------


def do_record_heartbeat(node: Node, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Take one heartbeat: state changes and events to PostgreSQL, telemetry to Redis, a
    sample to history; answer with the node's desired replicas."""
    now = timezone.now()
    reports = {str(r.get("replica_id")): r for r in payload.get("replicas") or []}
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now, health=Node.Health.READY)
        came_back = node.health != Node.Health.READY
        node.health, node.last_heartbeat_at = Node.Health.READY, now
        replicas = {
            r.replica_id: r
            for r in Replica.objects.filter(node=node, pk__in=_int_ids(reports))
            .exclude(state=Replica.State.STOPPED)
            .select_related("deployment")
        }
        changed = _apply_replica_reports(replicas, reports, now)
        changed |= _retire_vanished_drains(node, set(reports), now)
        _record_agent_events(node, payload.get("events") or [])
        if changed or came_back:
            request_publish()
    _store_telemetry(node, payload, replicas, reports, now)
    return desired_replica_specs(node)


def _int_ids(reports: dict[str, Any]) -> list[int]:
    return [pk for rid in reports if (pk := row_id(rid)) is not None]


def _apply_replica_reports(
    replicas: dict[str, Replica], reports: dict[str, dict[str, Any]], now: datetime
) -> bool:
    changed = False
    for replica_id, replica in replicas.items():
        report = reports[replica_id]
        reported = AGENT_STATES.get(str(report.get("state") or "").lower(), Replica.State.STARTING)
        fields = _report_fields(replica, report)
        new_state = _next_state(replica.state, reported)
        if new_state != replica.state:
            ReplicaEvent.objects.get_or_create(
                replica=replica,
                kind=f"state_{new_state}",
                at=now,
                defaults={
                    "message": f"{replica.state} -> {new_state}",
                    "source": ReplicaEvent.Source.AGENT,
                },
            )
            replica.state = new_state
            fields["state"] = new_state
            if new_state == Replica.State.STOPPED:
                fields["stopped_at"] = replica.stopped_at = now
            changed = True
        if fields:
            for name, value in fields.items():
                setattr(replica, name, value)
            replica.save(update_fields=[*fields, "updated_at"])
    return changed


def _next_state(current: str, reported: str) -> str:
    # Draining is ours to end: the agent only confirms it by reporting the process stopped.
    if current == Replica.State.DRAINING:
        return Replica.State.STOPPED if reported == Replica.State.STOPPED else current
    if reported == Replica.State.DRAINING:
        return current
    return reported


def _report_fields(replica: Replica, report: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    wanted = {
        "port": report.get("port"),
        "pid": report.get("pid"),
        "restarts": int(report.get("restarts") or 0),
        "last_error": str(report.get("last_error") or ""),
        "started_at": _parse_time(report.get("started_at")),
        "ready_at": _parse_time(report.get("ready_at")),
    }
    for name, value in wanted.items():
        if value is not None and getattr(replica, name) != value:
            fields[name] = value
    return fields


def _parse_time(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, tz=UTC)
    parsed = parse_datetime(str(value))
    if parsed is not None and timezone.is_naive(parsed):
        parsed = timezone.make_aware(parsed, UTC)
    return parsed


def _retire_vanished_drains(node: Node, reported_ids: set[str], now: datetime) -> bool:
    """A draining replica the agent no longer reports has stopped."""
    gone = [
        r
        for r in node.replicas.filter(state=Replica.State.DRAINING)
        if r.replica_id not in reported_ids
    ]
    if gone:
        stop_replicas(gone, "stopped", "the agent stopped the process")
    return bool(gone)


def _record_agent_events(node: Node, events: Iterable[dict[str, Any]]) -> None:
    rows = []
    known = set(
        node.replicas.filter(
            pk__in=[int(e["replica_id"]) for e in events if _is_id(e)]
        ).values_list("pk", flat=True)
    )
    for event in events:
        at = _parse_time(event.get("at"))
        if not _is_id(event) or int(event["replica_id"]) not in known or at is None:
            continue
        rows.append(
            ReplicaEvent(
                replica_id=int(event["replica_id"]),
                kind=str(event.get("kind") or "agent")[:64],
                message=str(event.get("message") or ""),
                at=at,
                source=ReplicaEvent.Source.AGENT,
            )
        )
    # Replays carry the same (replica, kind, at): the unique constraint drops them.
    ReplicaEvent.objects.bulk_create(rows, ignore_conflicts=True)


def _is_id(event: dict[str, Any]) -> bool:
    return row_id(str(event.get("replica_id") or "")) is not None


def _store_telemetry(
    node: Node,
    payload: dict[str, Any],
    replicas: dict[str, Replica],
    reports: dict[str, dict[str, Any]],
    now: datetime,
) -> None:
    gpus = list(payload.get("gpus") or [])
    scraped = [
        (rid, {**reports[rid]["telemetry"], "loaded_lora_adapters": reports[rid].get("adapters")})
        for rid, replica in replicas.items()
        if reports[rid].get("telemetry") and replica.state != Replica.State.STOPPED
    ]
    client = redis_client()
    telemetry.store_latest(client, node.pk, gpus, scraped, now)
    due = telemetry.claim_sample_slots(client, [rid for rid, _ in scraped])
    if due:
        utilization = _mean_utilization(gpus)
        TelemetrySample.objects.bulk_create(
            _sample(replicas[rid], dict(scraped)[rid], now, utilization) for rid in due
        )


def _mean_utilization(gpus: list[dict[str, Any]]) -> float | None:
    values = [float(g["utilization_pct"]) for g in gpus if g.get("utilization_pct") is not None]
    return sum(values) / len(values) if values else None


def _sample(
    replica: Replica, t: dict[str, Any], now: datetime, utilization: float | None
) -> TelemetrySample:
    return TelemetrySample(
        replica=replica,
        at=now,
        running=int(t.get("num_requests_running") or 0),
        waiting=int(t.get("num_requests_waiting") or 0),
        kv_cache_usage=float(t.get("kv_cache_usage_perc") or 0.0),
        prompt_tokens_total=int(t.get("prompt_tokens_total") or 0),
        generation_tokens_total=int(t.get("generation_tokens_total") or 0),
        prefix_cache_hits_total=int(t.get("prefix_cache_hits_total") or 0),
        prefix_cache_queries_total=int(t.get("prefix_cache_queries_total") or 0),
        preemptions_total=int(t.get("num_preemptions_total") or 0),
        gpu_utilization_pct=utilization,
    )


# --- replica specs ------------------------------------------------------------------------


def do_mark_lost_nodes(now: datetime | None = None) -> list[int]:
    """Nodes silent for three heartbeats become NotReady; their replicas stop counting at once
    (out of the routing table), so the next reconcile places them elsewhere."""
    cutoff = (now or timezone.now()) - timedelta(seconds=NODE_LOST_AFTER_S)
    lost: list[int] = []
    with transaction.atomic():
        silent = Node.objects.select_for_update(skip_locked=True).filter(
            health=Node.Health.READY, last_heartbeat_at__lt=cutoff
        )
        for node in silent:
            _take_out_of_service(node, "node_lost", f"node {node.hostname} missed 3 heartbeats")
            lost.append(node.pk)
            logger.warning(
                "node %s is NotReady: no heartbeat since %s", node, node.last_heartbeat_at
            )
        if lost:
            request_publish()
            request_reconcile()
    return lost


@transaction.atomic
def do_release_node(node: Node) -> Node:
    """Staff's approval for a node's agent to register again with the join token alone (its
    state was lost): the node token is revoked, the node is NotReady until it does."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    node.token_hash = ""
    _take_out_of_service(
        node,
        "node_released",
        f"node {node.hostname} released for re-registration",
        also_saved=("token_hash",),
    )
    request_publish()
    request_reconcile()
    logger.warning("node %s released: its agent may register again with the join token", node)
    return node


def _take_out_of_service(
    node: Node, kind: str, message: str, also_saved: tuple[str, ...] = ()
) -> None:
    """NotReady, and every replica it holds stopped (out of the routing table at the next
    publish, placed elsewhere at the next reconcile). The caller holds the node's row lock."""
    node.health = Node.Health.NOT_READY
    node.save(update_fields=["health", *also_saved])
    stop_replicas(node.replicas.filter(state__in=Replica.HOLDING_STATES), kind, message)


@transaction.atomic
def do_cordon_node(node: Node) -> Node:
    """No new replicas on this node; the ones there keep serving (a drain stops)."""
    return _set_scheduling(_locked(node), Node.Scheduling.CORDONED)


@transaction.atomic
def do_uncordon_node(node: Node) -> Node:
    """Placement may use the node again (a drain in progress is cancelled)."""
    return _set_scheduling(_locked(node), Node.Scheduling.ACTIVE)


@transaction.atomic
def do_drain_node(node: Node, deadline_s: int | None = None) -> Node:
    """Move every replica off: replacements are placed elsewhere first, then these drain. A
    replica with nowhere to go stays and says why; past the deadline (`deadline_s`, else
    settings.NODE_DRAIN_DEADLINE_S) staff are asked to force or cancel the drain."""
    node = _locked(node)
    if node.scheduling == Node.Scheduling.DRAINING:
        raise NodeActionRefused(f"{node.hostname} is already draining.")
    if node.scheduling == Node.Scheduling.DRAINED:
        raise NodeActionRefused(f"{node.hostname} is already drained: uncordon it to use it.")
    if deadline_s is not None and deadline_s < 0:
        raise NodeActionRefused("A drain deadline is a number of seconds, 0 or more.")
    node.drain_started_at = timezone.now()
    node.drain_deadline_s = deadline_s
    node = _set_scheduling(node, Node.Scheduling.DRAINING)
    request_reconcile()
    return node


@transaction.atomic
def do_force_drain_node(node: Node) -> Node:
    """Stop the replicas a drain could not move: each drains now (out of the routing table,
    the agent stops it), and its deployment runs with fewer replicas until room appears."""
    node = _locked(node)
    if node.scheduling != Node.Scheduling.DRAINING:
        raise NodeActionRefused(f"{node.hostname} is not draining: there is no drain to force.")
    held = list(node.replicas.filter(state__in=Replica.DESIRED_STATES))
    drain_replicas(held, "drain_forced")
    logger.warning("drain of %s forced: %d replicas stopped", node.hostname, len(held))
    request_publish()
    request_reconcile()
    return node


@transaction.atomic
def do_cancel_drain_node(node: Node) -> Node:
    """The node is Ready for placement again; its replicas stay where they are."""
    node = _locked(node)
    if node.scheduling != Node.Scheduling.DRAINING:
        raise NodeActionRefused(f"{node.hostname} is not draining: there is no drain to cancel.")
    node = _set_scheduling(node, Node.Scheduling.ACTIVE)
    request_reconcile()
    return node


def _locked(node: Node) -> Node:
    return Node.objects.select_for_update().get(pk=node.pk)


def _set_scheduling(node: Node, scheduling: str) -> Node:
    """The caller holds the node's row lock. Leaving a drain forgets it and its blockers."""
    fields = ["scheduling"]
    node.scheduling = scheduling
    if scheduling != Node.Scheduling.DRAINING:
        node.drain_started_at = node.drain_deadline_s = node.drain_finished_at = None
        fields += ["drain_started_at", "drain_deadline_s", "drain_finished_at"]
        node.replicas.filter(drain_blocked_since__isnull=False).update(
            drain_blocked_reason="", drain_unblock=[], drain_blocked_since=None
        )
    else:
        fields += ["drain_started_at", "drain_deadline_s"]
    node.save(update_fields=fields)
    logger.info("node %s is now %s", node.hostname, scheduling)
    return node


# --- enqueueing ---------------------------------------------------------------------------
