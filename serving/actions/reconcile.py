"""Placement: desired replica counts against the replicas that exist, then place, drain and
retire; the replica specs each agent is told to run. Level-triggered, one reconcile at a time
fleet-wide (a PostgreSQL advisory lock)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import DateTimeField, F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from config.jobs import enqueue_on_commit
from config.loops import LoopPass
from config.redis import redis_client
from registry.actions import do_note_canary_placement
from registry.models import Deployment
from serving import telemetry
from serving.actions.credentials import engine_api_key
from serving.capacity.step_budget import chosen_max_num_batched_tokens
from serving.engine.perf import PerfModel
from serving.engine.placement import fits
from serving.engine.specs import (
    ModelSpec,
    find_model_spec,
    load_gpu_specs,
    normalize_quantization,
)
from serving.models import Gpu, Node, Replica, ReplicaEvent
from serving.router import DEFAULT_SLO_TIERS

logger = logging.getLogger(__name__)

# A draining replica the agent never confirms stopped is written off after this long.
DRAIN_TIMEOUT_S = 30
RECONCILE_LOCK_ID = 0x5E271C  # pg advisory lock: one reconcile at a time, fleet-wide
# vLLM's --quantization for each of the registry's weight formats.
VLLM_QUANTIZATION: dict[str, str | None] = {"bf16": None, "fp8": "fp8", "awq-int4": "awq"}


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
    launch = phase_launch(replica.deployment, replica.phase)
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
        "max_num_batched_tokens": launch.max_num_batched_tokens,
        "gpu_memory_utilization": launch.gpu_memory_utilization,
        "enable_prefix_caching": launch.enable_prefix_caching,
        "enable_lora": launch.enable_lora,
        "max_loras": launch.max_loras,
        "max_lora_rank": launch.max_lora_rank,
        "adapters": [{"name": name, "path": path} for name, path in launch.adapters],
        "sim": {
            "gpu_class": replica.node.pool.gpu_class.name,
            "model_spec": launch.model_spec,
            "time_scale": settings.SERVING_SIM_TIME_SCALE,
            "extra_args": ["--sim-stop-at-eos"] if settings.SERVING_SIM_STOP_AT_EOS else [],
        },
        "api_key": engine_api_key(replica.pk),
        "kv_transfer": kv_transfer(launch),
    }


# vLLM's connector and KV role for each registry connector and phase: NIXL runs kv_both on
# either side (the prefill answer's kv_transfer_params tell the decode side where to pull
# from, as llm-d and vLLM's disaggregated proxy pass them); the shared-storage connector
# writes on the producer and reads on the consumer.
KV_CONNECTORS: dict[str, tuple[str, dict[str, str]]] = {
    "nixl": ("NixlConnector", {"prefill": "kv_both", "decode": "kv_both"}),
    "shared_storage": ("ExampleConnector", {"prefill": "kv_producer", "decode": "kv_consumer"}),
}
# The link (a row of serving/engine/data/links.csv) the router predicts each connector's
# hand-over on. NIXL: GPU nodes' RDMA NICs, one 400 Gb/s NIC per GPU as in HGX rail designs
# (no pool field names its fabric yet, so a RoCE or slower fabric is predicted optimistic);
# shared storage: one host's file system, as the CPU nodes run it.
KV_CONNECTOR_LINKS: dict[str, str] = {
    "nixl": "infiniband-ndr-400",
    "shared_storage": "shared-storage-local",
}


def kv_transfer(launch: Launch) -> dict[str, str] | None:
    """The replica's KV hand-over as the agent launches it; None for a colocated replica."""
    if launch.phase == Replica.Phase.COLOCATED:
        return None
    connector, roles = KV_CONNECTORS[launch.kv_connector]
    return {"connector": connector, "role": roles[launch.phase]}


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
    # The deployment's own, or the platform's choice (`launch_budget`); None: vLLM's own.
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    adapters: tuple[tuple[str, str], ...]
    slo_tier: str
    traffic_weight: int
    # Colocated, or the phase of a disaggregated deployment this launch is (its pool and
    # desired count are that phase's), with the deployment's KV connector.
    phase: str = "colocated"
    kv_connector: str = ""
    # The fewest Ready replicas a drain with nowhere to move them may leave (replicas_min).
    minimum: int = 0
    # For what a blocked drain says.
    deployment_name: str = ""
    pool_name: str = ""


