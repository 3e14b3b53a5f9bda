"""The fleet's staff REST API: pools, join tokens (minted, listed, revoked), nodes (with
cordon, uncordon, drain, force-drain, cancel-drain), GPUs, replicas.

Staff only, by session or API key like the rest of /api/v1/ (a key is never staff, so every
key is refused). Pool writes go through serving.actions.pools."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import PlatformModelViewSet, PlatformReadOnlyViewSet, PlatformViewSet
from config.ids import row_id
from serving.actions import credentials, nodes, pools
from serving.api.serializers import (
    DrainSerializer,
    GpuPoolSerializer,
    GpuSerializer,
    JoinTokenCreateSerializer,
    JoinTokenSerializer,
    MintedJoinTokenSerializer,
    NodeSerializer,
    ReplicaEventSerializer,
    ReplicaSerializer,
)
from serving.models import Gpu, GpuPool, JoinToken, Node, Replica


class GpuPoolViewSet(PlatformModelViewSet):
    permission_classes = [IsAdminUser]
    serializer_class = GpuPoolSerializer
    queryset = GpuPool.objects.select_related("gpu_class")

    def perform_create(self, serializer: Any) -> None:
        serializer.instance = pools.do_create_pool(**serializer.validated_data)

    def perform_update(self, serializer: Any) -> None:
        serializer.instance = pools.do_update_pool(serializer.instance, **serializer.validated_data)

    def perform_destroy(self, instance: GpuPool) -> None:
        pools.do_delete_pool(instance)


class JoinTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, PlatformViewSet):
    permission_classes = [IsAdminUser]
    serializer_class = JoinTokenSerializer
    queryset = JoinToken.objects.select_related("pool")

    def get_queryset(self) -> QuerySet[JoinToken]:
        queryset = super().get_queryset()
        pool = self.request.query_params.get("pool")
        return queryset.filter(pool__name=pool) if pool else queryset

    @extend_schema(request=JoinTokenCreateSerializer, responses={201: MintedJoinTokenSerializer})
    def create(self, request: Request) -> Response:
        given = JoinTokenCreateSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        data = given.validated_data
        token, secret = credentials.do_create_join_token(
            data["pool"],
            name=data["name"],
            ttl=timedelta(hours=data["ttl_hours"]),
            single_use=data["single_use"],
        )
        body = {**JoinTokenSerializer(token).data, "token": secret}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=JoinTokenSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        token = credentials.do_revoke_join_token(self.get_object())
        return Response(JoinTokenSerializer(token).data)


class NodeViewSet(PlatformReadOnlyViewSet):
    permission_classes = [IsAdminUser]
    serializer_class = NodeSerializer
    queryset = Node.objects.select_related("pool").prefetch_related("gpus")

    def get_queryset(self) -> QuerySet[Node]:
        queryset = super().get_queryset()
        pool = self.request.query_params.get("pool")
        return queryset.filter(pool__name=pool) if pool else queryset

    def _act(self, change: Callable[[Node], Node]) -> Response:
        try:
            node = change(self.get_object())
        except nodes.NodeActionRefused as refused:
            return Response({"detail": str(refused)}, status=status.HTTP_400_BAD_REQUEST)
        return Response(NodeSerializer(node).data)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str | None = None) -> Response:
        return self._act(nodes.do_cordon_node)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str | None = None) -> Response:
        return self._act(nodes.do_uncordon_node)

    @extend_schema(request=DrainSerializer, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        given = DrainSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        deadline_s = given.validated_data.get("deadline_s")
        return self._act(lambda node: nodes.do_drain_node(node, deadline_s=deadline_s))

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"], url_path="force-drain")
    def force_drain(self, request: Request, pk: str | None = None) -> Response:
        return self._act(nodes.do_force_drain_node)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"], url_path="cancel-drain")
    def cancel_drain(self, request: Request, pk: str | None = None) -> Response:
        return self._act(nodes.do_cancel_drain_node)


class GpuViewSet(PlatformReadOnlyViewSet):
    permission_classes = [IsAdminUser]
    serializer_class = GpuSerializer
    queryset = Gpu.objects.all()


class ReplicaViewSet(PlatformReadOnlyViewSet):
    permission_classes = [IsAdminUser]
    serializer_class = ReplicaSerializer
    queryset = Replica.objects.select_related("node")

    def get_queryset(self) -> QuerySet[Replica]:
        queryset = super().get_queryset()
        params = self.request.query_params
        if params.get("state"):
            queryset = queryset.filter(state=params["state"])
        for name in ("deployment", "node"):
            if params.get(name):
                pk = row_id(params[name])
                if pk is None:  # int() took " 2" as 2, and "abc" was a ValueError, a 500
                    raise ValidationError({name: ["Enter an id: digits only."]})
                queryset = queryset.filter(**{f"{name}_id": pk})
        return queryset

    @extend_schema(responses=ReplicaEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str | None = None) -> Response:
        replica = self.get_object()
        return Response(ReplicaEventSerializer(replica.events.all(), many=True).data)
