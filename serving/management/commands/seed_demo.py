"""Load the demo data, idempotently: running it twice changes nothing the second time.

Each app seeds its own part in `<app>/demo.py` (a `seed(details)` function); what a person
needs to try the platform (logins, an API key) goes into `details` and is written to
var/demo.json, which `make run` prints.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction

SEED_ORDER = ["tenants", "registry", "serving", "metering"]


class Command(BaseCommand):
    help = "Create the demo fleet, models, tenants and users (idempotent)."

    def handle(self, *args: Any, **options: Any) -> None:
        var = settings.PLATFORM_VAR_DIR
        var.mkdir(parents=True, exist_ok=True)
        path = var / "demo.json"
        details: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        details.setdefault("extra", {})
        with transaction.atomic():
            seed_admin(details)
            for app in SEED_ORDER:
                try:
                    module = importlib.import_module(f"{app}.demo")
                except ModuleNotFoundError as error:
                    if error.name != f"{app}.demo":
                        raise
                    continue
                module.seed(details)
        path.write_text(json.dumps(details, indent=2))
        self.stdout.write("Demo data is in place.")


def seed_admin(details: dict[str, Any]) -> None:
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    details.setdefault("admin_username", "admin")
    # A demo-only password, kept in var/demo.json so every run prints the same login.
    details.setdefault("admin_password", "platform-demo-" + os.urandom(4).hex())
    user, created = user_model.objects.get_or_create(
        username=details["admin_username"],
        defaults={"is_staff": True, "is_superuser": True, "email": "admin@example.com"},
    )
    if created or not user.check_password(details["admin_password"]):
        user.set_password(details["admin_password"])
        user.is_staff = user.is_superuser = True
        user.save()
