"""Every state change of the fleet, once: registration, heartbeats, placement, cordon, drain.

Views, viewsets and tasks call these `do_*` functions; nothing else writes fleet rows.

Credentials:
- Join tokens and node tokens are stored as SHA-256 hashes only.
- The control plane also calls the agent (PUT /v1/replicas) with the node token. Rather than
  keep the token in the database, a node token is HMAC-SHA256(SECRET_KEY, node id + a random
  nonce stored on the node): the control plane rebuilds it when it needs it, and a copy of the
  database without the secret key reveals nothing. Re-registering draws a new nonce, which
  revokes the old token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from serving import telemetry
from serving.engine.placement import fits
from serving.engine.specs import (
    ModelSpec,
    find_model_spec,
    load_gpu_specs,
    normalize_quantization,
)
from serving.models import (
    Gpu,
    GpuPool,
    JoinToken,
    Node,
    Replica,
    ReplicaEvent,
    TelemetrySample,
)

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 2
# Three missed heartbeats plus slack for a slow network or a busy control plane.
NODE_LOST_AFTER_S = 3 * HEARTBEAT_INTERVAL_S + 2
# A draining replica the agent never confirms stopped is written off after this long.
DRAIN_TIMEOUT_S = 30
RECONCILE_LOCK_ID = 0x5E271C  # pg advisory lock: one reconcile at a time, fleet-wide

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
# vLLM's --quantization for each of the registry's weight formats.
VLLM_QUANTIZATION: dict[str, str | None] = {"bf16": None, "fp8": "fp8", "awq-int4": "awq"}


class RegistrationRefused(Exception):
    """A join token that is unknown, revoked or expired, or a malformed registration."""


# --- tokens -------------------------------------------------------------------------------


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def do_create_join_token(
    pool: GpuPool,
    name: str = "",
    expires_at: datetime | None = None,
    secret: str | None = None,
) -> tuple[JoinToken, str]:
    """A new join token for `pool`; the secret is returned once and only its hash is kept."""
    secret = secret or "jt_" + secrets.token_urlsafe(32)
    token = JoinToken.objects.create(
        pool=pool, name=name, token_hash=hash_token(secret), expires_at=expires_at
    )
    return token, secret


def node_token(node: Node) -> str:
    """The node's bearer token, rebuilt from the secret key and the node's nonce."""
    message = f"{node.pk}:{node.token_nonce}".encode()
    digest = hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()
    return "nt_" + digest


def engine_api_key(replica_id: int | str) -> str:
    """The replica's engine key (vLLM's --api-key), rebuilt from the secret key: the agent
    launches the engine with it, the gateways send it, and a caller without it is refused by
    the engine itself. Nothing stores it in PostgreSQL."""
    message = f"engine:{replica_id}".encode()
    return "ek_" + hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()


def authenticate_node(node_id: Any, bearer: str) -> Node | None:
    """The node this bearer token belongs to, or None (the caller answers 401)."""
    try:
        node = Node.objects.select_related("pool").get(pk=int(node_id))
    except (Node.DoesNotExist, TypeError, ValueError):
        return None
    if not node.token_hash or not hmac.compare_digest(node.token_hash, hash_token(bearer)):
        return None
    return node


# --- registration -------------------------------------------------------------------------


@transaction.atomic
def do_register_node(
    join_secret: str, hostname: str, agent_url: str, gpus: list[dict[str, Any]]
) -> tuple[Node, str]:
    """Admit an agent into the join token's pool; the same hostname re-uses its node."""
    join = (
        JoinToken.objects.select_related("pool")
        .filter(token_hash=hash_token(join_secret), revoked=False)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
        .first()
    )
    if join is None:
        raise RegistrationRefused("unknown, revoked or expired join token")
    if not hostname or not agent_url:
        raise RegistrationRefused("hostname and agent_url are required")
    node, _ = Node.objects.select_for_update().get_or_create(
        pool=join.pool, hostname=hostname, defaults={"agent_url": agent_url}
    )
    node.agent_url = agent_url
    node.token_nonce = secrets.token_hex(16)
    token = node_token(node)
    node.token_hash = hash_token(token)
    node.health = Node.Health.READY
    node.last_heartbeat_at = timezone.now()
    node.save()
    _replace_inventory(node, gpus)
    # Replicas placed here stay: the next heartbeat answer tells the agent what to run, so an
    # agent that restarted without its processes relaunches them and one that kept them goes on.
    request_publish()
    logger.info("node %s registered in pool %s (%d GPUs)", hostname, join.pool.name, len(gpus))
    return node, token


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
    return [int(rid) for rid in reports if rid.isdigit()]


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
        _stop_replicas(gone, "stopped", "the agent stopped the process")
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
    return str(event.get("replica_id") or "").isdigit()


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
    client = telemetry.redis_client()
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


