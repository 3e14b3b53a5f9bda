"""Models of the GPU fleet: GPU classes and pools (nodes, GPUs and replicas build on these)."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from config.nul import validate_no_nul


def check_labels(labels: object) -> None:
    """A pool's labels: an object of text keys to text values, as Kubernetes labels are (a
    string, a list or a number stored there read as labels nowhere)."""
    if not isinstance(labels, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in labels.items()
    ):
        raise ValidationError(
            'Labels are a JSON object of text keys to text values, like {"zone": "a"}.',
            code="labels",
        )


class GpuClass(models.Model):
    """A kind of GPU with its datasheet figures (loaded from serving/engine/data/gpus.csv)."""

    name = models.CharField(max_length=64, unique=True)
    memory_gb = models.FloatField()
    mem_bandwidth_gbs = models.FloatField()
    bf16_tflops = models.FloatField()
    fp8_tflops = models.FloatField(null=True, blank=True)
    tdp_w = models.PositiveIntegerField()
    default_usd_per_hour = models.DecimalField(max_digits=10, decimal_places=4)
    notes = models.TextField(blank=True)

    class Meta:
        ordering = ["-memory_gb", "name"]
        verbose_name_plural = "GPU classes"

    def __str__(self) -> str:
        return self.name


class GpuPool(models.Model):
    """A set of nodes with one GPU class in one region, priced per GPU-hour."""

    name = models.SlugField(max_length=64, unique=True)
    gpu_class = models.ForeignKey(GpuClass, on_delete=models.PROTECT, related_name="pools")
    region = models.CharField(max_length=64)
    usd_per_gpu_hour = models.DecimalField(
        max_digits=10,
        decimal_places=4,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0"))],
        help_text="Overrides the GPU class's default price when set.",
    )
    spot = models.BooleanField(default=False)
    labels = models.JSONField(default=dict, blank=True, validators=[validate_no_nul, check_labels])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def price_per_gpu_hour(self) -> Decimal:
        if self.usd_per_gpu_hour is not None:
            return self.usd_per_gpu_hour
        return self.gpu_class.default_usd_per_hour


class JoinToken(models.Model):
    """A secret that lets a node agent register itself into one pool.

    Only the SHA-256 of the secret is stored; the secret is shown once, when it is made. A
    token expires (a day after it is made unless told otherwise) and may be single-use: the
    first registration that succeeds with it consumes it (`used_at`)."""

    pool = models.ForeignKey(GpuPool, on_delete=models.CASCADE, related_name="join_tokens")
    name = models.CharField(max_length=64, blank=True)
    token_hash = models.CharField(max_length=64, unique=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    single_use = models.BooleanField(default=False)
    used_at = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pool", "created_at"]

    def __str__(self) -> str:
        return f"{self.pool.name}:{self.name or self.pk}"


class Node(models.Model):
    """A GPU machine running a node agent.

    Health (`health`: ready / not ready, from heartbeats) and scheduling (`scheduling`: active,
    cordoned, draining, set by staff; drained, set by reconcile once a drain has moved or
    stopped every replica) are separate fields, so a node can be NotReady AND cordoned;
    `status` folds them into the one word the console shows.

    A drain has a deadline (`drain_deadline_s`, else settings.NODE_DRAIN_DEADLINE_S) counted
    from `drain_started_at`: past it, a drain still blocked asks staff to force or cancel it.
    Why each replica is blocked lives on the replica (`Replica.drain_blocked_reason`)."""

    class Health(models.TextChoices):
        READY = "ready", "Ready"
        NOT_READY = "not_ready", "NotReady"

    class Scheduling(models.TextChoices):
        ACTIVE = "active", "Active"
        CORDONED = "cordoned", "Cordoned"
        DRAINING = "draining", "Draining"
        DRAINED = "drained", "Drained"

    pool = models.ForeignKey(GpuPool, on_delete=models.PROTECT, related_name="nodes")
    hostname = models.CharField(max_length=255)
    agent_url = models.URLField(max_length=500)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.READY)
    scheduling = models.CharField(
        max_length=16, choices=Scheduling.choices, default=Scheduling.ACTIVE
    )
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # SHA-256 of the node token, for the agent -> control plane direction.
    token_hash = models.CharField(max_length=64, blank=True)
    # The node token is HMAC(SECRET_KEY, nonce): the control plane can rebuild it to call the
    # agent, yet the database alone never holds it (see serving/actions.py).
    token_nonce = models.CharField(max_length=64, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)
    drain_started_at = models.DateTimeField(null=True, blank=True)
    # This drain's own deadline in seconds; None: settings.NODE_DRAIN_DEADLINE_S.
    drain_deadline_s = models.PositiveIntegerField(null=True, blank=True)
    drain_finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["pool", "hostname"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "hostname"], name="node_hostname_per_pool")
        ]

    def __str__(self) -> str:
        return self.hostname

    @property
    def status(self) -> str:
        if self.health == self.Health.NOT_READY:
            return "NotReady"
        if self.scheduling == self.Scheduling.CORDONED:
            return "Cordoned"
        if self.scheduling == self.Scheduling.DRAINING:
            return "Draining"
        if self.scheduling == self.Scheduling.DRAINED:
            return "Drained"
        return "Ready"

    @property
    def schedulable(self) -> bool:
        return self.health == self.Health.READY and self.scheduling == self.Scheduling.ACTIVE

    @property
    def drain_deadline_at(self) -> datetime | None:
        if self.scheduling != self.Scheduling.DRAINING or self.drain_started_at is None:
            return None
        seconds = self.drain_deadline_s
        if seconds is None:
            seconds = settings.NODE_DRAIN_DEADLINE_S
        return self.drain_started_at + timedelta(seconds=seconds)

    @property
    def drain_overdue(self) -> bool:
        """Past its deadline and still draining: the console asks to force or cancel."""
        deadline = self.drain_deadline_at
        return deadline is not None and timezone.now() >= deadline


class Gpu(models.Model):
    """One GPU of a node, as the agent inventoried it."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=128)
    name = models.CharField(max_length=128)
    memory_mb = models.PositiveIntegerField()

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node.hostname}/gpu{self.index}"


