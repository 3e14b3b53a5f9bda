"""Budget alerts at 50, 80 and 100 %, each sent once, and the spend counter reconciled."""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
import redis
from django.contrib.auth.models import User
from django.core import mail

from metering import ingest
from metering.budgets import check_tenant_budget, reconcile_spend, sign
from metering.models import BudgetAlert, Notice, UsageEvent
from tenants.limiter import month_spend_key
from tenants.models import Membership, Quota, Role, Tenant
from tests.metering.helpers import event

JANUARY = date(2026, 1, 1)


@pytest.fixture
def acme(db: None) -> Tenant:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    Quota.objects.update_or_create(
        tenant=tenant, defaults={"monthly_spend_budget_usd": Decimal("10.00")}
    )
    owner = User.objects.create_user("ada", "ada@acme.test", "x")
    Membership.objects.create(user=owner, tenant=tenant, role=Role.OWNER)
    return tenant


def _bill(tenant: Tenant, micros: int) -> None:
    e = event(tenant.pk, price_charged_usd_micros=micros)
    row = {k: getattr(e, k) for k in ingest.COLUMNS}
    row["started_at"] = datetime.fromtimestamp(e.started_at, UTC)
    row["ended_at"] = datetime.fromtimestamp(e.ended_at, UTC)
    UsageEvent.objects.create(**row)


def test_crossing_eighty_percent_sends_the_fifty_and_eighty_alerts_once(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    _bill(acme, 8_500_000)
    first = check_tenant_budget(redis_client, acme, JANUARY)
    again = check_tenant_budget(redis_client, acme, JANUARY)
    assert (first, again) == ([50, 80], [])
    assert len(mail.outbox) == 2 and mail.outbox[1].to == ["ada@acme.test"]
    assert Notice.objects.filter(tenant=acme).count() == 2
    assert BudgetAlert.objects.filter(tenant=acme).count() == 2


def test_the_counter_the_limiter_reads_is_raised_to_what_postgres_billed(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    _bill(acme, 3_000_000)
    key = month_spend_key(acme.pk, "2026-01")
    redis_client.set(key, 1_000_000)  # a Redis restart lost settles
    assert reconcile_spend(redis_client, acme.pk, JANUARY) == 3_000_000
    redis_client.set(key, 5_000_000)  # settles not yet ingested: never lowered
    assert reconcile_spend(redis_client, acme.pk, JANUARY) == 5_000_000


def test_the_webhook_signature_covers_timestamp_and_body() -> None:
    body = b'{"threshold_percent": 80}'
    expected = hmac.new(b"s3cret", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign("s3cret", "1700000000", body) == f"sha256={expected}"
    assert sign("s3cret", "1700000001", body) != f"sha256={expected}"


def test_one_tenants_failing_budget_check_leaves_the_others_checked(
    acme: Tenant, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from config.loops import loop_failures
    from metering import budgets, tasks

    broken = Tenant.objects.create(slug="broken", name="Broken")
    later = Tenant.objects.create(slug="later", name="Later")  # walked after the broken one
    for tenant in (broken, later):
        Quota.objects.update_or_create(
            tenant=tenant, defaults={"monthly_spend_budget_usd": Decimal("5.00")}
        )
    checked: list[str] = []

    def check(client: redis.Redis, tenant: Tenant, month: date) -> list[int]:
        checked.append(tenant.slug)
        if tenant.pk == broken.pk:
            raise redis.ResponseError("WRONGTYPE Operation against a key")
        return []

    monkeypatch.setattr(budgets, "check_tenant_budget", check)
    tasks.check_budgets()
    assert checked == ["acme", "broken", "later"]
    (failure,) = loop_failures(redis_client, "tenant")[broken.pk]
    assert failure.loop == "budgets"
    assert failure.error.startswith("ResponseError: WRONGTYPE")


def test_the_console_shows_a_tenant_its_budget_check_fails_on(
    acme: Tenant, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.test import Client

    from metering import budgets, tasks

    def check(client: redis.Redis, tenant: Tenant, month: date) -> list[int]:
        raise ArithmeticError("a budget of NaN")

    monkeypatch.setattr(budgets, "check_tenant_budget", check)
    tasks.check_budgets()
    staff = Client()
    staff.force_login(User.objects.create_user("ops", is_staff=True))
    page = staff.get(f"/console/tenants/{acme.slug}/").content.decode()
    assert "budgets failing" in page
    assert "ArithmeticError: a budget of NaN" in page