def desired_replica_specs(node: Node) -> list[dict[str, Any]]:
    """What the agent of `node` should be running, in the agent's spec format."""
    replicas = (
        Replica.objects.filter(node=node, state__in=Replica.DESIRED_STATES)
        .select_related(*registry_related("deployment__"), "node__pool__gpu_class")
        .prefetch_related("deployment__model_version__adapters")
        .order_by("pk")
    )
    return [replica_spec(replica) for replica in replicas]


def replica_spec(replica: Replica) -> dict[str, Any]:
    launch = deployment_launch(replica.deployment)
    return {
        "replica_id": replica.replica_id,
        "deployment_id": str(replica.deployment_id),
        "model": launch.artifact,
        "served_model_name": launch.served_model_name,
        "gpu_indices": list(replica.gpu_indices),
        "port": replica.port,
        "tensor_parallel_size": launch.tensor_parallel,
        "quantization": VLLM_QUANTIZATION.get(launch.quantization),
        "kv_cache_dtype": launch.kv_cache_dtype,
        "max_model_len": launch.max_model_len,
        "max_num_seqs": launch.max_num_seqs,
        "gpu_memory_utilization": launch.gpu_memory_utilization,
        "enable_prefix_caching": launch.enable_prefix_caching,
        "enable_lora": launch.enable_lora,
        "max_loras": launch.max_loras,
        "max_lora_rank": launch.max_lora_rank,
        "adapters": [{"name": name, "path": path} for name, path in launch.adapters],
        "sim": {
            "gpu_class": replica.node.pool.gpu_class.name,
            "model_spec": launch.model_spec,
            "time_scale": float(getattr(settings, "SERVING_SIM_TIME_SCALE", 1.0)),
        },
        "api_key": engine_api_key(replica.pk),
    }


# --- what a deployment asks for (the one place that reads registry fields) -----------------


@dataclass(frozen=True, slots=True)
class Launch:
    """A deployment's launch settings, read once from the registry."""

    deployment_id: int
    pool_id: int
    active: bool
    desired: int
    artifact: str
    served_model_name: str
    model_spec: str | None
    architecture: ModelSpec
    version_label: str
    quantization: str
    tensor_parallel: int
    kv_cache_dtype: str
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    adapters: tuple[tuple[str, str], ...]
    slo_tier: str
    traffic_weight: int


def registry_related(prefix: str = "") -> list[str]:
    return [f"{prefix}model_version__model", f"{prefix}pool__gpu_class"]


def deployments_to_run() -> list[Any]:
    """Every deployment that is not stopped: active ones want replicas, draining ones are
    listed so that their replicas are drained (and never routed to)."""
    from registry.models import Deployment

    return list(
        Deployment.objects.exclude(status=Deployment.Status.STOPPED)
        .select_related(*registry_related())
        .prefetch_related("model_version__adapters")
        .order_by("pk")
    )


