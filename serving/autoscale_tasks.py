"""The autoscaler's Celery loop. Beat entry (config owns it):
`"serving-autoscale": {"task": "serving.autoscale", "schedule": 10.0}`."""

from __future__ import annotations

from celery import shared_task

from serving.autoscale_actions import do_autoscale
from serving.telemetry import redis_client


@shared_task(name="serving.autoscale", ignore_result=True)
def autoscale() -> None:
    do_autoscale(redis_client())
