"""Models of the registry: models, versions, LoRA adapters, deployments and canary rollouts.

A `Model.name` is the served model name clients put in `"model"`. Its deployments share that
name in the routing table, which splits traffic between its versions by traffic weight (a
version's weight is the sum of its deployments' `Deployment.traffic_weight`; 0 takes nothing).
Inside the chosen version the router's policy picks a replica across all of the version's
deployments, so one version deployed on two pools (GPU classes) is one set of replicas, and
the cost-aware policy chooses between the classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from config.nul import validate_no_nul
from registry.rollout_policy import CanaryState, GateThresholds
from serving.engine.specs import BYTES_PER_PARAM, ModelSpec

SERVED_NAME = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,127}$",
    "Lower-case letters, digits, dots, dashes and underscores, starting with a letter or digit.",
)
ARTIFACT_URI = RegexValidator(
    r"^(s3://[^/\s]+/\S*|hf://\S+|file:///\S+)$",
    "An artifact URI starts with s3://bucket/, hf:// or file:///.",
)


def check_artifact_file_uri(uri: str) -> None:
    """A file:// artifact must lie inside PLATFORM_MODEL_ROOT, symlinks resolved, so that a
    registration cannot point an engine at /etc/passwd or at someone else's files. The path
    is the one the engine loads (serving.agent.launch.engine_path: percent-decoded)."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        return
    root = Path(settings.PLATFORM_MODEL_ROOT).resolve()
    refused = ValidationError(
        "A file:// artifact must be a directory inside the platform's model root "
        "(PLATFORM_MODEL_ROOT)."
    )
    path = unquote(parts.path)
    if parts.netloc or not path.startswith("/") or "\x00" in path:
        raise refused  # file://../x, file://host/x: relative or not this machine's
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop
        raise refused from error
    if resolved == root or not resolved.is_relative_to(root):
        raise refused


def _check_artifact_field(uri: str) -> None:
    """`check_artifact_file_uri` for a model's clean(): the error on its artifact_uri field."""
    try:
        check_artifact_file_uri(uri)
    except ValidationError as error:
        raise ValidationError({"artifact_uri": error.messages}) from None


class Visibility(models.TextChoices):
    PUBLIC = "public"
    RESTRICTED = "restricted"


class Quantization(models.TextChoices):
    BF16 = "bf16"
    FP8 = "fp8"
    AWQ_INT4 = "awq-int4"


class SloTier(models.TextChoices):
    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"


class Model(models.Model):
    """A served model with the architecture figures the performance model needs."""

    name = models.CharField(max_length=128, unique=True, validators=[SERVED_NAME])
    family = models.CharField(max_length=64)
    description = models.TextField(blank=True)
    params_b = models.FloatField(
        validators=[MinValueValidator(0.01), MaxValueValidator(100_000)], help_text="Billions."
    )
    # At least 1 each: a model of no layers or KV heads holds no KV, and the capacity
    # arithmetic of every loop that places and routes would divide by it.
    layers = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    hidden = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    kv_heads = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    head_dim = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    max_context = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    visibility = models.CharField(
        max_length=16, choices=Visibility.choices, default=Visibility.PUBLIC
    )
    granted_tenants = models.ManyToManyField(
        "tenants.Tenant", blank=True, related_name="granted_models"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def kv_bytes_per_token_bf16(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def spec(self) -> ModelSpec:
        return ModelSpec(
            name=self.name,
            params_b=self.params_b,
            layers=self.layers,
            hidden=self.hidden,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_context=self.max_context,
            kv_bytes_per_token_bf16=self.kv_bytes_per_token_bf16,
        )


class ModelVersion(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft"
        APPROVED = "approved"
        DEPRECATED = "deprecated"
        RETIRED = "retired"

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="versions")
    version = models.CharField(max_length=64, validators=[SERVED_NAME])
    artifact_uri = models.CharField(max_length=500, validators=[ARTIFACT_URI])
    revision = models.CharField(max_length=128, blank=True)
    quantization = models.CharField(
        max_length=16, choices=Quantization.choices, default=Quantization.BF16
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DRAFT)
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    approved_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["model", "version"], name="one_version_label_per_model")
        ]

    def __str__(self) -> str:
        return f"{self.model.name}@{self.version}"

    def clean(self) -> None:
        _check_artifact_field(self.artifact_uri)

    @property
    def weights_gb(self) -> float:
        return self.model.params_b * BYTES_PER_PARAM[self.quantization]


