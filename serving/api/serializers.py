"""Serializers of the fleet's staff API."""

from __future__ import annotations

from rest_framework import serializers

from serving.models import Gpu, GpuClass, GpuPool, Node, Replica, ReplicaEvent


class GpuPoolSerializer(serializers.ModelSerializer):
    gpu_class = serializers.SlugRelatedField(slug_field="name", queryset=GpuClass.objects.all())
    price_per_gpu_hour = serializers.DecimalField(max_digits=10, decimal_places=4, read_only=True)

    class Meta:
        model = GpuPool
        fields = [
            "id", "name", "gpu_class", "region", "usd_per_gpu_hour", "price_per_gpu_hour",
            "spot", "labels", "created_at",
        ]  # fmt: skip


class GpuSerializer(serializers.ModelSerializer):
    class Meta:
        model = Gpu
        fields = ["id", "node", "index", "uuid", "name", "memory_mb"]


class NodeSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    status = serializers.CharField(read_only=True)
    gpus = GpuSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = [
            "id", "pool", "hostname", "agent_url", "status", "health", "scheduling",
            "last_heartbeat_at", "registered_at", "gpus",
        ]  # fmt: skip
        read_only_fields = fields


class ReplicaSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="hostname", read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id", "deployment", "node", "gpu_indices", "port", "state", "last_error", "restarts",
            "pid", "created_at", "started_at", "ready_at", "draining_since", "stopped_at",
        ]  # fmt: skip
        read_only_fields = fields


class ReplicaEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = ReplicaEvent
        fields = ["id", "replica", "kind", "message", "at", "source"]
        read_only_fields = fields