class Replica(models.Model):
    """One engine process of a deployment, on some GPUs of one node."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        STARTING = "starting", "Starting"
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        FAILED = "failed", "Failed"
        STOPPED = "stopped", "Stopped"

    # States whose process the agent should be running: they hold their GPUs.
    DESIRED_STATES = (State.PENDING, State.STARTING, State.READY, State.FAILED)
    # States that hold GPUs on the node (a draining process is still alive).
    HOLDING_STATES = (*DESIRED_STATES, State.DRAINING)

    class Phase(models.TextChoices):
        # A colocated replica prefills and decodes its requests; a disaggregated deployment's
        # replicas do one phase each, and hand KV from prefill to decode.
        COLOCATED = "colocated", "Colocated"
        PREFILL = "prefill", "Prefill"
        DECODE = "decode", "Decode"

    deployment = models.ForeignKey(
        "registry.Deployment", on_delete=models.CASCADE, related_name="replicas"
    )
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="replicas")
    phase = models.CharField(max_length=16, choices=Phase.choices, default=Phase.COLOCATED)
    gpu_indices = models.JSONField(default=list, validators=[validate_no_nul])
    port = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    last_error = models.TextField(blank=True)
    restarts = models.PositiveIntegerField(default=0)
    pid = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    draining_since = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # On a draining node, why this replica cannot leave yet and what would let it; reconcile
    # writes them each tick and clears them once it leaves (or the drain is cancelled).
    drain_blocked_reason = models.TextField(blank=True)
    drain_unblock = models.JSONField(default=list, blank=True, validators=[validate_no_nul])
    drain_blocked_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["deployment", "created_at"]
        indexes = [models.Index(fields=["state", "node"])]

    def __str__(self) -> str:
        return f"replica {self.pk} of deployment {self.deployment_id} on {self.node_id}"

    @property
    def replica_id(self) -> str:
        return str(self.pk)


class ReplicaEvent(models.Model):
    """Something that happened to a replica: a crash, a restart, a state change, a placement."""

    class Source(models.TextChoices):
        AGENT = "agent", "Agent"
        CONTROL_PLANE = "control_plane", "Control plane"

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=64)
    message = models.TextField(blank=True)
    at = models.DateTimeField()
    source = models.CharField(max_length=16, choices=Source.choices)

    class Meta:
        ordering = ["replica", "at"]
        constraints = [
            # Agents resend events until a heartbeat succeeds: a replay must not duplicate.
            models.UniqueConstraint(fields=["replica", "kind", "at"], name="replica_event_once")
        ]

    def __str__(self) -> str:
        return f"{self.kind} at {self.at:%Y-%m-%d %H:%M:%S}"


class TelemetrySample(models.Model):
    """A sampled point of a replica's engine telemetry (about one per 30 s per replica)."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    running = models.PositiveIntegerField()
    waiting = models.PositiveIntegerField()
    kv_cache_usage = models.FloatField()
    prompt_tokens_total = models.BigIntegerField()
    generation_tokens_total = models.BigIntegerField()
    prefix_cache_hits_total = models.BigIntegerField()
    prefix_cache_queries_total = models.BigIntegerField()
    preemptions_total = models.BigIntegerField()
    gpu_utilization_pct = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["replica", "at"]

    def __str__(self) -> str:
        return f"sample of {self.replica_id} at {self.at:%H:%M:%S}"
