"""Viewsets of the tenants API. Every tenant-scoped route resolves its tenant first through
`access_tenant_for_user`, whatever the method, so another tenant's caller gets 404 before
anything else; then the role decides (403 for a member without it).

Roles: viewers read; developers create keys and change or revoke the keys they created;
admins and owners manage members (added by username: an unknown, inactive or already-added
username gets one and the same 400, so the answer tells an admin no more than the member
list does; only a username that can be added, and is, shows it exists) and every key, and set per-key limits (which only tighten
the tenant's quota); only owners grant or take away the owner role; the tenant's quota is
read by any member and changed by staff only.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import PlatformModelViewSet, PlatformViewSet
from tenants import actions
from tenants.api.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeySerializer,
    KeyQuotaOverrideSerializer,
    MembershipCreateSerializer,
    MembershipRoleSerializer,
    MembershipSerializer,
    QuotaSerializer,
    TenantSerializer,
    changes_of,
)
from tenants.models import ApiKey, Membership, Quota, Role, Tenant

NOT_ADDABLE = "No user with this username can be added to this tenant."


class TenantViewSet(PlatformModelViewSet):
    """Tenants: members see theirs; staff see, create, change and delete all."""

    serializer_class = TenantSerializer
    lookup_field = "slug"

    def get_queryset(self) -> Any:
        return actions.tenants_for_user(self.request.user).order_by("slug")

    def get_object(self) -> Tenant:
        return actions.access_tenant_for_user(self.request.user, self.kwargs["slug"])

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # Refused before the body is validated, so a member cannot learn from "already
        # exists" which slugs are taken. (Another tenant's object stays a 404: see get_object.)
        actions.require_staff(request.user)
        return super().create(request, *args, **kwargs)

    def perform_create(self, serializer: Any) -> None:
        actions.require_staff(self.request.user)
        data = serializer.validated_data
        serializer.instance = actions.do_create_tenant(
            data["slug"],
            data["name"],
            allowed_regions=data.get("allowed_regions", []),
            fail_open=data.get("fail_open", False),
            # Every field the answer shows is taken, none dropped in silence.
            blocked_patterns=data.get("blocked_patterns", []),
            status=data.get("status", Tenant.Status.ACTIVE),
        )

    def perform_update(self, serializer: Any) -> None:
        actions.require_staff(self.request.user)
        changes = changes_of(serializer)
        changes.pop("slug", None)  # the serializer let it through only unchanged
        actions.do_update_tenant(serializer.instance, **changes)

    def perform_destroy(self, instance: Tenant) -> None:
        actions.require_staff(self.request.user)
        actions.do_delete_tenant(instance)


class TenantScopedViewSet(PlatformViewSet):
    """Resolves `self.tenant` from the URL for every method, before any handler runs."""

    tenant: Tenant

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        self.tenant = actions.access_tenant_for_user(request.user, kwargs["tenant_slug"])

    def require(self, role: str) -> None:
        actions.require_role(self.request.user, self.tenant, role)


class MembershipViewSet(
    TenantScopedViewSet,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
):
    serializer_class = MembershipSerializer
    queryset = Membership.objects.none()  # for the schema; get_queryset scopes to the tenant

    def get_queryset(self) -> Any:
        return Membership.objects.filter(tenant=self.tenant).select_related("user")

    def get_object(self) -> Membership:
        return actions.access_membership(self.request.user, self.tenant, self.kwargs["pk"])

    @extend_schema(request=MembershipCreateSerializer, responses={201: MembershipSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require(Role.ADMIN)
        serializer = MembershipCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        role = serializer.validated_data["role"]
        # Who may grant the role is checked before the username is looked up: otherwise a
        # 403 for a known user and a 400 for an unknown one would tell them apart.
        if role == Role.OWNER:
            self.require(Role.OWNER)
        user = (
            get_user_model()
            .objects.filter(username=serializer.validated_data["username"], is_active=True)
            .exclude(tenant_memberships__tenant=self.tenant)
            .first()
        )
        if user is None:
            raise ValidationError({"username": [NOT_ADDABLE]})
        membership = actions.do_add_member(self.tenant, user, role, acting_user=request.user)
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)

    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        membership = self.get_object()
        self.require(Role.ADMIN)
        serializer = MembershipRoleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        actions.do_change_member_role(
            membership, serializer.validated_data["role"], acting_user=request.user
        )
        return Response(MembershipSerializer(membership).data)

    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self.update(request, *args, **kwargs)

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        membership = self.get_object()
        self.require(Role.ADMIN)
        actions.do_remove_member(membership, acting_user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ApiKeyViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    serializer_class = ApiKeySerializer
    queryset = ApiKey.objects.none()  # for the schema; get_queryset scopes to the tenant

    def get_queryset(self) -> Any:
        return ApiKey.objects.filter(tenant=self.tenant).select_related("created_by")

    def get_object(self) -> ApiKey:
        return actions.access_api_key(self.request.user, self.tenant, self.kwargs["pk"])

    def require_key_owner_or_admin(self, key: ApiKey) -> None:
        actions.require_key_owner_or_admin(self.request.user, key)

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require(Role.DEVELOPER)
        serializer = ApiKeySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        key, secret = actions.do_create_api_key(
            self.tenant,
            data["name"],
            request.user,
            data["scopes"],
            data.get("model_allowlist", ()),
            data.get("expires_at"),
        )
        body = ApiKeyCreatedSerializer(key, context={"secret": secret}).data
        return Response(body, status=status.HTTP_201_CREATED)

    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = self.get_object()
        self.require_key_owner_or_admin(key)
        serializer = ApiKeySerializer(key, data=request.data, partial=kwargs.get("partial", False))
        serializer.is_valid(raise_exception=True)
        actions.do_update_api_key(key, acting_user=request.user, **changes_of(serializer))
        return Response(ApiKeySerializer(key).data)

    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self.update(request, *args, partial=True, **kwargs)

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Keys are never deleted (usage refers to them): DELETE revokes."""
        self.revoke(request, *args, **kwargs)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = self.get_object()
        self.require_key_owner_or_admin(key)
        actions.do_revoke_api_key(key, request.user)
        return Response(ApiKeySerializer(key).data)

    @action(
        detail=True, methods=["get", "put", "patch"], serializer_class=KeyQuotaOverrideSerializer
    )
    def limits(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        override = actions.access_key_override(request.user, self.tenant, kwargs["pk"])
        if request.method != "GET":
            self.require(Role.ADMIN)
            serializer = KeyQuotaOverrideSerializer(
                override, data=request.data, partial=request.method == "PATCH"
            )
            serializer.is_valid(raise_exception=True)
            actions.do_set_key_override(override, **changes_of(serializer))
        return Response(KeyQuotaOverrideSerializer(override).data)


class QuotaViewSet(TenantScopedViewSet):
    """The tenant's quota: any member reads it, staff change it."""

    serializer_class = QuotaSerializer
    queryset = Quota.objects.none()  # for the schema and OPTIONS; the handlers scope to the tenant

    def get_object(self) -> Quota:
        return actions.access_quota(self.request.user, self.tenant)

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(QuotaSerializer(actions.access_quota(request.user, self.tenant)).data)

    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        quota = actions.access_quota(request.user, self.tenant)
        actions.require_staff(request.user)
        serializer = QuotaSerializer(quota, data=request.data, partial=request.method == "PATCH")
        serializer.is_valid(raise_exception=True)
        with transaction.atomic():
            actions.do_update_quota(quota, **changes_of(serializer))
        return Response(QuotaSerializer(quota).data)
