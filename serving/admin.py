"""Django admin registrations of the serving app: read-only (config/admin.py). Pools, join
tokens, nodes and replicas change through the API, the console and the node agents, whose
actions reconcile the fleet and publish the routing table."""

from __future__ import annotations

from django.contrib import admin

from config.admin import ReadOnlyAdmin, ReadOnlyInline
from serving.models import (
    Gpu,
    GpuClass,
    GpuPool,
    JoinToken,
    Node,
    Replica,
    ReplicaEvent,
    TelemetrySample,
)


@admin.register(GpuClass)
class GpuClassAdmin(ReadOnlyAdmin):
    list_display = ["name", "memory_gb", "mem_bandwidth_gbs", "bf16_tflops", "default_usd_per_hour"]


@admin.register(GpuPool)
class GpuPoolAdmin(ReadOnlyAdmin):
    list_display = ["name", "gpu_class", "region", "usd_per_gpu_hour", "spot"]
    list_filter = ["region", "gpu_class", "spot"]


@admin.register(JoinToken)
class JoinTokenAdmin(ReadOnlyAdmin):
    list_display = ["pool", "name", "expires_at", "revoked", "created_at"]
    readonly_fields = ["token_hash"]


class GpuInline(ReadOnlyInline):
    model = Gpu
    extra = 0


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = ["hostname", "pool", "health", "scheduling", "last_heartbeat_at"]
    list_filter = ["pool", "health", "scheduling"]
    readonly_fields = ["token_hash", "token_nonce", "last_heartbeat_at"]
    inlines = [GpuInline]


class ReplicaEventInline(ReadOnlyInline):
    model = ReplicaEvent
    extra = 0
    readonly_fields = ["kind", "message", "at", "source"]


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    list_display = ["pk", "deployment", "node", "gpu_indices", "port", "state", "restarts"]
    list_filter = ["state", "node__pool"]
    inlines = [ReplicaEventInline]


@admin.register(TelemetrySample)
class TelemetrySampleAdmin(ReadOnlyAdmin):
    list_display = ["replica", "at", "running", "waiting", "kv_cache_usage"]
