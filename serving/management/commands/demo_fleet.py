"""`manage.py demo_fleet --commands`: the demo fleet's node agents as JSON argv lists."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from serving.demo import agent_commands


class Command(BaseCommand):
    help = "List the demo fleet's node agent commands (run seed_demo first)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--commands", action="store_true", help="print the agents' argv lists as JSON"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["commands"]:
            raise CommandError("nothing to do: pass --commands")
        demo = settings.PLATFORM_VAR_DIR / "demo.json"
        details = json.loads(demo.read_text()) if demo.exists() else {}
        control_plane = settings.PLATFORM_PUBLIC_URL
        self.stdout.write(json.dumps(agent_commands(details, control_plane)))
