"""`manage.py simulate ...`: the cluster simulator; the same flags as `python -m serving.clustersim`."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from serving.clustersim.__main__ import main


class Command(BaseCommand):
    help = "Run the cluster simulator (see python -m serving.clustersim --help)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def handle(self, *args: Any, **options: Any) -> None:
        if main(list(args)) != 0:
            raise CommandError("the simulation failed")
