"""Viewsets of the metering API.

Tenant-scoped routes (`tenants/{slug}/...`) resolve the tenant through
`tenants.actions.access_tenant_for_user` before anything else (`TenantScopedViewSet`), so
another tenant's caller gets 404 whatever the method; rows are then read through the
`metering.actions.access_*` querysets and narrowed to that tenant. Staff-wide routes answer
403 to anyone but staff, as the tenants and fleet APIs do. Writes go through the `do_*`
actions only. An API key with `read_usage` or `manage` scope authenticates as its tenant.
"""

from __future__ import annotations

from typing import Any

from django.db.models import DateTimeField, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.http import Http404, HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, permissions, status
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import PlatformModelViewSet, PlatformViewSet, ReadAnyWriteStaff
from metering import actions
from metering.api import filters, queries
from metering.api.serializers import (
    MARGIN_COLUMNS,
    CloseMonthSerializer,
    InvoiceSerializer,
    MarginReportSerializer,
    PriceSheetSerializer,
    RollupSerializer,
    UsageEventSerializer,
    UsageReportSerializer,
)
from metering.invoices import chargeback_csv, invoice_as_csv, invoice_as_dict
from metering.models import HourlyRollup, Invoice, PriceSheet, UsageEvent
from registry.actions import visible_adapters_for_user, visible_models_for_user
from tenants.actions import access_tenant_for_user
from tenants.api.views import TenantScopedViewSet

CSV_RESPONSE = OpenApiResponse(OpenApiTypes.STR, description="text/csv")


def csv_download(body: str, filename: str) -> HttpResponse:
    response = HttpResponse(body, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


class StaffViewSet(PlatformViewSet):
    permission_classes = [permissions.IsAdminUser]


# ------------------------------------------------------------------------------- usage


class NewestFirst(CursorPagination):
    """Events by start time, newest first. A cursor, not an offset: paging deep into
    hundreds of millions of rows stays an index range scan."""

    ordering = ("-started_at", "-request_id")
    page_size = 100
    page_size_query_param = "limit"
    max_page_size = 1000


class UsageViewSet(TenantScopedViewSet):
    """A tenant's usage: a series aggregated from its events, and the events themselves."""

    queryset = UsageEvent.objects.none()  # for the schema; the handlers scope to the tenant
    serializer_class = UsageEventSerializer
    pagination_class = NewestFirst

    def tenant_events(self, params: dict[str, Any]) -> QuerySet[UsageEvent]:
        events = actions.access_usage(self.request.user).filter(tenant_id=self.tenant.pk)
        if "key" in params:
            events = events.filter(key_id=params["key"])
        return filters.filter_exact(events, params, "model")

    @extend_schema(parameters=[filters.UsageQuery], responses=UsageReportSerializer)
    def report(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        params = filters.parse_query(filters.UsageQuery, request)
        buckets = queries.usage_buckets(
            self.tenant_events(params), params["start"], params["end"], params["granularity"]
        )
        report = {
            "tenant": self.tenant.slug,
            "start": params["start"],
            "end": params["end"],
            "granularity": params["granularity"],
            "model": params.get("model"),
            "key": params.get("key"),
            "totals": queries.with_spend_usd(queries.usage_totals(buckets)),
            "buckets": [queries.with_spend_usd(bucket) for bucket in buckets],
        }
        return Response(UsageReportSerializer(report).data)

    @extend_schema(parameters=[filters.UsageEventQuery])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        params = filters.parse_query(filters.UsageEventQuery, request)
        events = self.tenant_events(params).filter(
            started_at__gte=params["start"], started_at__lt=params["end"]
        )
        page = self.paginate_queryset(events)
        serializer = self.get_serializer(page, many=True)
        return self.get_paginated_response(serializer.data)


# ------------------------------------------------------------------------------ rollups


def filter_rollups(rollups: QuerySet[HourlyRollup], params: dict[str, Any]) -> QuerySet[Any]:
    rollups = rollups.filter(hour__gte=params["start"], hour__lt=params["end"])
    return filters.filter_exact(rollups, params, "model", "adapter", "pool", "tier").order_by(
        "hour", "tenant_id", "model", "adapter", "pool", "tier"
    )


class TenantRollupViewSet(TenantScopedViewSet, mixins.ListModelMixin):
    """A tenant's hourly rollups."""

    queryset = HourlyRollup.objects.none()  # for the schema
    serializer_class = RollupSerializer

    def get_queryset(self) -> QuerySet[HourlyRollup]:
        params = filters.parse_query(filters.RollupQuery, self.request)
        rollups = actions.access_rollups(self.request.user).filter(tenant_id=self.tenant.pk)
        return filter_rollups(rollups, params)

    @extend_schema(parameters=[filters.RollupQuery])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)


class RollupViewSet(StaffViewSet, mixins.ListModelMixin):
    """Every tenant's hourly rollups (staff)."""

    queryset = HourlyRollup.objects.none()  # for the schema
    serializer_class = RollupSerializer

    def get_queryset(self) -> QuerySet[HourlyRollup]:
        params = filters.parse_query(filters.StaffRollupQuery, self.request)
        rollups = actions.access_rollups(self.request.user)
        if "tenant" in params:
            try:
                tenant = access_tenant_for_user(self.request.user, params["tenant"])
            except Http404:
                raise ValidationError({"tenant": "No such tenant."}) from None
            rollups = rollups.filter(tenant_id=tenant.pk)
        return filter_rollups(rollups, params)

    @extend_schema(parameters=[filters.StaffRollupQuery])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)


