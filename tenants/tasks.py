"""Celery tasks of the tenants app."""

from __future__ import annotations

from celery import shared_task

from tenants.actions import do_record_key_use, write_key_records
from tenants.models import ApiKey


@shared_task(name="tenants.flush_key_last_used", ignore_result=True)
def flush_key_last_used() -> None:
    do_record_key_use()


@shared_task(name="tenants.republish_key_records", ignore_result=True)
def republish_key_records() -> None:
    """Rewrite every key's Redis record: repairs what a Redis outage kept from being written."""
    write_key_records(ApiKey.objects.all(), events=["all"])