def registry_related(prefix: str = "") -> list[str]:
    return [
        f"{prefix}model_version__model",
        f"{prefix}pool__gpu_class",
        f"{prefix}decode_pool__gpu_class",
    ]


def deployment_launches(deployment: Any) -> list[Launch]:
    """One launch per phase: the colocated one, or a disaggregated deployment's prefill and
    decode launches, each on its own pool with its own desired count."""
    launch = deployment_launch(deployment)
    if deployment.decode_pool_id is None:
        return [launch]
    return [
        phase_launch(deployment, Replica.Phase.PREFILL, launch),
        phase_launch(deployment, Replica.Phase.DECODE, launch),
    ]


def phase_launch(deployment: Any, phase: str, launch: Launch | None = None) -> Launch:
    launch = launch or deployment_launch(deployment)
    if phase == Replica.Phase.COLOCATED or deployment.decode_pool_id is None:
        return launch
    if phase == Replica.Phase.PREFILL:
        return replace(launch, phase=phase, kv_connector=deployment.kv_connector)
    active = deployment.status == "active"
    return replace(
        launch,
        phase=phase,
        kv_connector=deployment.kv_connector,
        pool_id=deployment.decode_pool_id,
        desired=int(deployment.decode_replicas_desired) if active else 0,
        minimum=int(deployment.decode_replicas_min) if active else 0,
        pool_name=str(deployment.decode_pool.name),
    )


def deployments_to_run() -> list[Any]:
    """Every deployment that is not stopped: active ones want replicas, draining ones are
    listed so that their replicas are drained (and never routed to)."""
    return list(
        Deployment.objects.exclude(status=Deployment.Status.STOPPED)
        .select_related(*registry_related())
        .prefetch_related("model_version__adapters")
        .order_by("pk")
    )


def launch_budget(deployment: Any, args: dict[str, Any], quantization: str) -> int | None:
    """The prefill budget of the deployment's engine steps: its own when its engine arguments
    name one; else, colocated, the platform's choice for its pool's GPU class and its tier's
    TPOT objective (`serving.capacity.step_budget`). None leaves vLLM's own: on a CPU or
    uncatalogued class, for a tier without a TPOT objective, and on disaggregated phases (a
    prefill replica runs no decodes beside its chunks, a decode replica no prompts)."""
    if args.get("max_num_batched_tokens") is not None:
        return int(args["max_num_batched_tokens"])
    tier = DEFAULT_SLO_TIERS.get(str(deployment.slo_tier))
    gpu = load_gpu_specs().get(deployment.pool.gpu_class.name)
    if deployment.decode_pool_id is not None or tier is None or gpu is None:
        return None
    try:
        perf = PerfModel(
            gpu,
            deployment.model_version.model.spec(),
            quantization,
            int(deployment.tensor_parallel),
            kv_cache_dtype=str(args.get("kv_cache_dtype") or "auto"),
            gpu_memory_utilization=float(args.get("gpu_memory_utilization") or 0.9),
        )
    except ValueError:
        return None
    return chosen_max_num_batched_tokens(perf, tier.tpot_s, int(args.get("max_num_seqs") or 256))


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
        minimum=int(deployment.replicas_min) if deployment.status == "active" else 0,
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
        max_num_batched_tokens=launch_budget(deployment, args, quantization),
        gpu_memory_utilization=float(args.get("gpu_memory_utilization") or 0.9),
        enable_prefix_caching=bool(args.get("enable_prefix_caching", True)),
        enable_lora=bool(args.get("enable_lora", False)) or bool(adapters),
        # vLLM needs at least one LoRA slot once LoRA is on.
        max_loras=max(1, int(args.get("max_loras") or min(len(adapters), 4))),
        max_lora_rank=int(args.get("max_lora_rank") or 16),
        adapters=adapters,
        slo_tier=str(deployment.slo_tier),
        traffic_weight=int(deployment.traffic_weight),
        deployment_name=str(deployment.name),
        pool_name=str(deployment.pool.name),
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


