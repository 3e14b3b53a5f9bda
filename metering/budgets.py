"""Monthly spend budgets: alerts at 50, 80 and 100 %, and reconciling the Redis counters.

The spend counter `tenants.limiter.month_spend_key` is added to by the limiter's settle and read
by its admission script (which blocks a hard budget with `insufficient_quota`). Alerts read the
larger of that counter and the month's billed total in PostgreSQL.

Each alert is sent once per tenant, month and threshold: a BudgetAlert row is inserted first
under a unique constraint, and only the run that inserted it sends the email, the console
notice and the webhook.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from datetime import date

import httpx
import orjson
import redis as redis_lib
from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import Sum

from metering.invoices import month_bounds, month_start
from metering.models import BudgetAlert, BudgetWebhook, Notice, UsageEvent
from metering.prices import usd_to_micros
from tenants.limiter import month_spend_key
from tenants.models import Membership, Quota, Role, Tenant

logger = logging.getLogger(__name__)

THRESHOLDS_PERCENT = (50, 80, 100)
SIGNATURE_HEADER = "X-Platform-Signature"
TIMESTAMP_HEADER = "X-Platform-Timestamp"

# Raise the counter to PostgreSQL's total, never lower it: the counter also holds settles whose
# events are still in the stream, which PostgreSQL has not seen yet.
_RAISE_TO = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if floor > current then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return floor
end
return current
"""


def billed_micros(tenant_id: int, month: date) -> int:
    start, end = month_bounds(month_start(month))
    total = UsageEvent.objects.filter(
        tenant_id=tenant_id, started_at__gte=start, started_at__lt=end
    ).aggregate(total=Sum("price_charged_usd_micros"))["total"]
    return int(total or 0)


def reconcile_spend(client: redis_lib.Redis, tenant_id: int, month: date) -> int:
    """Bring the tenant's Redis spend counter up to what PostgreSQL has billed; returns the
    counter after."""
    key = month_spend_key(tenant_id, month.strftime("%Y-%m"))
    return int(client.eval(_RAISE_TO, 1, key, billed_micros(tenant_id, month), 40 * 86400))


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """HMAC-SHA256 over `timestamp.body`: a receiver checks it and rejects old timestamps, so a
    captured alert cannot be replayed later."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def check_tenant_budget(client: redis_lib.Redis, tenant: Tenant, month: date) -> list[int]:
    """Send the alerts this month's spend has crossed and not yet sent; returns their
    thresholds."""
    quota = Quota.objects.filter(tenant=tenant).first()
    if quota is None or quota.monthly_spend_budget_usd is None:
        return []
    budget = usd_to_micros(quota.monthly_spend_budget_usd)
    if budget <= 0:
        return []
    spend = reconcile_spend(client, tenant.pk, month)
    sent = []
    for threshold in THRESHOLDS_PERCENT:
        if spend * 100 < budget * threshold:
            break
        alert = _record_alert(tenant, month, threshold, spend, budget)
        if alert is not None:
            _deliver(alert, tenant, hard=quota.hard_budget)
            sent.append(threshold)
    return sent


def _record_alert(
    tenant: Tenant, month: date, threshold: int, spend: int, budget: int
) -> BudgetAlert | None:
    try:
        with transaction.atomic():
            return BudgetAlert.objects.create(
                tenant=tenant,
                month=month_start(month),
                threshold_percent=threshold,
                spend_usd_micros=spend,
                budget_usd_micros=budget,
            )
    except IntegrityError:
        return None  # already sent by an earlier run


def _deliver(alert: BudgetAlert, tenant: Tenant, *, hard: bool) -> None:
    title = f"{tenant.name} has used {alert.threshold_percent}% of its monthly budget"
    body = (
        f"Spend this month: ${alert.spend_usd_micros / 1e6:,.2f} of "
        f"${alert.budget_usd_micros / 1e6:,.2f}."
    )
    if alert.threshold_percent >= 100:
        body += " New requests are refused." if hard else " Requests are still served."
    level = Notice.Level.CRITICAL if alert.threshold_percent >= 100 else Notice.Level.WARNING
    Notice.objects.create(tenant=tenant, level=level, title=title, body=body)
    recipients = list(
        Membership.objects.filter(tenant=tenant, role__in=[Role.OWNER, Role.ADMIN])
        .exclude(user__email="")
        .values_list("user__email", flat=True)
    )
    if recipients:
        send_mail(title, body, settings.DEFAULT_FROM_EMAIL, recipients, fail_silently=True)
        alert.emailed = True
    alert.webhook_status = _post_webhook(alert, tenant)
    alert.save(update_fields=["emailed", "webhook_status"])


def alert_payload(alert: BudgetAlert, tenant: Tenant) -> bytes:
    return orjson.dumps(
        {
            "type": "budget.threshold_crossed",
            "tenant": tenant.slug,
            "month": alert.month.strftime("%Y-%m"),
            "threshold_percent": alert.threshold_percent,
            "spend_usd_micros": alert.spend_usd_micros,
            "budget_usd_micros": alert.budget_usd_micros,
        }
    )


def _post_webhook(alert: BudgetAlert, tenant: Tenant) -> str:
    hook = BudgetWebhook.objects.filter(tenant=tenant, active=True).first()
    if hook is None:
        return ""
    body = alert_payload(alert, tenant)
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: sign(hook.secret, timestamp, body),
    }
    try:
        response = httpx.post(hook.url, content=body, headers=headers, timeout=5.0)
    except httpx.HTTPError as error:
        logger.warning("budget webhook %s failed: %s", hook.url, error)
        return f"error: {type(error).__name__}"[:64]
    return str(response.status_code)
