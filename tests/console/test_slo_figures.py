"""The console judges answers on both clocks, as the gateway does: each usage event's TPOT and
SLO outcome, and the overview's TTFT and TPOT percentiles and share within the SLO per tier."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from django.utils import timezone

from metering.models import UsageEvent
from serving.console.queries import JUDGED_TIERS, latency_figures
from tenants.actions import do_create_tenant
from tenants.models import Tenant
from tests.console.test_pages import client_for, member, user
from tests.metering.helpers import stored

# (tier, status, ttft_ms, completion tokens, TPOT ms) -> the outcome the SLO gives it.
ANSWERS: list[tuple[str, str, float | None, int, float, str | None]] = [
    ("interactive", "ok", 500.0, 20, 47.5, "met"),
    ("interactive", "ok", 1000.0, 10, 50.0, "met"),  # both at their objectives
    ("interactive", "ok", 300.0, 1, 0.0, "met"),  # one token: no TPOT
    ("interactive", "ok", 500.0, 20, 60.0, "tpot"),  # fast first token, slow decode
    ("interactive", "ok", 1200.0, 20, 60.0, "ttft"),  # TTFT first
    ("interactive", "ok", None, 0, 0.0, "ttft"),  # never a first token
    ("interactive", "error", 200.0, 3, 10.0, "failed"),
    ("interactive", "client_cancelled", 5000.0, 3, 10.0, None),  # not ours to judge
    ("interactive", "refused", None, 0, 0.0, None),  # the engine refused what the client wrote
    ("standard", "upstream_failed", 900.0, 2, 10.0, "failed"),
    ("standard", "ok", 2500.0, 40, 90.0, "met"),
    ("standard", "ok", 2500.0, 40, 120.0, "tpot"),
    ("batch", "ok", 20000.0, 400, 500.0, None),  # no objective
]


def answer(tenant: Tenant, ended_ago_s: float, row: tuple[Any, ...]) -> UsageEvent:
    tier, status, ttft_ms, tokens, tpot_ms, _ = row
    total_ms = (ttft_ms or 0.0) + tpot_ms * max(0, tokens - 1)
    ended = timezone.now() - timedelta(seconds=ended_ago_s)
    return stored(
        tenant,
        ended - timedelta(milliseconds=total_ms),
        ended_at=ended.timestamp(),
        priority=tier,
        status=status,
        ttft_ms=ttft_ms,
        completion_tokens=tokens,
        total_ms=total_ms,
    )


@pytest.fixture
def acme(db: None) -> Tenant:
    return do_create_tenant("acme", "Acme")


@pytest.fixture
def answers(acme: Tenant) -> list[UsageEvent]:
    # An hour old: outside the overview's five minutes, and each would miss.
    answer(acme, 3600, ("interactive", "ok", 4000.0, 20, 200.0, "ttft"))
    answer(acme, 3600, ("standard", "ok", 9000.0, 20, 200.0, "ttft"))
    return [answer(acme, 10 + index, row) for index, row in enumerate(ANSWERS)]


def test_each_event_has_its_tpot_and_its_outcome_on_both_clocks(answers: list[UsageEvent]) -> None:
    for event, row in zip(answers, ANSWERS, strict=True):
        assert event.slo_outcome == row[5], row
    assert answers[0].tpot_ms == pytest.approx(47.5)
    assert answers[2].tpot_ms is None and answers[5].tpot_ms is None


def test_the_overview_figures_are_the_events_judged_one_by_one(answers: list[UsageEvent]) -> None:
    figures = latency_figures()
    # Judged in SQL as each event judges itself: the share met among those judged.
    for tier in JUDGED_TIERS:
        outcomes = [e.slo_outcome for e in answers if e.priority == tier]
        judged = [o for o in outcomes if o is not None]
        assert figures[f"slo_{tier}"] == pytest.approx(judged.count("met") / len(judged))
    assert figures["slo_interactive"] == pytest.approx(3 / 7)
    assert figures["slo_standard"] == pytest.approx(1 / 3)
    ttfts = [e.ttft_ms for e in answers if e.ttft_ms is not None]
    tpots = [t for e in answers if (t := e.tpot_ms) is not None]
    assert figures["ttft_p99_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert figures["tpot_p50_ms"] == pytest.approx(np.percentile(tpots, 50))
    assert figures["tpot_p99_ms"] == pytest.approx(np.percentile(tpots, 99))


def test_with_no_answers_the_overview_shows_no_figure(db: None) -> None:
    figures = latency_figures()
    assert set(figures) == {
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        *(f"slo_{tier}" for tier in JUDGED_TIERS),
    }
    assert all(value is None for value in figures.values())


def test_the_usage_pages_show_each_answers_tpot_and_the_clock_it_missed(
    answers: list[UsageEvent], acme: Tenant
) -> None:
    staff = client_for(user("ops", is_staff=True))
    page = staff.get("/console/usage/").content.decode()
    owner = client_for(member(acme, "acme-owner", "owner"))
    portal = owner.get("/portal/acme/usage/").content.decode()
    for html in (page, portal):
        assert "TPOT" in html
        assert html.count('<span class="badge ok">met</span>') == 4
        # The hour-old two are listed too: both missed TTFT.
        assert html.count("TPOT missed") == 2 and html.count("TTFT missed") == 4
        assert html.count('<span class="badge bad">failed</span>') == 2
    assert "<td>47.5</td>" in page and "47.5 ms" in portal  # answers[0]'s TPOT