def placement_failure(rooms: list[NodeRoom], launch: Launch) -> str:
    """Why `choose_node` found nowhere for a replica of `launch`, in words."""
    mine = [room for room in rooms if room.pool_id == launch.pool_id]
    phase = "" if launch.phase == Replica.Phase.COLOCATED else f" ({launch.phase} phase)"
    needs = f"needs {launch.tensor_parallel} free GPU{'s' if launch.tensor_parallel > 1 else ''}"
    if not mine:
        return f"its pool has no ready, schedulable node{phase}"
    free = sum(len(room.free) for room in mine)
    nodes = f"{len(mine)} node{'s' if len(mine) > 1 else ''}"
    if all(len(room.free) < launch.tensor_parallel for room in mine):
        return f"{needs} on one node{phase}; its pool has {free} free on {nodes}"
    return f"the free GPUs of its pool are too small for the model{phase}"


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
    # Why a replica could not be placed, by deployment id: what a rollout shows of its canary.
    placement_failures: dict[int, str] = field(default_factory=dict)
    # Replicas of draining nodes that stay this tick: replica id -> (why, what would unblock).
    drain_blocked: dict[int, tuple[str, list[str]]] = field(default_factory=dict)
    drains_finished: int = 0
    # Deployments this pass failed on (their error), left as they were (config.loops).
    failed: dict[int, str] = field(default_factory=dict)

    def absorb(self, other: ReconcileReport) -> None:
        """Add one deployment's part of the pass, once it went through."""
        self.placed += other.placed
        self.drained += other.drained
        self.stopped += other.stopped
        self.unplaceable += other.unplaceable
        self.placement_failures.update(other.placement_failures)
        self.drain_blocked.update(other.drain_blocked)


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
        this_pass = LoopPass("reconcile", "deployment")
        launches: list[Launch] = []
        held: set[int] = set()
        rooms = _node_rooms()
        for deployment in deployments_to_run():
            # One savepoint for all of a deployment's phases. Its room and report changes
            # are taken only once it succeeded: a failure half way leaves no GPU taken and
            # no count or note of it behind for the others.
            trial_rooms, trial = dict(rooms), ReconcileReport()
            with this_pass.item(deployment.pk):
                mine = deployment_launches(deployment)
                for launch in mine:
                    _reconcile_deployment(launch, trial_rooms, trial)
                launches.extend(mine)
                rooms.update(trial_rooms)
                report.absorb(trial)
            if deployment.pk in this_pass.failed and deployment.status == Deployment.Status.ACTIVE:
                held.add(deployment.pk)
        # An active deployment this pass failed on keeps every replica it has, of any phase:
        # what it wants is unknown, and draining them would turn one bad row into an outage.
        # A draining one's replicas drain as orphans: it is being retired.
        wanted = {(launch.deployment_id, launch.phase) for launch in launches}
        wanted |= {(pk, phase) for pk in held for phase in Replica.Phase.values}
        report.drained += _drain_orphans(wanted)
        report.failed = dict(this_pass.failed)
        # The failing rows' notes (pending capacity, drain blockers) stay as the last pass
        # that got through them left them.
        do_note_canary_placement(report.placement_failures, unchanged=this_pass.failed)
        _record_drain_blockers(report.drain_blocked, unchanged=this_pass.failed)
        report.drains_finished = _finish_drains()
        if report.placed or report.drained or report.stopped:
            request_publish()
    this_pass.record(redis_client())
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
        Replica.objects.filter(
            deployment_id=launch.deployment_id,
            phase=launch.phase,
            state__in=Replica.DESIRED_STATES,
        )
        .select_related("node")
        .order_by("pk")
    )
    # Replicas on a draining node do not count: their replacements are placed first.
    staying = [r for r in live if r.node.scheduling != Node.Scheduling.DRAINING]
    leaving = [r for r in live if r.node.scheduling == Node.Scheduling.DRAINING]
    missing = launch.desired - len(staying)
    per_node = Counter(r.node_id for r in live)
    short = False
    for _ in range(max(0, missing)):
        views = [replace(room, same_deployment=per_node[room.node_id]) for room in rooms.values()]
        choice = choose_node(views, launch)
        if choice is None:
            short = True
            report.unplaceable += 1
            report.placement_failures[launch.deployment_id] = placement_failure(
                list(rooms.values()), launch
            )
            logger.warning("no room for a replica of deployment %s", launch.deployment_id)
            break
        room, gpus = choice
        staying.append(_place(launch, room.node_id, gpus))
        per_node[room.node_id] += 1
        rooms[room.node_id] = replace(room, free=tuple(i for i in room.free if i not in gpus))
        report.placed += 1
    if missing < 0:  # nothing was placed
        report.drained += drain_replicas(_scale_down_victims(staying, -missing), "scaled_down")
    if leaving:
        report.drained += _move_off_draining_nodes(launch, staying, leaving, rooms, short, report)


