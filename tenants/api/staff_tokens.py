"""Staff tokens over REST (/api/v1/staff-tokens/): a staff member lists, creates and revokes
their own. The secret is in the creation's answer only; lists show the prefix.

A token cannot create tokens: one that leaked could otherwise mint successors that outlive
its own expiry and revocation. Creating takes a signed-in session (the console or /api with
its CSRF token); listing and revoking work with a token too.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import BoundedDateTimeField, PlatformModelSerializer, PlatformViewSet
from tenants import staff_token_actions as actions
from tenants.staff_tokens import StaffToken


class StaffTokenSerializer(PlatformModelSerializer[StaffToken]):
    display = serializers.CharField(read_only=True)
    expires_at = BoundedDateTimeField()

    class Meta:
        model = StaffToken
        fields = [
            "id",
            "name",
            "prefix",
            "display",
            "scope",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "created_at",
        ]
        read_only_fields = ["id", "prefix", "revoked_at", "last_used_at", "created_at"]


class StaffTokenCreatedSerializer(StaffTokenSerializer):
    secret = serializers.SerializerMethodField()

    class Meta(StaffTokenSerializer.Meta):
        fields = [*StaffTokenSerializer.Meta.fields, "secret"]

    def get_secret(self, token: StaffToken) -> str:
        return str(self.context["secret"])


class StaffTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, PlatformViewSet):
    permission_classes = [IsAdminUser]
    serializer_class = StaffTokenSerializer
    queryset = StaffToken.objects.none()  # for the schema; get_queryset keeps the caller's own

    def get_queryset(self) -> Any:
        return actions.staff_tokens_for_user(self.request.user)

    def get_object(self) -> StaffToken:
        return actions.access_staff_token(self.request.user, self.kwargs["pk"])

    @extend_schema(responses={201: StaffTokenCreatedSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        if isinstance(request.auth, StaffToken):
            raise PermissionDenied("Create staff tokens from a signed-in session, not a token.")
        serializer = StaffTokenSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        token, secret = actions.do_create_staff_token(
            request.user, data["name"], data["scope"], data["expires_at"]
        )
        body = StaffTokenCreatedSerializer(token, context={"secret": secret}).data
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Tokens are kept (what was done with one stays traceable): DELETE revokes."""
        self.revoke(request, *args, **kwargs)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        token = actions.do_revoke_staff_token(self.get_object(), request.user)
        return Response(StaffTokenSerializer(token).data)
