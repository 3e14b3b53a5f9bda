"""Django admin registrations of the registry app: read-only (config/admin.py). Models,
versions, adapters, deployments and rollouts change through the console and the API, whose
actions check placement and publish visibility and the routing table."""

from __future__ import annotations

from django.contrib import admin

from config.admin import ReadOnlyAdmin, ReadOnlyInline
from registry.models import Adapter, Deployment, Model, ModelVersion, Rollout, RolloutTransition


class VersionInline(ReadOnlyInline):
    model = ModelVersion
    extra = 0
    fields = ["version", "quantization", "status", "artifact_uri", "approved_by", "approved_at"]
    readonly_fields = ["status", "approved_by", "approved_at"]


@admin.register(Model)
class ModelAdmin(ReadOnlyAdmin):
    list_display = ["name", "family", "params_b", "max_context", "visibility"]
    list_filter = ["visibility", "family"]
    search_fields = ["name", "family"]
    filter_horizontal = ["granted_tenants"]
    inlines = [VersionInline]


@admin.register(ModelVersion)
class ModelVersionAdmin(ReadOnlyAdmin):
    list_display = ["model", "version", "quantization", "status", "approved_by", "created_at"]
    list_filter = ["status", "quantization"]
    readonly_fields = ["status", "approved_by", "approved_at"]


@admin.register(Adapter)
class AdapterAdmin(ReadOnlyAdmin):
    list_display = ["name", "base_version", "rank", "owner_tenant", "visibility"]
    list_filter = ["visibility"]
    filter_horizontal = ["granted_tenants"]


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "model_version",
        "pool",
        "tensor_parallel",
        "replicas_desired",
        "traffic_weight",
        "status",
    ]
    list_filter = ["status", "slo_tier", "pool"]
    readonly_fields = ["traffic_weight"]


# Shown and read-only alike. A tuple, so the one sequence fits the types of both `fields` (which
# may also hold groups of names) and `readonly_fields` (names only).
_TRANSITION_FIELDS = (
    "created_at",
    "from_state",
    "to_state",
    "from_weight",
    "to_weight",
    "actor_label",
    "reason",
)


class TransitionInline(ReadOnlyInline):
    model = RolloutTransition
    extra = 0
    can_delete = False
    fields = _TRANSITION_FIELDS
    readonly_fields = _TRANSITION_FIELDS


@admin.register(Rollout)
class RolloutAdmin(ReadOnlyAdmin):
    list_display = ["pk", "model", "baseline", "canary", "state", "step_index", "created_at"]
    list_filter = ["state"]
    readonly_fields = [
        "state",
        "step_index",
        "step_started_at",
        "baseline_mark",
        "canary_mark",
        "last_decision",
        "last_tick_at",
        "finished_at",
    ]
    inlines = [TransitionInline]