def _move_off_draining_nodes(
    launch: Launch,
    staying: list[Replica],
    leaving: list[Replica],
    rooms: dict[int, NodeRoom],
    short: bool,
    report: ReconcileReport,
) -> int:
    """A draining node's replicas leave once their replacements serve, so capacity never dips.
    With no room for a replacement they leave while the deployment keeps replicas_min Ready
    replicas (as a PodDisruptionBudget allows an eviction); the others stay, each with why and
    what would let it go, until room appears or staff force or cancel the drain."""
    ready_elsewhere = sum(1 for r in staying if r.state == Replica.State.READY)
    if ready_elsewhere >= launch.desired:
        return drain_replicas(leaving, "node_draining")
    going: list[Replica] = []
    held = leaving
    if short:
        ready_leaving = [r for r in leaving if r.state == Replica.State.READY]
        spare = max(0, ready_elsewhere + len(ready_leaving) - launch.minimum)
        going = [r for r in leaving if r.state != Replica.State.READY] + ready_leaving[:spare]
        held = ready_leaving[spare:]
    for replica in held:
        runs_at = len(staying) + sum(1 for r in held if r.node_id != replica.node_id)
        if short:
            reason, unblock = _no_room_blocker(launch, replica, rooms, ready_elsewhere)
        else:
            reason, unblock = _replacement_blocker(launch, staying, ready_elsewhere)
        unblock.append(
            f"force the drain: the replica stops and {_named(launch)} runs at {runs_at} "
            f"of {launch.desired} replica{'s' if launch.desired != 1 else ''}"
        )
        report.drain_blocked[replica.pk] = (reason, unblock)
    return drain_replicas(going, "node_draining_below_desired") if going else 0


def _named(launch: Launch) -> str:
    phase = "" if launch.phase == Replica.Phase.COLOCATED else f" ({launch.phase} phase)"
    return f"deployment {launch.deployment_name or launch.deployment_id}{phase}"


def _gpus(count: int) -> str:
    return f"{count} free GPU{'s' if count != 1 else ''}"


def _no_room_blocker(
    launch: Launch, replica: Replica, rooms: dict[int, NodeRoom], ready_elsewhere: int
) -> tuple[str, list[str]]:
    pool, tp = launch.pool_name or f"#{launch.pool_id}", launch.tensor_parallel
    mine = [room for room in rooms.values() if room.pool_id == launch.pool_id]
    others = Node.objects.filter(pool_id=launch.pool_id).exclude(pk=replica.node_id).count()
    add = f"add a node to pool {pool} with at least {_gpus(tp)}"
    if others == 0:
        where = f"{replica.node.hostname} is the only node of pool {pool}"
    elif not mine:
        where = (
            f"no other node of pool {pool} is Ready and schedulable "
            f"({others} cordoned, draining or NotReady)"
        )
        add = f"{add}, or uncordon one of its nodes"
    elif all(len(room.free) < tp for room in mine):
        free = sum(len(room.free) for room in mine)
        where = (
            f"no other Ready node of pool {pool} has {_gpus(tp)} for its TP {tp} "
            f"({free} free on {len(mine)} node{'s' if len(mine) != 1 else ''})"
        )
    else:
        where = f"the free GPUs of pool {pool} are too small for the model at TP {tp}"
        add = f"add a node to pool {pool} whose GPUs hold the model at TP {tp}"
    reason = (
        f"{where}; stopping it would leave {_named(launch)} {ready_elsewhere} Ready "
        f"replica{'s' if ready_elsewhere != 1 else ''}, under its replicas_min of "
        f"{launch.minimum}"
    )
    lower = f"lower replicas_min of {_named(launch)} to {ready_elsewhere}"
    return reason, [add, lower]