def deployment_launch(deployment: Any) -> Launch:
    version = deployment.model_version
    model = version.model
    args: dict[str, Any] = deployment.effective_engine_args()
    quantization = normalize_quantization(version.quantization or "bf16")
    # The simulator knows the models of models.csv; the registry's name usually contains one.
    catalogued = find_model_spec(model.name) or find_model_spec(model.family)
    adapters = tuple((adapter.name, adapter.artifact_uri) for adapter in version.adapters.all())
    return Launch(
        deployment_id=deployment.pk,
        pool_id=deployment.pool_id,
        active=deployment.status == "active",
        desired=int(deployment.replicas_desired) if deployment.status == "active" else 0,
        artifact=version.artifact_uri,
        served_model_name=model.name,
        model_spec=catalogued.name if catalogued else None,
        architecture=model.spec(),
        version_label=version.version,
        quantization=quantization,
        tensor_parallel=int(deployment.tensor_parallel),
        kv_cache_dtype=str(args.get("kv_cache_dtype") or "auto"),
        max_model_len=int(args.get("max_model_len") or min(8192, model.max_context)),
        max_num_seqs=int(args.get("max_num_seqs") or 256),
        gpu_memory_utilization=float(args.get("gpu_memory_utilization") or 0.9),
        enable_prefix_caching=bool(args.get("enable_prefix_caching", True)),
        enable_lora=bool(args.get("enable_lora", False)) or bool(adapters),
        # vLLM needs at least one LoRA slot once LoRA is on.
        max_loras=max(1, int(args.get("max_loras") or min(len(adapters), 4))),
        max_lora_rank=int(args.get("max_lora_rank") or 16),
        adapters=adapters,
        slo_tier=str(deployment.slo_tier),
        traffic_weight=int(deployment.traffic_weight),
    )


# --- reconcile ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """A schedulable node's free GPUs, for the placement choice."""

    node_id: int
    pool_id: int
    gpu_class: str
    free: tuple[int, ...]
    gpu_memory_mb: dict[int, int]
    same_deployment: int


def choose_node(rooms: list[NodeRoom], launch: Launch) -> tuple[NodeRoom, tuple[int, ...]] | None:
    """Where a new replica of `launch` goes: a node of its pool with enough free GPUs whose
    memory holds the model at its TP degree. Spread replicas of one deployment over nodes
    first (a node loss takes fewer down), then pack onto the fullest node (keep big holes)."""
    candidates = []
    for room in rooms:
        if room.pool_id != launch.pool_id or len(room.free) < launch.tensor_parallel:
            continue
        gpus = room.free[: launch.tensor_parallel]
        if not _memory_fits(launch, room.gpu_class, min(room.gpu_memory_mb[i] for i in gpus)):
            continue
        candidates.append((room.same_deployment, len(room.free), room.node_id, room, gpus))
    if not candidates:
        return None
    _, _, _, room, gpus = min(candidates, key=lambda c: c[:3])
    return room, gpus


def _memory_fits(launch: Launch, gpu_class: str, memory_mb: int) -> bool:
    base = load_gpu_specs().get(gpu_class)
    if base is None:
        return True  # a GPU class without datasheet figures: trust the registry's check
    # The node's own GPUs decide (MiB as NVML reports them), not the class's datasheet.
    gpu = replace(base, memory_gb=memory_mb * 1.048576 / 1000.0) if memory_mb else base
    return fits(
        gpu,
        launch.architecture,
        launch.quantization,
        launch.tensor_parallel,
        max_model_len=launch.max_model_len,
        gpu_memory_utilization=launch.gpu_memory_utilization,
    )


@dataclass
class ReconcileReport:
    placed: int = 0
    drained: int = 0
    stopped: int = 0
    unplaceable: int = 0


