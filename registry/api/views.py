"""Viewsets of the registry API. Everyone signed in reads what is visible to them (404
otherwise); staff write. Every write is one call into registry.actions."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import PlatformModelViewSet, ReadAnyWriteStaff
from registry import actions
from registry.api.serializers import (
    AdapterSerializer,
    DeploymentSerializer,
    ModelSerializer,
    ModelVersionSerializer,
    ReasonSerializer,
    RolloutSerializer,
)
from registry.models import Adapter, Deployment, Model, ModelVersion, Rollout


def _changes(serializer: Any) -> dict[str, Any]:
    return dict(serializer.validated_data)


class RegistryViewSet(PlatformModelViewSet):
    permission_classes = [ReadAnyWriteStaff]


class ModelViewSet(RegistryViewSet):
    serializer_class = ModelSerializer

    def get_queryset(self) -> Any:
        models = actions.visible_models_for_user(self.request.user)
        name = self.request.query_params.get("name")
        return models.filter(name=name) if name else models.order_by("name")

    def get_object(self) -> Model:
        return actions.access_model(self.request.user, self.kwargs["pk"])

    def perform_create(self, serializer: Any) -> None:
        data = _changes(serializer)
        grants = data.pop("granted_tenants", None)
        serializer.instance = actions.do_create_model(
            granted_tenant_ids=[t.pk for t in grants] if grants is not None else None, **data
        )

    def perform_update(self, serializer: Any) -> None:
        data = _changes(serializer)
        grants = data.pop("granted_tenants", None)
        actions.do_update_model(
            serializer.instance,
            granted_tenant_ids=[t.pk for t in grants] if grants is not None else None,
            **data,
        )

    def perform_destroy(self, instance: Model) -> None:
        actions.do_delete_model(instance)


class ModelVersionViewSet(RegistryViewSet):
    serializer_class = ModelVersionSerializer

    def get_queryset(self) -> Any:
        versions = actions.visible_versions_for_user(self.request.user)
        model = self.request.query_params.get("model")
        if model:
            versions = versions.filter(model__name=model)
        return versions.order_by("model__name", "-created_at")

    def get_object(self) -> ModelVersion:
        return actions.access_version(self.request.user, self.kwargs["pk"])

    def perform_create(self, serializer: Any) -> None:
        data = _changes(serializer)
        serializer.instance = actions.do_create_version(data.pop("model"), **data)

    def perform_update(self, serializer: Any) -> None:
        data = _changes(serializer)
        if "model" in data and data.pop("model") != serializer.instance.model:
            raise ValidationError({"model": ["A version cannot move to another model."]})
        actions.do_update_version(serializer.instance, **data)

    def perform_destroy(self, instance: ModelVersion) -> None:
        actions.do_change_version_status(
            instance, ModelVersion.Status.RETIRED, actor=self.request.user
        )

    def _status(self, request: Request, status: str) -> Response:
        version = actions.do_change_version_status(self.get_object(), status, actor=request.user)
        return Response(self.get_serializer(version).data)

    @extend_schema(request=None, responses=ModelVersionSerializer)
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str) -> Response:
        return self._status(request, ModelVersion.Status.APPROVED)

    @extend_schema(request=None, responses=ModelVersionSerializer)
    @action(detail=True, methods=["post"])
    def deprecate(self, request: Request, pk: str) -> Response:
        return self._status(request, ModelVersion.Status.DEPRECATED)

    @extend_schema(request=None, responses=ModelVersionSerializer)
    @action(detail=True, methods=["post"])
    def retire(self, request: Request, pk: str) -> Response:
        return self._status(request, ModelVersion.Status.RETIRED)


class AdapterViewSet(RegistryViewSet):
    serializer_class = AdapterSerializer

    def get_queryset(self) -> Any:
        return actions.visible_adapters_for_user(self.request.user).order_by("name")

    def get_object(self) -> Adapter:
        return actions.access_adapter(self.request.user, self.kwargs["pk"])

    def perform_create(self, serializer: Any) -> None:
        data = _changes(serializer)
        grants = data.pop("granted_tenants", None)
        serializer.instance = actions.do_create_adapter(
            granted_tenant_ids=[t.pk for t in grants] if grants is not None else None, **data
        )

    def perform_update(self, serializer: Any) -> None:
        data = _changes(serializer)
        grants = data.pop("granted_tenants", None)
        actions.do_update_adapter(
            serializer.instance,
            granted_tenant_ids=[t.pk for t in grants] if grants is not None else None,
            **data,
        )

    def perform_destroy(self, instance: Adapter) -> None:
        actions.do_delete_adapter(instance)


class DeploymentViewSet(RegistryViewSet):
    """Placement is checked on create and on any change of version, pool, TP or engine
    arguments; a refused fit is a 400 whose `placement` message names what would fit. A
    deployment that fits but has no room on the fleet now is created pending capacity."""

    serializer_class = DeploymentSerializer

    def get_queryset(self) -> Any:
        deployments = actions.visible_deployments_for_user(self.request.user)
        model = self.request.query_params.get("model")
        if model:
            deployments = deployments.filter(model_version__model__name=model)
        return actions.with_ready_replicas(deployments).order_by("name")

    def get_object(self) -> Deployment:
        return actions.access_deployment(self.request.user, self.kwargs["pk"])

    def perform_create(self, serializer: Any) -> None:
        serializer.instance = actions.do_create_deployment(**_changes(serializer))

    def perform_update(self, serializer: Any) -> None:
        serializer.instance = actions.do_update_deployment(
            serializer.instance, **_changes(serializer)
        )

    def perform_destroy(self, instance: Deployment) -> None:
        actions.do_delete_deployment(instance)

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def retire(self, request: Request, pk: str) -> Response:
        """Out of the routing table, replicas drained, then stopped; refused (400) while a
        live rollout has it as baseline or canary. The console's Remove."""
        deployment = actions.do_retire_deployment(self.get_object())
        return Response(self.get_serializer(deployment).data)


