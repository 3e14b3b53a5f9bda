"""Query parameters of the metering API, parsed by serializers so that a bad value is DRF's
400 naming the parameter (`{"start": ["..."]}`), never a 500.

Times are ISO 8601: a date-time (naive means UTC) or a bare date (midnight UTC), between
2000 and 2100, taken in UTC whatever their offset (config.api.check_instant). Ranges are
half-open, [start, end).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.request import Request

from config.api import IdField, check_instant

DEFAULT_WINDOW = timedelta(days=30)
# An hourly series over more than about three months is a mistake, not a chart; refuse it
# rather than build a response of tens of thousands of buckets.
MAX_BUCKETS = 2_400
BUCKET_LENGTH = {"hour": timedelta(hours=1), "day": timedelta(days=1), "month": timedelta(days=28)}


def invalid(field: serializers.Field[Any, Any, Any, Any]) -> serializers.ValidationError:
    """The field's own "invalid" message as DRF's error (what `field.fail` raises)."""
    return serializers.ValidationError(field.error_messages["invalid"], code="invalid")


@extend_schema_field(OpenApiTypes.DATETIME)
class InstantField(serializers.Field[datetime, str, str, Any]):
    """An ISO 8601 date-time, or a date meaning its midnight UTC."""

    default_error_messages = {
        "invalid": "Expected an ISO 8601 date-time or date, e.g. 2026-01-31T12:00:00Z.",
    }

    def to_internal_value(self, data: Any) -> datetime:
        text = str(data).strip()
        try:
            parsed = parse_datetime(text)
            day = parse_date(text) if parsed is None else None
        except ValueError:  # well formed but impossible, e.g. 2026-02-30
            parsed = day = None
        if parsed is None:
            if day is None:
                raise invalid(self)
            parsed = datetime.combine(day, time.min)
        if timezone.is_naive(parsed):
            parsed = parsed.replace(tzinfo=UTC)
        return check_instant(parsed)

    def to_representation(self, value: datetime) -> str:
        return value.isoformat()


@extend_schema_field(OpenApiTypes.STR)
class MonthField(serializers.Field[date, str, str, Any]):
    """A calendar month as `YYYY-MM` (a full date is accepted and means its month)."""

    default_error_messages = {"invalid": "Expected a month as YYYY-MM, e.g. 2026-01."}

    def to_internal_value(self, data: Any) -> date:
        text = str(data).strip()
        try:
            day = parse_date(text if len(text) > 7 else f"{text}-01")
        except ValueError:
            day = None
        if day is None:
            raise invalid(self)
        check_instant(datetime.combine(day, time.min, tzinfo=UTC))
        return day.replace(day=1)

    def to_representation(self, value: date) -> str:
        return value.strftime("%Y-%m")


class TimeRangeQuery(serializers.Serializer[Any]):
    start = InstantField(required=False, help_text="Inclusive; default: 30 days before end.")
    end = InstantField(required=False, help_text="Exclusive; default: now.")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs["end"] = attrs.get("end") or timezone.now()
        attrs["start"] = attrs.get("start") or attrs["end"] - DEFAULT_WINDOW
        if attrs["start"] >= attrs["end"]:
            raise serializers.ValidationError({"end": "Must be after start."})
        return attrs


class UsageEventQuery(TimeRangeQuery):
    model = serializers.CharField(required=False, max_length=128)
    key = IdField(required=False, help_text="An API key id.")


class UsageQuery(UsageEventQuery):
    granularity = serializers.ChoiceField(choices=["hour", "day", "month"], default="day")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        buckets = (attrs["end"] - attrs["start"]) / BUCKET_LENGTH[attrs["granularity"]]
        if buckets > MAX_BUCKETS:
            raise serializers.ValidationError(
                {
                    "granularity": f"Too many {attrs['granularity']}s in this range (max {MAX_BUCKETS})."
                }
            )
        return attrs


class RollupQuery(TimeRangeQuery):
    model = serializers.CharField(required=False, max_length=128)
    adapter = serializers.CharField(required=False, allow_blank=True, max_length=128)
    pool = serializers.CharField(required=False, allow_blank=True, max_length=64)
    tier = serializers.CharField(required=False, max_length=16)


class StaffRollupQuery(RollupQuery):
    tenant = serializers.CharField(required=False, help_text="A tenant slug or id.")


class PriceSheetQuery(serializers.Serializer[Any]):
    model = serializers.CharField(required=False, max_length=128)
    adapter = serializers.CharField(required=False, allow_blank=True, max_length=128)
    in_force_at = InstantField(required=False, help_text="Only the sheets in force at this moment.")


class MarginQuery(TimeRangeQuery):
    by = serializers.ChoiceField(choices=["model", "pool", "tenant"], default="model")


class MonthQuery(serializers.Serializer[Any]):
    month = MonthField(help_text="YYYY-MM")


def parse_query(query: type[serializers.Serializer[Any]], request: Request) -> dict[str, Any]:
    """The validated query parameters, or a 400 naming the bad one."""
    serializer = query(data=request.query_params)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def filter_exact(queryset: QuerySet[Any], params: dict[str, Any], *names: str) -> QuerySet[Any]:
    """Narrow `queryset` by every named parameter that was given."""
    given = {name: params[name] for name in names if name in params}
    return queryset.filter(**given)
