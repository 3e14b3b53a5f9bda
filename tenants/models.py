"""Models of the tenants app: tenants, memberships, API keys and quotas.

An API key's secret is never stored: only its SHA-256 hash and a short visible prefix.
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from config.nul import validate_no_nul

# Staff API tokens have their own module; imported here so that Django finds the model.
from tenants.staff_tokens import StaffToken as StaffToken

NOT_ONLY_DIGITS = RegexValidator(
    r"^[0-9]+$",
    inverse_match=True,
    message="A slug needs a letter or a hyphen: digits alone read as a tenant's id.",
)


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active"
        SUSPENDED = "suspended"

    # Not digits alone: the API and the pages take a tenant's id where its slug goes.
    slug = models.SlugField(max_length=64, unique=True, validators=[NOT_ONLY_DIGITS])
    name = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    allowed_regions = models.JSONField(
        default=list,
        blank=True,
        help_text="Regions this tenant's data may be served from; empty = any.",
        validators=[validate_no_nul],
    )
    fail_open = models.BooleanField(
        default=False,
        help_text="Admit requests without rate limits while Redis is unreachable (default: refuse).",
    )
    blocked_patterns = models.JSONField(
        default=list,
        blank=True,
        help_text="Regular expressions; a prompt matching one is refused before any GPU time.",
        validators=[validate_no_nul],
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    OWNER = "owner"
    ADMIN = "admin"
    DEVELOPER = "developer"
    VIEWER = "viewer"


ROLE_RANK = {Role.VIEWER: 0, Role.DEVELOPER: 1, Role.ADMIN: 2, Role.OWNER: 3}


class Membership(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "user__username"]
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="one_membership_per_tenant")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"


class Scope(models.TextChoices):
    INFERENCE = "inference"
    READ_USAGE = "read_usage"
    MANAGE = "manage"


class PriorityTier(models.TextChoices):
    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"


def all_priority_tiers() -> list[str]:
    return [tier.value for tier in PriorityTier]


class ApiKey(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the key.")
    scopes = models.JSONField(default=list, validators=[validate_no_nul])
    model_allowlist = models.JSONField(
        default=list,
        blank=True,
        help_text="Model names this key may call; empty = all visible.",
        validators=[validate_no_nul],
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="created_api_keys",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "-created_at"]

    def __str__(self) -> str:
        return f"{self.name} (sk-{self.prefix}-…)"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class Quota(models.Model):
    """The tenant's limits, shared by all its keys."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    requests_per_minute = models.PositiveIntegerField(default=600)
    tokens_per_minute = models.PositiveIntegerField(default=200_000)
    concurrent_streams = models.PositiveIntegerField(default=20)
    max_tokens_cap = models.PositiveIntegerField(default=4096)
    max_context_tokens = models.PositiveIntegerField(default=32_768)
    monthly_token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Empty = no token budget."
    )
    monthly_spend_budget_usd = models.DecimalField(
        max_digits=12,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0"))],
        help_text="Empty = no spend budget.",
    )
    soft_alert_fraction = models.FloatField(
        default=0.8, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)]
    )
    hard_budget = models.BooleanField(
        default=True, help_text="Refuse requests once a budget is spent (otherwise alert only)."
    )
    allowed_tiers = models.JSONField(
        default=all_priority_tiers, blank=True, validators=[validate_no_nul]
    )

    def __str__(self) -> str:
        return f"quota of {self.tenant}"


class KeyQuotaOverride(models.Model):
    """Tighter limits for one key; merged with the tenant's quota by taking the lower value."""

    api_key = models.OneToOneField(ApiKey, on_delete=models.CASCADE, related_name="quota_override")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    concurrent_streams = models.PositiveIntegerField(null=True, blank=True)
    max_tokens_cap = models.PositiveIntegerField(null=True, blank=True)
    max_context_tokens = models.PositiveIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"override of {self.api_key}"