class Adapter(models.Model):
    """A LoRA on a base version. `name` is what a client puts in `"model"` to use it."""

    name = models.CharField(max_length=128, unique=True, validators=[SERVED_NAME])
    base_version = models.ForeignKey(
        ModelVersion, on_delete=models.PROTECT, related_name="adapters"
    )
    rank = models.PositiveSmallIntegerField(
        default=16, validators=[MinValueValidator(1), MaxValueValidator(512)]
    )
    artifact_uri = models.CharField(max_length=500, validators=[ARTIFACT_URI])
    # No owner: a platform adapter. An owned adapter is always visible to its owner.
    owner_tenant = models.ForeignKey(
        "tenants.Tenant",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="adapters",
    )
    visibility = models.CharField(
        max_length=16, choices=Visibility.choices, default=Visibility.RESTRICTED
    )
    granted_tenants = models.ManyToManyField(
        "tenants.Tenant", blank=True, related_name="granted_adapters"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        _check_artifact_field(self.artifact_uri)


# vLLM launch settings a deployment starts from; engine_args on a row override any of them.
DEFAULT_ENGINE_ARGS: dict[str, object] = {
    "max_model_len": 8192,
    "max_num_seqs": 256,
    # Prompt tokens an engine step may compute. None: the platform chooses per pool class for
    # the deployment's tier, the largest chunk whose step with a decode batch fits its TPOT
    # objective (serving.actions.reconcile.launch_budget), and leaves vLLM's own (2048, or
    # 8192 on 70 GB GPUs but the A100) where the tier has none, the class is not catalogued
    # or the deployment is disaggregated.
    "max_num_batched_tokens": None,
    "gpu_memory_utilization": 0.9,
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": True,
    # LoRA turns on by itself when the version has adapters (serving.actions.deployment_launch).
    "enable_lora": False,
    "max_loras": 0,
    "max_lora_rank": 16,
}


def default_engine_args() -> dict[str, object]:
    return dict(DEFAULT_ENGINE_ARGS)


class Deployment(models.Model):
    """A model version served from a pool. Colocated (the default): each replica prefills and
    decodes its own requests. Disaggregated (`decode_pool` set): `pool` runs the prefill
    replicas (`replicas_*`) and `decode_pool` the decode replicas (`decode_replicas_*`), possibly
    of another GPU class; each request is prefilled on one and decoded on the other, its KV
    handed over by `kv_connector` (vLLM's --kv-transfer-config)."""

    class Status(models.TextChoices):
        ACTIVE = "active"  # replicas wanted; in the routing table at its traffic weight
        DRAINING = "draining"  # out of the routing table; replicas finish what they hold
        STOPPED = "stopped"  # no replicas

    class KvConnector(models.TextChoices):
        # vLLM's NixlConnector with kv_role kv_both: KV over RDMA or NVLink, GPU nodes only.
        NIXL = "nixl", "NIXL (GPU nodes)"
        # vLLM's ExampleConnector: KV through a directory both phases' nodes mount (the agent's
        # --kv-shared-dir); what vLLM's CPU build can run.
        SHARED_STORAGE = "shared_storage", "Shared storage"

    name = models.SlugField(max_length=128, unique=True)
    model_version = models.ForeignKey(
        ModelVersion, on_delete=models.PROTECT, related_name="deployments"
    )
    pool = models.ForeignKey(
        "serving.GpuPool", on_delete=models.PROTECT, related_name="deployments"
    )
    tensor_parallel = models.PositiveSmallIntegerField(
        default=1, choices=[(1, "1"), (2, "2"), (4, "4"), (8, "8")]
    )
    replicas_min = models.PositiveIntegerField(default=1)
    replicas_max = models.PositiveIntegerField(default=1)
    replicas_desired = models.PositiveIntegerField(default=1)
    decode_pool = models.ForeignKey(
        "serving.GpuPool",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="decode_deployments",
        help_text="Set to disaggregate: the pool of the decode replicas; `pool` then prefills.",
    )
    decode_replicas_min = models.PositiveIntegerField(default=1)
    decode_replicas_max = models.PositiveIntegerField(default=1)
    decode_replicas_desired = models.PositiveIntegerField(default=1)
    kv_connector = models.CharField(max_length=16, choices=KvConnector.choices, blank=True)
    engine_args = models.JSONField(
        default=default_engine_args, blank=True, validators=[validate_no_nul]
    )
    slo_tier = models.CharField(max_length=16, choices=SloTier.choices, default=SloTier.STANDARD)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    # This deployment's part of its version's share of the served model name's traffic (the
    # version's share is the sum over its deployments; 0 drains it). The router does not
    # split between deployments of one version: it picks a replica across them. The rollout
    # controller moves it between a baseline and a canary, which are different versions.
    traffic_weight = models.PositiveSmallIntegerField(
        default=100, validators=[MaxValueValidator(100)]
    )
    # Pending capacity: why a replica it wants has no room on the fleet ("" once all have
    # room), written on create and by every reconcile; `_since` is when it started waiting.
    placement_failure = models.TextField(blank=True)
    placement_failure_since = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(replicas_min__lte=models.F("replicas_desired"))
                & models.Q(replicas_desired__lte=models.F("replicas_max")),
                name="deployment_replicas_min_desired_max",
            ),
            models.CheckConstraint(
                condition=models.Q(traffic_weight__lte=100), name="deployment_weight_percent"
            ),
            models.CheckConstraint(
                condition=models.Q(decode_replicas_min__lte=models.F("decode_replicas_desired"))
                & models.Q(decode_replicas_desired__lte=models.F("decode_replicas_max")),
                name="deployment_decode_replicas_min_desired_max",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def served_model_name(self) -> str:
        return self.model_version.model.name

    @property
    def disaggregated(self) -> bool:
        return self.decode_pool_id is not None

    def clean(self) -> None:
        if self.decode_pool_id is None:
            if self.kv_connector:
                raise ValidationError(
                    {
                        "kv_connector": [
                            "A KV connector is for a disaggregated deployment: "
                            "choose its decode pool too."
                        ]
                    }
                )
            return
        if not self.kv_connector:
            raise ValidationError(
                {"kv_connector": ["A disaggregated deployment needs a KV connector."]}
            )

    def effective_engine_args(self) -> dict[str, object]:
        return {**DEFAULT_ENGINE_ARGS, **(self.engine_args or {})}

    @property
    def pending_capacity(self) -> bool:
        return self.status == self.Status.ACTIVE and bool(self.placement_failure)


def default_steps() -> list[int]:
    return [5, 25, 50, 100]


class Rollout(models.Model):
    class State(models.TextChoices):
        RUNNING = "running"
        PAUSED = "paused"
        PROMOTED = "promoted"
        ROLLED_BACK = "rolled_back"
        ABORTED = "aborted"

    LIVE_STATES = (State.RUNNING, State.PAUSED)

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="rollouts")
    baseline = models.ForeignKey(
        Deployment, on_delete=models.PROTECT, related_name="rollouts_as_baseline"
    )
    canary = models.ForeignKey(
        Deployment, on_delete=models.PROTECT, related_name="rollouts_as_canary"
    )
    steps = models.JSONField(default=default_steps, validators=[validate_no_nul])
    step_index = models.PositiveSmallIntegerField(default=0)
    step_started_at = models.DateTimeField()
    step_min_duration_s = models.PositiveIntegerField(default=300)
    step_min_requests = models.PositiveIntegerField(default=200)
    # Overrides of registry.rollout_policy.GateThresholds, by field name.
    gate_thresholds = models.JSONField(default=dict, blank=True, validators=[validate_no_nul])
    # Canary traffic chosen by tenant (one tenant sees one version), not by request. The
    # routing table publishes it as ModelRoute.cohort_by_tenant for the served model name.
    cohort_by_tenant = models.BooleanField(default=False)
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    # Counter snapshots (registry.rollout_metrics marks) that open the comparison windows.
    baseline_mark = models.JSONField(default=dict, blank=True, validators=[validate_no_nul])
    canary_mark = models.JSONField(default=dict, blank=True, validators=[validate_no_nul])
    # The canary's replicas as the controller last saw them (registry.rollout_policy's
    # CanaryState): any state but "serving" holds its weight at 0 %. `canary_since` is when
    # it entered that state; `canary_reason` says why, in words.
    canary_state = models.CharField(
        max_length=16,
        choices=[(state.value, state.value.replace("_", " ")) for state in CanaryState],
        default=CanaryState.PLACING.value,
    )
    canary_reason = models.TextField(blank=True)
    canary_since = models.DateTimeField(null=True, blank=True)
    # The fleet's reconcile writes why it could not place a canary replica ("" once it did).
    canary_placement_failure = models.TextField(blank=True)
    # The controller's latest reading, for the console: move, reason and gate figures.
    last_decision = models.JSONField(default=dict, blank=True, validators=[validate_no_nul])
    last_tick_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"],
                condition=models.Q(state__in=["running", "paused"]),
                name="one_live_rollout_per_model",
            )
        ]

    def __str__(self) -> str:
        return f"rollout {self.pk} of {self.model.name}"

    @property
    def canary_weight(self) -> int:
        """The weight of the current step; the canary holds 0 % until it serves."""
        return int(self.steps[self.step_index])

    @property
    def canary_held(self) -> bool:
        return self.canary_state != CanaryState.SERVING

    @property
    def gate_min_requests(self) -> int:
        return GateThresholds.from_dict(self.gate_thresholds).min_requests


class RolloutTransition(models.Model):
    """One recorded change of a rollout: who or what made it, why, and on which figures."""

    CONTROLLER = "controller"

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="transitions")
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    from_weight = models.PositiveSmallIntegerField(null=True, blank=True)
    to_weight = models.PositiveSmallIntegerField()
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    # "controller" or the staff user's username, kept even if the user is deleted.
    actor_label = models.CharField(max_length=150)
    reason = models.TextField()
    gate = models.JSONField(default=dict, blank=True, validators=[validate_no_nul])
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["rollout", "created_at", "pk"]

    def __str__(self) -> str:
        return f"{self.rollout_id}: {self.from_state} -> {self.to_state} by {self.actor_label}"


def pools() -> models.QuerySet[Any]:
    """The fleet's GPU pools, the rows a deployment is placed onto (`Deployment.pool`, with
    their GPU class). The registry sits below the fleet: it reaches pools through this
    relation, never by importing serving's models, so the fleet may import the registry."""
    pool_model = Deployment._meta.get_field("pool").related_model
    assert isinstance(pool_model, type) and issubclass(pool_model, models.Model)
    return pool_model._default_manager.select_related("gpu_class")
