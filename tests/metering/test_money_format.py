"""Dollars on pages (metering/templatetags/money.py, and console.js for what the browser draws):
one format for every amount and price, small figures shown non-zero, a loss with a real minus."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from collections.abc import Callable
from decimal import Decimal

import pytest
from django.conf import settings
from django.template import Context, Template
from hypothesis import given
from hypothesis import strategies as st

from metering.templatetags.money import MINUS, format_usd, format_usd_rate

Money = Decimal | float | int


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "–"),
        (0, "$0.00"),
        (Decimal("0.000000"), "$0.00"),
        (-0.0, "$0.00"),
        (1, "$1.00"),
        (Decimal("1234.56"), "$1,234.56"),
        (Decimal("1234.555"), "$1,234.56"),
        (1_000_000, "$1,000,000.00"),
        (0.5, "$0.50"),
        (0.061, "$0.061"),
        (Decimal("0.0061"), "$0.0061"),
        (0.000012, "$0.000012"),
        (Decimal("0.000001"), "$0.000001"),
        (Decimal("0.00000099"), "<$0.000001"),
        (Decimal("-0.0000004"), "−<$0.000001"),
        (Decimal("-12.34"), "−$12.34"),
        (-0.0061, "−$0.0061"),
        # Rounded to two significant digits first: 0.0996 is $0.10, not $0.100.
        (Decimal("0.0996"), "$0.10"),
        (Decimal("0.996"), "$1.00"),
        (Decimal("0.12345"), "$0.12"),
        (float("nan"), "–"),
    ],
)
def test_an_amount_is_shown_with_cents_or_two_significant_digits(
    value: Money | None, shown: str
) -> None:
    assert format_usd(value) == shown


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "–"),
        (0, "$0.00"),
        (Decimal("2.4900"), "$2.49"),  # a pool's price per GPU-hour, stored with 4 decimals
        (Decimal("0.150000"), "$0.15"),  # a price sheet's $/Mtok, stored with 6
        (Decimal("0.2125"), "$0.2125"),
        (Decimal("0.0375"), "$0.0375"),
        (Decimal("1.125"), "$1.125"),
        (Decimal("0.061"), "$0.061"),
        (Decimal("0.00061"), "$0.0006"),
        (Decimal("0.123456"), "$0.1235"),
        (Decimal("0.00004"), "<$0.0001"),
        (Decimal("1234.5"), "$1,234.50"),
        (Decimal("-3.5"), "−$3.50"),
    ],
)
def test_a_price_per_unit_is_shown_with_two_to_four_decimals(
    value: Money | None, shown: str
) -> None:
    assert format_usd_rate(value) == shown


def test_the_filters_format_what_a_template_hands_them() -> None:
    page = Template(
        "{% load money %}{{ price|usd }} {{ loss|usd }} {{ sheet|usd_rate }} {{ missing|usd }}"
    ).render(Context({"price": Decimal("0.006100"), "loss": -12.34, "sheet": Decimal("0.0375")}))
    assert page == "$0.0061 −$12.34 $0.0375 –"


def parse(shown: str) -> tuple[int, Decimal, int]:
    """The sign, the figure and the decimals a formatted string shows."""
    sign = -1 if shown.startswith(MINUS) else 1
    digits = shown.removeprefix(MINUS).removeprefix("<").removeprefix("$").replace(",", "")
    return sign, sign * Decimal(digits), len(digits.partition(".")[2])


amounts = st.one_of(
    st.decimals(min_value=-(10**9), max_value=10**9, allow_nan=False, places=8),
    st.floats(min_value=-1e9, max_value=1e9, allow_nan=False),
    st.integers(min_value=-(10**12), max_value=10**12),
)


@pytest.mark.parametrize(("format_money", "most_decimals"), [(format_usd, 6), (format_usd_rate, 4)])
@given(value=amounts)
def test_a_figure_is_within_half_its_last_digit_and_never_zero_unless_it_is(
    format_money: Callable[[Money], str], most_decimals: int, value: Money
) -> None:
    exact = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
    shown = format_money(value)
    sign, figure, decimals = parse(shown)
    assert 2 <= decimals <= most_decimals
    if exact == 0:
        assert shown == "$0.00"
        return
    assert shown != "$0.00" and figure != 0
    assert sign == (-1 if exact < 0 else 1)
    if "<" in shown:
        # Too small for the last decimal: it says so instead of rounding to zero.
        assert abs(exact) < Decimal(1).scaleb(-most_decimals) == abs(figure)
    else:
        assert abs(figure - exact) <= Decimal(1).scaleb(-decimals) / 2


NODE = shutil.which("node")
FORMAT_IN_NODE = """
global.window = {};
eval(require("fs").readFileSync("static/js/console.js", "utf8"));
const { formatUsd, formatUsdRate } = window.platformConsole;
const values = JSON.parse(require("fs").readFileSync(0, "utf8"));
console.log(JSON.stringify(values.map((v) => [formatUsd(v), formatUsdRate(v)])));
"""


@pytest.mark.skipif(NODE is None, reason="needs Node.js to run static/js/console.js")
def test_the_browser_writes_dollars_the_way_the_pages_do() -> None:
    draw = random.Random(7)
    values: list[float | None] = [None, 0, -12.34, 0.0061, 0.0996, 0.2125, 1.005, 4e-7, -4e-5]
    values += [
        round(draw.uniform(-2, 2) * 10 ** draw.randint(-7, 6), draw.randint(0, 9))
        for _ in range(2000)
    ]
    assert NODE is not None
    reply = subprocess.run(
        [NODE, "-e", FORMAT_IN_NODE],
        input=json.dumps(values),
        capture_output=True,
        text=True,
        check=True,
        cwd=settings.BASE_DIR,
        timeout=30,
    )
    in_browser = [tuple(pair) for pair in json.loads(reply.stdout)]
    assert in_browser == [(format_usd(v), format_usd_rate(v)) for v in values]
