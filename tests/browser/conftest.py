"""Real Chromium (Debian's, never a downloaded one) driven by Playwright against the whole
ASGI application (Django, Channels and the /v1 gateway) served by uvicorn on a thread.

Each test saves a screenshot under screenshots/ (git-ignored) for a person to look at.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import Browser, Page, sync_playwright

from serving.actions.gpu_classes import sync_gpu_classes
from serving.models import GpuClass
from tests.gateway.conftest import fleet, gateway_server  # noqa: F401  (fixtures)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "screenshots"
PASSWORD = "correct horse battery staple"
T = TypeVar("T")


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if shutil.which(CHROMIUM) is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    # Playwright's sync API keeps an event loop marked running on this thread; the test's
    # own ORM calls are still plain synchronous code, so Django's guard is lifted here.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield chromium
            chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()


@pytest.fixture
def gpu_classes(transactional_db: None) -> None:
    # A transactional test empties every table afterwards, the migration's GPU classes too.
    sync_gpu_classes(GpuClass)


def make_user(username: str, **fields: Any) -> Any:
    return get_user_model().objects.create_user(username, password=PASSWORD, **fields)


def log_in(page: Page, base_url: str, username: str) -> None:
    page.goto(f"{base_url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_load_state()


def widths(page: Page) -> tuple[int, int]:
    """The page's scroll width and its viewport's width, once the document has loaded: a
    click that navigates leaves no document for a moment, and a check then reads nothing."""
    page.wait_for_load_state()
    scroll_width, client_width = page.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    return int(scroll_width), int(client_width)


def assert_fits(page: Page, what: str) -> None:
    scroll_width, client_width = widths(page)
    assert scroll_width <= client_width, f"the {what} page scrolls sideways ({scroll_width} px)"


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def in_thread(work: Callable[[], T]) -> T:
    """Run `work` on a fresh thread, as a Celery worker would: Playwright's event loop owns
    this one, and async_to_sync refuses to run beside it."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result(timeout=30)