def do_reconcile() -> ReconcileReport:
    """Desired replica counts vs replicas that exist: place, drain, retire. Level-triggered:
    running it twice in a row changes nothing the second time."""
    report = ReconcileReport()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [RECONCILE_LOCK_ID])
            if not cursor.fetchone()[0]:
                return report  # another worker is reconciling right now
        report.stopped += _retire_overdue_drains()
        launches = [deployment_launch(d) for d in deployments_to_run()]
        rooms = _node_rooms()
        for launch in launches:
            _reconcile_deployment(launch, rooms, report)
        report.drained += _drain_orphans({launch.deployment_id for launch in launches})
        if report.placed or report.drained or report.stopped:
            request_publish()
    return report


def _node_rooms() -> dict[int, NodeRoom]:
    nodes = Node.objects.filter(
        health=Node.Health.READY, scheduling=Node.Scheduling.ACTIVE
    ).select_related("pool__gpu_class")
    memory: dict[int, dict[int, int]] = {}
    for gpu in Gpu.objects.filter(node__in=nodes):
        memory.setdefault(gpu.node_id, {})[gpu.index] = gpu.memory_mb
    used: dict[int, set[int]] = {}
    for node_id, indices in Replica.objects.filter(
        node__in=nodes, state__in=Replica.HOLDING_STATES
    ).values_list("node_id", "gpu_indices"):
        used.setdefault(node_id, set()).update(indices)
    return {
        node.pk: NodeRoom(
            node_id=node.pk,
            pool_id=node.pool_id,
            gpu_class=node.pool.gpu_class.name,
            free=tuple(sorted(set(memory.get(node.pk, {})) - used.get(node.pk, set()))),
            gpu_memory_mb=memory.get(node.pk, {}),
            same_deployment=0,
        )
        for node in nodes
    }


def _reconcile_deployment(
    launch: Launch, rooms: dict[int, NodeRoom], report: ReconcileReport
) -> None:
    live = list(
        Replica.objects.filter(deployment_id=launch.deployment_id, state__in=Replica.DESIRED_STATES)
        .select_related("node")
        .order_by("pk")
    )
    # Replicas on a draining node do not count: their replacements are placed first.
    staying = [r for r in live if r.node.scheduling != Node.Scheduling.DRAINING]
    leaving = [r for r in live if r.node.scheduling == Node.Scheduling.DRAINING]
    missing = launch.desired - len(staying)
    per_node = Counter(r.node_id for r in live)
    for _ in range(max(0, missing)):
        views = [replace(room, same_deployment=per_node[room.node_id]) for room in rooms.values()]
        choice = choose_node(views, launch)
        if choice is None:
            report.unplaceable += 1
            logger.warning("no room for a replica of deployment %s", launch.deployment_id)
            break
        room, gpus = choice
        _place(launch, room.node_id, gpus)
        per_node[room.node_id] += 1
        rooms[room.node_id] = replace(room, free=tuple(i for i in room.free if i not in gpus))
        report.placed += 1
    if missing < 0:
        report.drained += _drain(_scale_down_victims(staying, -missing), "scaled_down")
    # A draining node's replicas leave once their replacements serve, so capacity never dips;
    # a drain with no room elsewhere waits (as a PodDisruptionBudget would) until staff act.
    ready_elsewhere = sum(1 for r in staying if r.state == Replica.State.READY)
    if leaving and ready_elsewhere >= launch.desired:
        report.drained += _drain(leaving, "node_draining")


def _scale_down_victims(replicas: list[Replica], count: int) -> list[Replica]:
    # The ones not serving yet go first, then the newest.
    order = sorted(replicas, key=lambda r: (r.state == Replica.State.READY, r.pk))
    return order[:count]


def _place(launch: Launch, node_id: int, gpus: tuple[int, ...]) -> Replica:
    replica = Replica.objects.create(
        deployment_id=launch.deployment_id,
        node_id=node_id,
        gpu_indices=list(gpus),
        state=Replica.State.PENDING,
    )
    _control_plane_event(replica, "placed", f"on node {node_id}, GPUs {list(gpus)}")
    return replica


