"""Serializers of the fleet's staff API."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from config.api import FloatField, PlatformModelSerializer
from serving.capacity.planner import PoolOption, default_pools
from serving.engine.specs import QUANTIZATIONS, load_gpu_specs, load_model_specs
from serving.models import Gpu, GpuClass, GpuPool, JoinToken, Node, Replica, ReplicaEvent


class GpuPoolSerializer(PlatformModelSerializer):
    gpu_class = serializers.SlugRelatedField(slug_field="name", queryset=GpuClass.objects.all())
    price_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4, read_only=True)

    class Meta:
        model = GpuPool
        fields = [
            "id",
            "name",
            "gpu_class",
            "region",
            "usd_per_gpu_hour",
            "price_per_gpu_hour",
            "spot",
            "labels",
            "created_at",
        ]


class GpuSerializer(PlatformModelSerializer):
    class Meta:
        model = Gpu
        fields = ["id", "node", "index", "uuid", "name", "memory_mb"]


class NodeSerializer(PlatformModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    status = serializers.CharField(read_only=True)
    gpus = GpuSerializer(many=True, read_only=True)
    drain_deadline_at = serializers.DateTimeField(read_only=True, allow_null=True)
    drain_overdue = serializers.BooleanField(read_only=True)

    class Meta:
        model = Node
        fields = [
            "id",
            "pool",
            "hostname",
            "agent_url",
            "status",
            "health",
            "scheduling",
            "last_heartbeat_at",
            "registered_at",
            "drain_started_at",
            "drain_deadline_at",
            "drain_overdue",
            "drain_finished_at",
            "gpus",
        ]
        read_only_fields = fields


class DrainSerializer(serializers.Serializer):
    deadline_s = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=7 * 24 * 3600,
        help_text="This drain's deadline in seconds; default the NODE_DRAIN_DEADLINE_S setting.",
    )


class ReplicaSerializer(PlatformModelSerializer):
    node = serializers.SlugRelatedField(slug_field="hostname", read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id",
            "deployment",
            "node",
            "gpu_indices",
            "port",
            "state",
            "last_error",
            "restarts",
            "pid",
            "created_at",
            "started_at",
            "ready_at",
            "draining_since",
            "stopped_at",
            "drain_blocked_reason",
            "drain_unblock",
            "drain_blocked_since",
        ]
        read_only_fields = fields


class ReplicaEventSerializer(PlatformModelSerializer):
    class Meta:
        model = ReplicaEvent
        fields = ["id", "replica", "kind", "message", "at", "source"]
        read_only_fields = fields


class JoinTokenSerializer(PlatformModelSerializer):
    """A join token as listed: never its secret, which only the answer to its creation holds."""

    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = JoinToken
        fields = ["id", "pool", "name", "expires_at", "single_use", "used_at", "revoked"]
        fields += ["created_at"]
        read_only_fields = fields


class JoinTokenCreateSerializer(serializers.Serializer):
    pool = serializers.SlugRelatedField(slug_field="name", queryset=GpuPool.objects.all())
    name = serializers.CharField(max_length=64, required=False, default="", allow_blank=True)
    # An hour to thirty days: a token through the API always expires.
    ttl_hours = FloatField(min_value=1, max_value=720, default=24)
    single_use = serializers.BooleanField(default=False)


class MintedJoinTokenSerializer(JoinTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret, shown this once.")

    class Meta(JoinTokenSerializer.Meta):
        fields = [*JoinTokenSerializer.Meta.fields, "token"]
        read_only_fields = fields


class PoolOptionSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64)
    gpu_class = serializers.ChoiceField(choices=[])
    usd_per_gpu_hour = FloatField(min_value=0, required=False, allow_null=True)
    available_gpus = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    tensor_parallel = serializers.ChoiceField(choices=[1, 2, 4, 8], default=1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["gpu_class"].choices = sorted(load_gpu_specs())


class PlanRequestSerializer(serializers.Serializer):
    users = serializers.IntegerField(min_value=1, max_value=1_000_000_000)
    requests_per_user_s = FloatField(min_value=0.000001, max_value=1000)
    prompt_tokens = serializers.IntegerField(min_value=1, max_value=1_000_000)
    output_tokens = serializers.IntegerField(min_value=1, max_value=1_000_000)
    ttft_slo_s = FloatField(min_value=0.001, required=False, allow_null=True, default=1.0)
    tpot_slo_s = FloatField(min_value=0.001, required=False, allow_null=True, default=0.05)
    model = serializers.ChoiceField(choices=[], default="llama-3.1-8b")
    quantization = serializers.ChoiceField(choices=list(QUANTIZATIONS), default="bf16")
    # The textbook estimate alongside, when a measured per-GPU throughput is given.
    tokens_per_s_per_gpu = FloatField(min_value=0.001, required=False)
    pools = PoolOptionSerializer(many=True, required=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = sorted(load_model_specs())

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Without `pools`, the fleet's own pools at their prices (the GPU classes at
        reference prices when no pool exists yet)."""
        if attrs.get("pools"):
            attrs["pools"] = [PoolOption(**pool) for pool in attrs["pools"]]
        else:
            rows = GpuPool.objects.select_related("gpu_class").order_by("name")
            pools = [
                PoolOption(r.name, r.gpu_class.name, float(r.price_per_gpu_hour)) for r in rows
            ]
            attrs["pools"] = pools or default_pools()
        return attrs