class RolloutViewSet(RegistryViewSet):
    """Staff only: tenants get an empty list and 404s. Create starts a rollout of
    `target_version` from the `baseline` deployment; the actions move it by hand."""

    serializer_class = RolloutSerializer
    http_method_names = ["get", "post", "head", "options"]

    def get_queryset(self) -> Any:
        return actions.rollouts_for_user(self.request.user).prefetch_related("transitions")

    def get_object(self) -> Rollout:
        return actions.access_rollout(self.request.user, self.kwargs["pk"])

    def perform_create(self, serializer: Any) -> None:
        data = _changes(serializer)
        serializer.instance = actions.do_start_rollout(
            data["baseline"],
            data["target_version"],
            actor=self.request.user,
            steps=data["steps"],
            step_min_duration_s=data.get("step_min_duration_s", 300),
            step_min_requests=data.get("step_min_requests", 200),
            gate_thresholds=data.get("gate_thresholds") or {},
            cohort_by_tenant=data.get("cohort_by_tenant", False),
        )

    def _answer(self, rollout: Rollout) -> Response:
        return Response(
            self.get_serializer(actions.access_rollout(self.request.user, rollout.pk)).data
        )

    def _reason(self, request: Request) -> str:
        parsed = ReasonSerializer(data=request.data)
        parsed.is_valid(raise_exception=True)
        return str(parsed.validated_data.get("reason", ""))

    @extend_schema(request=ReasonSerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str) -> Response:
        rollout = self.get_object()
        return self._answer(
            actions.do_pause_rollout(rollout, actor=request.user, reason=self._reason(request))
        )

    @extend_schema(request=ReasonSerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str) -> Response:
        rollout = self.get_object()
        return self._answer(
            actions.do_resume_rollout(rollout, actor=request.user, reason=self._reason(request))
        )

    @extend_schema(request=ReasonSerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def abort(self, request: Request, pk: str) -> Response:
        rollout = self.get_object()
        return self._answer(
            actions.do_abort_rollout(rollout, actor=request.user, reason=self._reason(request))
        )

    @extend_schema(request=ReasonSerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, pk: str) -> Response:
        rollout = self.get_object()
        reason = self._reason(request) or f"promoted now by {request.user.get_username()}"
        return self._answer(actions.do_promote_rollout(rollout, actor=request.user, reason=reason))

    @extend_schema(request=ReasonSerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, pk: str) -> Response:
        rollout = self.get_object()
        reason = self._reason(request) or f"rolled back by {request.user.get_username()}"
        return self._answer(actions.do_rollback_rollout(rollout, actor=request.user, reason=reason))

    @extend_schema(request=ReasonSerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def advance(self, request: Request, pk: str) -> Response:
        rollout = self.get_object()
        reason = self._reason(request) or f"advanced by {request.user.get_username()}"
        return self._answer(
            actions.do_advance_rollout_step(rollout, actor=request.user, reason=reason)
        )
