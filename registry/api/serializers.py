"""Serializers of the registry API. Writes go through registry.actions; these only parse."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from config.api import FloatField, PlatformModelSerializer, RowIdField
from config.loops import loop_failures
from config.redis import redis_client
from registry.actions import MODEL_FIELDS, with_ready_replicas
from registry.models import (
    Adapter,
    Deployment,
    Model,
    ModelVersion,
    Rollout,
    RolloutTransition,
    Visibility,
    pools,
)
from registry.rollout_policy import DEFAULT_STEPS
from tenants.models import Tenant


class StaffOnlyFieldsMixin:
    """Who else a row is granted to is staff business: tenants never see other tenants' ids;
    nor the control loops' errors on a row."""

    staff_only_fields: tuple[str, ...] = ()

    def to_representation(self, instance: Any) -> dict[str, Any]:
        data: dict[str, Any] = super().to_representation(instance)  # type: ignore[misc]
        request = self.context.get("request")  # type: ignore[attr-defined]
        if request is None or not getattr(request.user, "is_staff", False):
            for name in self.staff_only_fields:
                data.pop(name, None)
        return data


class ModelSerializer(StaffOnlyFieldsMixin, PlatformModelSerializer[Model]):
    staff_only_fields = ("granted_tenants",)
    granted_tenants = RowIdField(many=True, queryset=Tenant.objects.all(), required=False)
    kv_bytes_per_token_bf16 = serializers.IntegerField(read_only=True)

    class Meta:
        model = Model
        fields = ["id", *MODEL_FIELDS, "kv_bytes_per_token_bf16", "granted_tenants", "created_at"]
        read_only_fields = ["id", "created_at"]


class ModelVersionSerializer(PlatformModelSerializer[ModelVersion]):
    model = RowIdField(queryset=Model.objects.all())
    model_name = serializers.CharField(source="model.name", read_only=True)
    weights_gb = FloatField(read_only=True)
    approved_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = ModelVersion
        fields = [
            "id",
            "model",
            "model_name",
            "version",
            "artifact_uri",
            "revision",
            "quantization",
            "weights_gb",
            "status",
            "approved_by",
            "approved_at",
            "created_at",
        ]
        read_only_fields = ["id", "status", "approved_by", "approved_at", "created_at"]


class AdapterSerializer(StaffOnlyFieldsMixin, PlatformModelSerializer[Adapter]):
    staff_only_fields = ("granted_tenants",)
    base_version = RowIdField(queryset=ModelVersion.objects.all())
    base_model = serializers.CharField(source="base_version.model.name", read_only=True)
    owner_tenant = RowIdField(queryset=Tenant.objects.all(), required=False, allow_null=True)
    granted_tenants = RowIdField(many=True, queryset=Tenant.objects.all(), required=False)
    visibility = serializers.ChoiceField(choices=Visibility.choices, required=False)

    class Meta:
        model = Adapter
        fields = [
            "id",
            "name",
            "base_version",
            "base_model",
            "rank",
            "artifact_uri",
            "owner_tenant",
            "visibility",
            "granted_tenants",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]


class LoopFailureSerializer(serializers.Serializer[Any]):
    loop = serializers.CharField(help_text="reconcile, routing_table, autoscale or rollout_tick")
    error = serializers.CharField(help_text="the exception, as its last pass raised it")
    since = serializers.DateTimeField(help_text="when the loop first failed on this row")


