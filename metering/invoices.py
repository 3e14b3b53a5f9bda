"""Monthly invoices: a line per model, summed from the month's billed events.

An invoice is a draft until the month is closed; closing finalizes it, and a finalized invoice
never changes again (closing twice, or late events, leave it as it is). Close a month only
after ingest has caught up (the beat task waits a grace period into the next month).
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime
from typing import Any, TypedDict

from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from metering.models import CostCenter, Invoice, InvoiceLine, UsageEvent, micros_to_usd
from tenants.models import Tenant


def month_start(day: date) -> date:
    return day.replace(day=1)


def month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime(month.year, month.month, 1, tzinfo=UTC)
    next_month = date(month.year + month.month // 12, month.month % 12 + 1, 1)
    return start, datetime(next_month.year, next_month.month, 1, tzinfo=UTC)


class _ModelTotals(TypedDict):
    """One model's month of events, summed in PostgreSQL (a Sum over no values is None)."""

    model: str
    requests: int
    prompt_tokens: int | None
    cached_prompt_tokens: int | None
    completion_tokens: int | None
    amount_usd_micros: int | None


def _lines_from_events(tenant_id: int, month: date) -> list[_ModelTotals]:
    start, end = month_bounds(month)
    return list(
        UsageEvent.objects.filter(tenant_id=tenant_id, started_at__gte=start, started_at__lt=end)
        .values("model")
        .annotate(
            requests=Count("request_id"),
            prompt_tokens=Sum("prompt_tokens"),
            cached_prompt_tokens=Sum("cached_prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            amount_usd_micros=Sum("price_charged_usd_micros"),
        )
        .order_by("model")
    )


def do_build_invoice(tenant: Tenant, month: date, *, finalize: bool) -> Invoice:
    """Create or refresh the draft for `month`; finalize it when asked. A finalized invoice is
    returned untouched."""
    month = month_start(month)
    with transaction.atomic():
        invoice, _ = Invoice.objects.select_for_update().get_or_create(tenant=tenant, month=month)
        if invoice.status == Invoice.Status.FINALIZED:
            return invoice
        invoice.lines.all().delete()
        lines = [
            InvoiceLine(
                invoice=invoice,
                model=row["model"],
                requests=row["requests"],
                prompt_tokens=row["prompt_tokens"] or 0,
                cached_prompt_tokens=row["cached_prompt_tokens"] or 0,
                completion_tokens=row["completion_tokens"] or 0,
                amount_usd_micros=row["amount_usd_micros"] or 0,
                amount_usd=micros_to_usd(row["amount_usd_micros"] or 0),
            )
            for row in _lines_from_events(tenant.pk, month)
        ]
        InvoiceLine.objects.bulk_create(lines)
        invoice.total_usd_micros = sum(line.amount_usd_micros for line in lines)
        invoice.total_usd = micros_to_usd(invoice.total_usd_micros)
        if finalize:
            invoice.status = Invoice.Status.FINALIZED
            invoice.finalized_at = timezone.now()
        invoice.save()
        return invoice


def do_close_month(tenant: Tenant, month: date) -> Invoice:
    return do_build_invoice(tenant, month, finalize=True)


# An invoice line's columns, in the order the API, the JSON export and the CSV show them.
INVOICE_LINE_FIELDS = (
    "model",
    "requests",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "amount_usd",
)


def invoice_as_dict(invoice: Invoice) -> dict[str, Any]:
    return {
        "tenant": invoice.tenant.slug,
        "month": invoice.month.strftime("%Y-%m"),
        "status": invoice.status,
        "total_usd": str(invoice.total_usd),
        "lines": [
            {
                "model": line.model,
                "requests": line.requests,
                "prompt_tokens": line.prompt_tokens,
                "cached_prompt_tokens": line.cached_prompt_tokens,
                "completion_tokens": line.completion_tokens,
                "amount_usd": str(line.amount_usd),
            }
            for line in invoice.lines.all()
        ],
    }


INVOICE_CSV_HEADER = ["tenant", "month", "status", *INVOICE_LINE_FIELDS]


def invoice_as_csv(invoice: Invoice) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(INVOICE_CSV_HEADER)
    data = invoice_as_dict(invoice)
    for line in data["lines"]:
        writer.writerow([data["tenant"], data["month"], data["status"], *line.values()])
    return out.getvalue()


CHARGEBACK_CSV_HEADER = ["month", "cost_center", "team", "tenant", "status", "total_usd"]


def chargeback_rows(month: date) -> list[dict[str, str]]:
    """One row per tenant invoiced for `month`, labelled with its team and cost center. A tenant
    is a team; one without a CostCenter mapping is charged to its own slug."""
    month = month_start(month)
    centers = {c.tenant_id: c for c in CostCenter.objects.all()}
    rows = []
    for invoice in Invoice.objects.filter(month=month).select_related("tenant"):
        center = centers.get(invoice.tenant_id)
        rows.append(
            {
                "month": month.strftime("%Y-%m"),
                "cost_center": center.code if center else invoice.tenant.slug,
                "team": center.team if center else invoice.tenant.name,
                "tenant": invoice.tenant.slug,
                "status": invoice.status,
                "total_usd": str(invoice.total_usd),
            }
        )
    return sorted(rows, key=lambda r: (r["cost_center"], r["tenant"]))


def chargeback_csv(month: date) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CHARGEBACK_CSV_HEADER)
    writer.writeheader()
    writer.writerows(chargeback_rows(month))
    return out.getvalue()
