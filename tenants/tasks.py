"""Celery tasks of the tenants app."""

from __future__ import annotations

from config.celery import task
from tenants.actions import do_record_key_use, write_key_records
from tenants.models import ApiKey


@task(name="tenants.flush_key_last_used", ignore_result=True)
def flush_key_last_used() -> None:
    do_record_key_use()


@task(name="tenants.republish_key_records", ignore_result=True)
def republish_key_records() -> None:
    """Rewrite every key's Redis record: repairs what a Redis outage kept from being written."""
    write_key_records(ApiKey.objects.all(), events=["all"])