@extend_schema_field(LoopFailureSerializer(many=True))
class LoopFailuresField(serializers.Field):
    """The fleet loops that fail on this row now, each passing over it and going on with the
    others (config.loops); empty while they succeed. One Redis read per response."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        super().__init__(source="*", read_only=True, **kwargs)
        self.kind = kind

    def to_representation(self, value: Any) -> list[dict[str, Any]]:
        cached = self.context  # the root serializer's, shared by every row of a list
        request = cached.get("request")
        if request is None or not getattr(request.user, "is_staff", False):
            return []  # staff_only_fields drops it: an exception's text is staff business
        key = f"loop_failures:{self.kind}"
        if key not in cached:
            cached[key] = loop_failures(redis_client(), self.kind)
        return [
            {
                "loop": failure.loop,
                "error": failure.error,
                "since": failure.since_at.isoformat(),
            }
            for failure in cached[key].get(value.pk, [])
        ]


class DeploymentSerializer(StaffOnlyFieldsMixin, PlatformModelSerializer[Deployment]):
    staff_only_fields = ("loop_failures",)
    name = serializers.SlugField(max_length=128, required=False)
    model = serializers.CharField(source="served_model_name", read_only=True)
    model_version = RowIdField(queryset=ModelVersion.objects.all())
    pool = serializers.SlugRelatedField(slug_field="name", queryset=pools())
    gpu_class = serializers.CharField(source="pool.gpu_class.name", read_only=True)
    decode_pool = serializers.SlugRelatedField(
        slug_field="name", queryset=pools(), required=False, allow_null=True
    )
    effective_engine_args = serializers.DictField(read_only=True)
    # Replicas in state ready over replicas_desired (decode: over decode_replicas_desired;
    # null for a colocated deployment). Pending capacity: no room on the fleet for a replica
    # now, why (`placement_failure`) and since when.
    ready_replicas = serializers.SerializerMethodField()
    decode_ready_replicas = serializers.SerializerMethodField()
    pending_capacity = serializers.BooleanField(read_only=True)
    placement_failure = serializers.CharField(read_only=True)
    placement_failure_since = serializers.DateTimeField(read_only=True)
    loop_failures = LoopFailuresField("deployment")

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "model",
            "model_version",
            "pool",
            "gpu_class",
            "tensor_parallel",
            "replicas_min",
            "replicas_max",
            "replicas_desired",
            "decode_pool",
            "decode_replicas_min",
            "decode_replicas_max",
            "decode_replicas_desired",
            "ready_replicas",
            "decode_ready_replicas",
            "pending_capacity",
            "placement_failure",
            "placement_failure_since",
            "loop_failures",
            "kv_connector",
            "engine_args",
            "effective_engine_args",
            "slo_tier",
            "status",
            "traffic_weight",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "created_at", "updated_at"]
        # Uniqueness and constraints are checked by the action, with placement.
        validators: list[Any] = []

    def get_ready_replicas(self, deployment: Deployment) -> int:
        return _ready(deployment, "ready_replicas")

    def get_decode_ready_replicas(self, deployment: Deployment) -> int | None:
        if not deployment.disaggregated:
            return None
        return _ready(deployment, "decode_ready_replicas")


def _ready(deployment: Deployment, name: str) -> int:
    """The count `with_ready_replicas` annotated on a listed row; counted now for a row an
    action just wrote."""
    if not hasattr(deployment, name):
        deployment = with_ready_replicas(Deployment.objects.filter(pk=deployment.pk)).get()
    return int(getattr(deployment, name))


class RolloutTransitionSerializer(PlatformModelSerializer[RolloutTransition]):
    class Meta:
        model = RolloutTransition
        fields = [
            "id",
            "from_state",
            "to_state",
            "from_weight",
            "to_weight",
            "actor_label",
            "reason",
            "gate",
            "created_at",
        ]
        read_only_fields = fields


class RolloutSerializer(StaffOnlyFieldsMixin, PlatformModelSerializer[Rollout]):
    staff_only_fields = ("loop_failures",)
    model = serializers.CharField(source="model.name", read_only=True)
    baseline = RowIdField(queryset=Deployment.objects.all())
    target_version = RowIdField(queryset=ModelVersion.objects.all(), write_only=True)
    steps = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=100),
        default=lambda: list(DEFAULT_STEPS),
    )
    # An object of numbers by gate name (the action refuses unknown names).
    gate_thresholds = serializers.DictField(child=FloatField(), required=False)
    # What the canary takes now: 0 while it is held (no ready replica), whatever the step.
    canary_weight = serializers.IntegerField(source="canary.traffic_weight", read_only=True)
    step_weight = serializers.IntegerField(source="canary_weight", read_only=True)
    canary_held = serializers.BooleanField(read_only=True)
    gate_min_requests = serializers.IntegerField(read_only=True)
    transitions = RolloutTransitionSerializer(many=True, read_only=True)
    loop_failures = LoopFailuresField("rollout")

    class Meta:
        model = Rollout
        fields = [
            "id",
            "model",
            "baseline",
            "target_version",
            "canary",
            "steps",
            "step_index",
            "canary_weight",
            "step_weight",
            "canary_held",
            "canary_state",
            "canary_reason",
            "canary_since",
            "step_started_at",
            "step_min_duration_s",
            "step_min_requests",
            "gate_thresholds",
            "gate_min_requests",
            "cohort_by_tenant",
            "state",
            "last_decision",
            "last_tick_at",
            "created_at",
            "finished_at",
            "transitions",
            "loop_failures",
        ]
        read_only_fields = [
            "id",
            "canary",
            "step_index",
            "step_started_at",
            "canary_state",
            "canary_reason",
            "canary_since",
            "state",
            "last_decision",
            "last_tick_at",
            "created_at",
            "finished_at",
        ]


class ReasonSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=2000)
