"""Enqueueing Celery tasks once the current transaction commits, by task name.

Sending by name keeps the caller free of the task module (an action never imports the
tasks that call it), and Celery's routes still apply: the name picks the queue. A broker
hiccup is logged, never raised: every loop behind these tasks also runs on beat's schedule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from config.celery import app

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Enqueue:
    """One task to send; the callable `transaction.on_commit` runs."""

    task_name: str
    args: tuple[Any, ...] = ()

    def __call__(self) -> None:
        try:
            app.send_task(self.task_name, args=self.args)
        except Exception:
            logger.warning("could not enqueue %s", self.task_name, exc_info=True)


def enqueue_on_commit(task_name: str, *args: Any) -> None:
    transaction.on_commit(Enqueue(task_name, args))
