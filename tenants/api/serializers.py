"""Serializers of the tenants API. No serializer ever carries a key's secret or hash,
except `ApiKeyCreatedSerializer`, answered once, to the creation request."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from config.api import BoundedDateTimeField, PlatformModelSerializer
from serving.gateway.guardrails import PatternError, check_blocked_patterns
from tenants.actions import MODEL_NAME_MAX_LENGTH, QUOTA_FIELDS
from tenants.models import ApiKey, KeyQuotaOverride, Membership, Quota, Role, Scope, Tenant


class TenantSerializer(PlatformModelSerializer[Tenant]):
    allowed_regions = serializers.ListField(
        child=serializers.CharField(max_length=64), required=False, max_length=100
    )
    blocked_patterns = serializers.ListField(
        child=serializers.CharField(max_length=500), required=False, max_length=100
    )

    class Meta:
        model = Tenant
        fields = [
            "id",
            "slug",
            "name",
            "status",
            "allowed_regions",
            "fail_open",
            "blocked_patterns",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]

    def validate_slug(self, slug: str) -> str:
        # A slug is in URLs, key records and invoices: it is chosen once. A PUT may repeat it.
        if self.instance is not None and slug != self.instance.slug:
            raise serializers.ValidationError("A tenant's slug cannot change.")
        return slug

    def validate_blocked_patterns(self, patterns: list[str]) -> list[str]:
        # The gateway runs them on RE2, so they are checked against RE2, not Python's `re`.
        try:
            check_blocked_patterns(patterns)
        except PatternError as error:
            raise serializers.ValidationError(str(error)) from None
        return patterns


class MembershipSerializer(PlatformModelSerializer[Membership]):
    username = serializers.CharField(source="user.username", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "username", "role", "created_at"]
        read_only_fields = ["id", "created_at"]


class MembershipCreateSerializer(serializers.Serializer[Membership]):
    """Who to add, by username, and as what: both required. The username is looked up by the
    view (see MembershipViewSet.create), so that no answer tells which usernames exist."""

    username = serializers.CharField(max_length=150)
    role = serializers.ChoiceField(choices=Role.choices)


class MembershipRoleSerializer(serializers.Serializer[Membership]):
    role = serializers.ChoiceField(choices=Role.choices)


class ApiKeySerializer(PlatformModelSerializer[ApiKey]):
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices))
    model_allowlist = serializers.ListField(
        child=serializers.CharField(max_length=MODEL_NAME_MAX_LENGTH),
        required=False,
        max_length=100,
    )
    expires_at = BoundedDateTimeField(required=False, allow_null=True)
    display = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "display",
            "scopes",
            "model_allowlist",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "created_by",
            "created_at",
        ]
        read_only_fields = ["id", "prefix", "revoked_at", "last_used_at", "created_at"]

    def get_display(self, key: ApiKey) -> str:
        return f"sk-{key.prefix}-…"


class ApiKeyCreatedSerializer(ApiKeySerializer):
    secret = serializers.SerializerMethodField()

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "secret"]

    def get_secret(self, key: ApiKey) -> str:
        return str(self.context["secret"])


class QuotaSerializer(PlatformModelSerializer[Quota]):
    # Checked against the gateway's tiers by `do_update_quota` (`check_tiers`).
    allowed_tiers = serializers.ListField(
        child=serializers.CharField(max_length=32), required=False, max_length=10
    )

    class Meta:
        model = Quota
        fields = list(QUOTA_FIELDS)


class KeyQuotaOverrideSerializer(PlatformModelSerializer[KeyQuotaOverride]):
    class Meta:
        model = KeyQuotaOverride
        fields = [
            "requests_per_minute",
            "tokens_per_minute",
            "concurrent_streams",
            "max_tokens_cap",
            "max_context_tokens",
        ]


def changes_of(serializer: serializers.Serializer[Any]) -> dict[str, Any]:
    return dict(serializer.validated_data)