def _drain_orphans(deployment_ids: set[int]) -> int:
    orphans = Replica.objects.filter(state__in=Replica.DESIRED_STATES).exclude(
        deployment_id__in=deployment_ids
    )
    return _drain(list(orphans), "deployment_gone")


def _drain(replicas: Iterable[Replica], reason: str) -> int:
    now = timezone.now()
    count = 0
    for replica in replicas:
        replica.state = Replica.State.DRAINING
        replica.draining_since = now
        replica.save(update_fields=["state", "draining_since", "updated_at"])
        _control_plane_event(replica, "draining", reason)
        count += 1
    return count


def _retire_overdue_drains() -> int:
    overdue = Replica.objects.filter(
        state=Replica.State.DRAINING,
        draining_since__lt=timezone.now() - timedelta(seconds=DRAIN_TIMEOUT_S),
    )
    return _stop_replicas(overdue, "stopped", "the agent did not confirm the stop in time")


def _stop_replicas(replicas: Iterable[Replica], kind: str, message: str) -> int:
    now = timezone.now()
    stopped = []
    for replica in replicas:
        replica.state = Replica.State.STOPPED
        replica.stopped_at = now
        replica.save(update_fields=["state", "stopped_at", "updated_at"])
        _control_plane_event(replica, kind, message)
        stopped.append(replica.replica_id)
    if stopped:
        transaction.on_commit(lambda: _forget_quietly(stopped))
    return len(stopped)


def _forget_quietly(replica_ids: list[str]) -> None:
    try:
        telemetry.forget_replicas(telemetry.redis_client(), replica_ids)
    except Exception:  # the routing table excludes them anyway; stale telemetry expires
        logger.warning("could not drop the telemetry of stopped replicas", exc_info=True)


def _control_plane_event(replica: Replica, kind: str, message: str) -> None:
    try:
        with transaction.atomic():
            ReplicaEvent.objects.create(
                replica=replica,
                kind=kind,
                message=message,
                at=timezone.now(),
                source=ReplicaEvent.Source.CONTROL_PLANE,
            )
    except IntegrityError:  # the same event in the same microsecond: already recorded
        pass


# --- node health, cordon, drain -----------------------------------------------------------


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
            node.health = Node.Health.NOT_READY
            node.save(update_fields=["health"])
            _stop_replicas(
                node.replicas.filter(state__in=Replica.HOLDING_STATES),
                "node_lost",
                f"node {node.hostname} missed 3 heartbeats",
            )
            lost.append(node.pk)
            logger.warning(
                "node %s is NotReady: no heartbeat since %s", node, node.last_heartbeat_at
            )
        if lost:
            request_publish()
            request_reconcile()
    return lost


def do_cordon_node(node: Node) -> Node:
    """No new replicas on this node; the ones there keep serving."""
    return _set_scheduling(node, Node.Scheduling.CORDONED)


def do_uncordon_node(node: Node) -> Node:
    return _set_scheduling(node, Node.Scheduling.ACTIVE)


def do_drain_node(node: Node) -> Node:
    """Move every replica off: replacements are placed elsewhere first, then these drain."""
    node = _set_scheduling(node, Node.Scheduling.DRAINING)
    request_reconcile()
    return node


def _set_scheduling(node: Node, scheduling: str) -> Node:
    Node.objects.filter(pk=node.pk).update(scheduling=scheduling)
    node.scheduling = scheduling
    logger.info("node %s is now %s", node.hostname, scheduling)
    return node


# --- enqueueing ---------------------------------------------------------------------------


def request_publish() -> None:
    from serving.routing_table import request_publish as publish

    publish()


def request_reconcile() -> None:
    from serving.tasks import reconcile

    transaction.on_commit(_quietly(reconcile.delay))


def _quietly(send: Any) -> Any:
    def run() -> None:
        try:
            send()
        except Exception:  # a broker hiccup: beat runs the loop again in seconds anyway
            logger.warning("could not enqueue a fleet task", exc_info=True)

    return run