# ----------------------------------------------------------------------------- invoices


class InvoiceViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """A tenant's monthly invoices, with their lines and exports."""

    queryset = Invoice.objects.none()  # for the schema
    serializer_class = InvoiceSerializer

    def get_queryset(self) -> QuerySet[Invoice]:
        invoices = actions.access_invoices(self.request.user).filter(tenant=self.tenant)
        return invoices.prefetch_related("lines")

    def get_object(self) -> Invoice:
        invoice = actions.access_invoice(self.request.user, self.kwargs["pk"])
        if invoice.tenant_id != self.tenant.pk:
            raise Http404("No such invoice.")
        return invoice

    @extend_schema(responses={(200, "text/csv"): CSV_RESPONSE})
    def export_csv(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        invoice = self.get_object()
        return csv_download(invoice_as_csv(invoice), f"invoice-{_invoice_name(invoice)}.csv")

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def export_json(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        invoice = self.get_object()
        response = Response(invoice_as_dict(invoice))
        filename = f"invoice-{_invoice_name(invoice)}.json"
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
        return response


def _invoice_name(invoice: Invoice) -> str:
    return f"{invoice.tenant.slug}-{invoice.month:%Y-%m}"


class CloseMonthViewSet(StaffViewSet):
    """Finalize a tenant's invoice for a month (staff). Closing a closed month changes
    nothing and answers the same invoice."""

    serializer_class = CloseMonthSerializer

    @extend_schema(request=CloseMonthSerializer, responses=InvoiceSerializer)
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = CloseMonthSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        invoice = actions.do_close_month(
            serializer.validated_data["tenant"], serializer.validated_data["month"]
        )
        return Response(InvoiceSerializer(invoice).data, status=status.HTTP_200_OK)


class ChargebackViewSet(StaffViewSet):
    """A month's invoices per team and cost center, as CSV for finance (staff)."""

    @extend_schema(parameters=[filters.MonthQuery], responses={(200, "text/csv"): CSV_RESPONSE})
    def export_csv(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        month = filters.parse_query(filters.MonthQuery, request)["month"]
        return csv_download(chargeback_csv(month), f"chargeback-{month:%Y-%m}.csv")


# ------------------------------------------------------------------------- price sheets


def with_effective_until(sheets: QuerySet[PriceSheet]) -> QuerySet[PriceSheet]:
    """Annotate when each sheet stops being in force: the start of the next sheet for the
    same model, adapter and owner (a list sheet is only followed by list sheets)."""
    owner = Coalesce("tenant_id", Value(0))
    later = (
        PriceSheet.objects.annotate(owner=owner)
        .filter(
            model=OuterRef("model"),
            adapter=OuterRef("adapter"),
            owner=Coalesce(OuterRef("tenant_id"), Value(0)),
            effective_from__gt=OuterRef("effective_from"),
        )
        .order_by("effective_from")
        .values("effective_from")[:1]
    )
    return sheets.annotate(effective_until=Subquery(later, output_field=DateTimeField()))


class PriceSheetViewSet(PlatformModelViewSet):
    """Price sheets. Tenants read the list prices of the models (and adapters) visible to
    them, and their own tenant prices; staff read all and write, through the actions that
    republish the gateway's price book."""

    permission_classes = [ReadAnyWriteStaff]
    serializer_class = PriceSheetSerializer
    queryset = PriceSheet.objects.none()  # for the schema

    def get_queryset(self) -> QuerySet[PriceSheet]:
        user = self.request.user
        sheets = actions.access_price_sheets(user)
        if not user.is_staff:
            sheets = sheets.filter(
                Q(model__in=visible_models_for_user(user).values("name")),
                Q(adapter="") | Q(adapter__in=visible_adapters_for_user(user).values("name")),
            )
        sheets = with_effective_until(sheets).select_related("tenant")
        return sheets.order_by("model", "adapter", "tenant_id", "effective_from")

    def filter_queryset(self, queryset: QuerySet[PriceSheet]) -> QuerySet[PriceSheet]:
        if self.action != "list":
            return queryset
        params = filters.parse_query(filters.PriceSheetQuery, self.request)
        queryset = filters.filter_exact(queryset, params, "model", "adapter")
        if "in_force_at" in params:
            at = params["in_force_at"]
            queryset = queryset.filter(effective_from__lte=at).filter(
                Q(effective_until__isnull=True) | Q(effective_until__gt=at)
            )
        return queryset

    @extend_schema(parameters=[filters.PriceSheetQuery])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    def _annotated(self, sheet: PriceSheet) -> PriceSheet:
        return with_effective_until(PriceSheet.objects.filter(pk=sheet.pk)).get()

    def perform_create(self, serializer: Any) -> None:
        sheet = actions.do_create_price_sheet(self.request.user, **serializer.validated_data)
        serializer.instance = self._annotated(sheet)

    def perform_update(self, serializer: Any) -> None:
        sheet = actions.do_update_price_sheet(
            serializer.instance, self.request.user, **serializer.validated_data
        )
        serializer.instance = self._annotated(sheet)

    def perform_destroy(self, instance: PriceSheet) -> None:
        actions.do_delete_price_sheet(instance, self.request.user)


# ------------------------------------------------------------------------------- margin


class MarginViewSet(StaffViewSet):
    """Revenue minus cost to serve (idle GPU time included) per model, pool or tenant, with
    the router's saving against least load, from the hourly rollups and the GPU-time ledger
    (staff)."""

    @extend_schema(parameters=[filters.MarginQuery], responses=MarginReportSerializer)
    def report(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(MarginReportSerializer(self._report(request)).data)

    @extend_schema(parameters=[filters.MarginQuery], responses={(200, "text/csv"): CSV_RESPONSE})
    def export_csv(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        report = self._report(request)
        name = f"margin-by-{report['by']}-{report['start']:%Y%m%dT%H%M}-{report['end']:%Y%m%dT%H%M}"
        return csv_download(queries.margin_csv(report, MARGIN_COLUMNS), f"{name}.csv")

    def _report(self, request: Request) -> dict[str, Any]:
        params = filters.parse_query(filters.MarginQuery, request)
        return queries.margin_report(
            actions.access_rollups(request.user),
            actions.access_replica_hours(request.user),
            params["start"],
            params["end"],
            params["by"],
        )