def _replacement_blocker(
    launch: Launch, staying: list[Replica], ready_elsewhere: int
) -> tuple[str, list[str]]:
    starting = [r for r in staying if r.state != Replica.State.READY]
    reason = (
        f"waiting for its replacement to become Ready: {_named(launch)} has "
        f"{ready_elsewhere} of {launch.desired} replicas Ready elsewhere"
    )
    which = ", ".join(f"replica {r.pk} on {r.node.hostname} ({r.state})" for r in starting)
    return reason, [f"wait for {which or 'the replacement'} to become Ready"]


def _record_drain_blockers(
    blocked: dict[int, tuple[str, list[str]]], unchanged: Collection[int] = ()
) -> None:
    """What the console shows of each blocked replica; `since` stays from the first tick.
    The replicas of the deployments in `unchanged` keep what they show."""
    Replica.objects.filter(drain_blocked_since__isnull=False).exclude(pk__in=list(blocked)).exclude(
        deployment_id__in=list(unchanged)
    ).update(drain_blocked_reason="", drain_unblock=[], drain_blocked_since=None)
    now = timezone.now()
    for replica_id, (reason, unblock) in blocked.items():
        Replica.objects.filter(pk=replica_id).update(
            drain_blocked_reason=reason,
            drain_unblock=unblock,
            drain_blocked_since=Coalesce(
                F("drain_blocked_since"), Value(now, output_field=DateTimeField())
            ),
        )


def _finish_drains() -> int:
    """A draining node with no replica left holding its GPUs is drained."""
    done = Node.objects.filter(scheduling=Node.Scheduling.DRAINING).exclude(
        replicas__state__in=Replica.HOLDING_STATES
    )
    hostnames = list(done.values_list("hostname", flat=True))
    finished = done.update(scheduling=Node.Scheduling.DRAINED, drain_finished_at=timezone.now())
    for hostname in hostnames:
        logger.info("node %s is drained", hostname)
    return finished


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
        phase=launch.phase,
    )
    where = f"on node {node_id}, GPUs {list(gpus)}"
    if launch.phase != Replica.Phase.COLOCATED:
        where = f"{where}, {launch.phase} phase"
    _control_plane_event(replica, "placed", where)
    return replica


def _drain_orphans(wanted: set[tuple[int, str]]) -> int:
    """Drain the replicas no launch wants: their deployment is gone or stopped, or it changed
    between colocated and disaggregated (its old phase's replicas)."""
    live = Replica.objects.filter(state__in=Replica.DESIRED_STATES).only("deployment_id", "phase")
    orphans = [r for r in live if (r.deployment_id, r.phase) not in wanted]
    return drain_replicas(orphans, "deployment_gone")


def drain_replicas(replicas: Iterable[Replica], reason: str) -> int:
    """Out of the routing table at the next publish; the agent stops each process."""
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
    return stop_replicas(overdue, "stopped", "the agent did not confirm the stop in time")


def stop_replicas(replicas: Iterable[Replica], kind: str, message: str) -> int:
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
        telemetry.forget_replicas(redis_client(), replica_ids)
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


def request_publish() -> None:
    """Republish the routing table once the current transaction commits."""
    enqueue_on_commit("serving.publish_routing_table")


def request_reconcile() -> None:
    """Reconcile once the current transaction commits."""
    enqueue_on_commit("serving.reconcile")
