"""The Django admin's read-only registrations.

The admin is a window on every row, and a place to write only where it writes through the
actions (tenants, quotas and key overrides) or where nothing else writes (discounts, cost
centers and budget webhooks, in metering/admin.py): a model, deployment or pool
changed here would skip the placement check and the publish to the gateways, a usage event
or invoice changed here would bill differently from what was served, and a price sheet would
skip its checks and the price book. Those are written through the console and the REST API.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest


class NoWrites:
    """Permission to look, and to nothing else, whoever asks (superusers too)."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyAdmin(NoWrites, admin.ModelAdmin[Any]):
    """Rows shown and searched, never added, changed or deleted here."""


class ReadOnlyInline(NoWrites, admin.TabularInline[Any, Any]):
    extra = 0
    can_delete = False
