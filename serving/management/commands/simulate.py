"""`manage.py simulate ...`: the cluster simulator; the same flags as `python -m serving.clustersim`."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from serving.clustersim.__main__ import add_arguments, run


class Command(BaseCommand):
    help = "Run the cluster simulator (see python -m serving.clustersim --help)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        if run(argparse.Namespace(**options)) != 0:
            raise CommandError("the simulation failed")
