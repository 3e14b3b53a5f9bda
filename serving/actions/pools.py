"""GPU pools: create, change, delete. The staff API, the demo and anything else that writes a
pool row call these.

Every routing-table row of a replica carries its pool's name, region, GPU class, price and
spot flag (the router weighs them), so a change of any of these republishes the table once it
commits rather than at the next periodic publish. A pool still holding nodes or deployments is
not deleted: the refusal says how many of each.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from serving.actions.reconcile import request_publish
from serving.models import GpuPool

POOL_FIELDS = {"name", "gpu_class", "region", "usd_per_gpu_hour", "spot", "labels"}
ROUTED_FIELDS = POOL_FIELDS - {"labels"}


def _apply(pool: GpuPool, fields: dict[str, Any]) -> None:
    unknown = set(fields) - POOL_FIELDS
    if unknown:
        raise ValidationError(f"These fields cannot be set: {', '.join(sorted(unknown))}.")
    for name, value in fields.items():
        setattr(pool, name, value)
    # Labels are checked when given: a pool whose labels an older release stored as numbers
    # (`{"gpus": 8}`) still takes a new price.
    pool.full_clean(exclude=None if "labels" in fields else ["labels"])


@transaction.atomic
def do_create_pool(**fields: Any) -> GpuPool:
    pool = GpuPool()
    _apply(pool, fields)
    pool.save()
    return pool


@transaction.atomic
def do_update_pool(pool: GpuPool, **changes: Any) -> GpuPool:
    changed = {name for name, value in changes.items() if getattr(pool, name, None) != value}
    _apply(pool, changes)
    pool.save()
    if changed & ROUTED_FIELDS:
        request_publish()
    return pool


@transaction.atomic
def do_delete_pool(pool: GpuPool) -> None:
    holders = [
        _count(n, noun)
        for n, noun in (
            (pool.nodes.count(), "node"),
            (pool.deployments.count(), "deployment"),
        )
        if n
    ]
    if holders:
        raise ValidationError(f"This pool still has {' and '.join(holders)}; remove them first.")
    pool.delete()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
