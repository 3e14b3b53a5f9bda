"""Every console and portal page, on the demo's data, fits a 390 px phone screen.

The pages are found, not listed: every GET route under /console/ and /portal/ that takes no
argument but a tenant's slug, and the detail pages of what the demo seeds (a tenant's key, a
rollout) — so a page added later is checked without a line here. A route that answers 405 is
a form's POST target; one that does not answer HTML (the usage CSV) has nothing to lay out.
"""

from __future__ import annotations

import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.urls import URLPattern, URLResolver, get_resolver
from playwright.sync_api import Page
from pytest_django import Settings

from registry.models import Rollout
from tenants.models import ApiKey
from tests.browser.conftest import PASSWORD, in_thread, log_in, widths
from tests.gateway.conftest import GatewayServer

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SLUG_PARAMETER = re.compile(r"<slug:(slug|tenant_slug)>")
ANY_PARAMETER = re.compile(r"<[^>]+>")


def _routes(patterns: list[URLPattern | URLResolver], prefix: str = "") -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            found += _routes(list(pattern.url_patterns), route)
        else:
            found.append(route)
    return found


def page_paths(tenant: str) -> list[str]:
    """The console's and portal's GET routes a tenant's slug fills, as paths."""
    paths = []
    for route in _routes(list(get_resolver().url_patterns)):
        if not route.startswith(("console/", "portal/")):
            continue
        filled = SLUG_PARAMETER.sub(tenant, route)
        if ANY_PARAMETER.search(filled) or "^" in filled or "(?P" in filled:
            continue
        paths.append("/" + filled)
    return sorted(set(paths))


@pytest.fixture
def demo(gpu_classes: None, tmp_path: Path, settings: Settings, redis_client: Any) -> None:
    settings.PLATFORM_VAR_DIR = tmp_path
    in_thread(lambda: call_command("seed_demo", stdout=StringIO()))
    for username in ("admin", "acme-owner"):
        user = get_user_model().objects.get(username=username)
        user.set_password(PASSWORD)
        user.save()


def test_every_console_and_portal_page_fits_a_390_px_screen(
    gateway_server: GatewayServer, demo: None, page: Page
) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    key = ApiKey.objects.filter(tenant__slug="acme").first()
    assert key is not None
    details = [f"/console/tenants/acme/keys/{key.pk}/"]
    details += [f"/console/rollouts/{r.pk}/" for r in Rollout.objects.all()[:1]]
    checked: list[str] = []
    too_wide: list[str] = []
    for username, prefix in (("admin", "/console/"), ("acme-owner", "/portal/")):
        log_in(page, gateway_server.url, username)
        paths = [p for p in page_paths("acme") + details if p.startswith(prefix)]
        for path in paths:
            # Asked first with the page's cookies: a POST target's empty 405 is no page.
            probe = page.request.get(f"{gateway_server.url}{path}", max_redirects=0)
            if probe.status == 405 or "text/html" not in probe.headers.get("content-type", ""):
                continue
            assert probe.status == 200, f"{path} answered {probe.status}"
            page.goto(f"{gateway_server.url}{path}")
            scroll_width, client_width = widths(page)  # once loaded
            checked.append(path)
            if scroll_width > client_width:
                too_wide.append(f"{path} ({scroll_width} px wide)")
        page.context.clear_cookies()
    # The pages a newcomer opens first are among those checked: the finder found the routes.
    assert {"/console/", "/console/fleet/", "/console/models/", "/console/rollouts/"} <= set(
        checked
    )
    assert {"/portal/acme/", "/portal/acme/playground/"} <= set(checked)
    print("checked at 390 px:", ", ".join(checked))
    assert too_wide == [], "pages that scroll sideways at 390 px: " + ", ".join(too_wide)
