"""Helpers for tests that run the fleet with real processes: a stand-in for Celery beat that
runs the control loops on a thread, and a poll-until helper."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import connection

from serving.actions.nodes import do_mark_lost_nodes
from serving.actions.reconcile import do_reconcile
from serving.actions.routing_table import publish_routing_table

T = TypeVar("T")


def eventually(
    check: Callable[[], T | None], timeout_s: float, what: str, step_s: float = 0.25
) -> T:
    """`check()`'s first truthy value within `timeout_s`, else an AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


class ControlLoops(threading.Thread):
    """Beat stand-in: node health, reconcile and publish, once a second: the same functions the
    Celery tasks call, on a clock the test controls."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                do_mark_lost_nodes()
                do_reconcile()
                publish_routing_table()
                self.halt.wait(1.0)
        finally:
            connection.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)
