"""Retry-After from the admission script's answer: whole seconds, at least 1, and 60 only when
no wait can cure the refusal (a budget)."""

from __future__ import annotations

import pytest

from tenants.limiter import _admission_from_script


def _refusal(retry_after: str) -> list[bytes]:
    # allowed, error, limit, retry_after, 3 request fields, 3 token fields, month tokens, spend
    fields = ["0", "rate_limited", "tokens", retry_after, "", "", "", "", "", "", "0", "0"]
    return [value.encode() for value in fields]


@pytest.mark.parametrize(("wait", "header"), [("0.0", "1"), ("0.2", "1"), ("1.01", "2")])
def test_a_short_wait_is_said_in_whole_seconds_never_as_a_minute(wait: str, header: str) -> None:
    admission = _admission_from_script(_refusal(wait), object(), 0.8, 0, 0)  # type: ignore[arg-type]

    assert admission.headers["retry-after"] == header
    assert admission.retry_after_s == float(wait)


def test_a_refusal_no_wait_cures_says_a_minute() -> None:
    admission = _admission_from_script(_refusal(""), object(), 0.8, 0, 0)  # type: ignore[arg-type]

    assert admission.headers["retry-after"] == "60"
