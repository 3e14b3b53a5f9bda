"""Staff API tokens: how automation calls /api as a member of the platform staff.

A token `pst_<prefix>_<secret>` (hex, as API keys are; `tenants.keys.generate_raw_key` makes
both) authenticates as the staff user who created it, on /api only: the gateway's key check
refuses anything not shaped `sk-…-…`, so a token never reaches /v1. Only the SHA-256 of the
token is stored; the secret is shown once, to its creator. A token works while its user is
active and staff, until `expires_at` (always set, at most `MAX_LIFETIME` ahead) or its
revocation, whichever comes first.

Scopes: `read` allows the safe methods (GET, HEAD, OPTIONS) only; `write` every method the
user may use. Write includes read, so a token has one scope, not a set of them.

Imported by `tenants.models` so that Django finds the model; imports no other tenants module.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import models

from tenants.keys import key_shape

STAFF_TOKEN_SCHEME = "pst"
# `_`, not `-`: a double click selects the whole token, and secret scanners match `pst_`.
STAFF_TOKEN_SEPARATOR = "_"
STAFF_TOKEN_SHAPE = key_shape(STAFF_TOKEN_SCHEME, STAFF_TOKEN_SEPARATOR)
# A staff token reaches every tenant, so a leaked one must stop working on its own: 90 days
# is a quarterly rotation, long enough that a pipeline is not re-keyed every week.
MAX_LIFETIME = timedelta(days=90)
# `last_used_at` is written at most this often per token: one UPDATE a minute, not a request.
LAST_USED_PRECISION = timedelta(minutes=1)


class StaffTokenScope(models.TextChoices):
    READ = "read", "read (GET only)"
    WRITE = "write", "write (everything staff may do)"


class StaffToken(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="staff_tokens"
    )
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the token.")
    scope = models.CharField(max_length=8, choices=StaffTokenScope.choices)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.display})"

    @property
    def display(self) -> str:
        """What lists show: the scheme and prefix, never the secret."""
        sep = STAFF_TOKEN_SEPARATOR
        return f"{STAFF_TOKEN_SCHEME}{sep}{self.prefix}{sep}…"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None
