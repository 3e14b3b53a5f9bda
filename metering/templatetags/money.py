"""Dollars on pages: `{% load money %}`, then `{{ x|usd }}` for amounts and `{{ x|usd_rate }}`
for prices per unit ($/GPU-hour, $/Mtok).

Pages only: CSV and JSON carry the exact decimal strings. `static/js/console.js`'s
`formatUsd` and `formatUsdRate` follow the same rules for the figures drawn in the browser.

An amount shows cents from $1 up ("$1,234.56") and, below $1, enough decimals for two
significant digits ("$0.50", "$0.061", "$0.0061"), at most six: a request's price is often a
fraction of a cent, and "$0.00" would say it was free. Below the last decimal it reads
"<$0.000001". A price per unit shows 2 to 4 decimals: as many as the price has ("$0.2125",
"$1.125"), and two significant digits where that fits in four. A negative figure has U+2212
before the dollar sign ("−$12.34"); None is "–".
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Context, Decimal, InvalidOperation

from django import template

register = template.Library()

MINUS = "\u2212"
NO_VALUE = "–"
AMOUNT_MAX_DECIMALS = 6
RATE_MAX_DECIMALS = 4

Money = Decimal | float | int


def format_usd(value: Money | None) -> str:
    """An amount of dollars as a page shows it."""
    return _format(value, AMOUNT_MAX_DECIMALS, keep_exact=False)


def format_usd_rate(value: Money | None) -> str:
    """A price per unit as a page shows it."""
    return _format(value, RATE_MAX_DECIMALS, keep_exact=True)


def _format(value: Money | None, max_decimals: int, *, keep_exact: bool) -> str:
    if value is None:
        return NO_VALUE
    # A float through str(): its shortest repr, not its binary expansion (0.1, not 0.1000…0555).
    amount = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
    if not amount.is_finite():
        return NO_VALUE
    if amount.is_zero():
        return "$0.00"
    sign = MINUS if amount < 0 else ""
    size = abs(amount)
    floor = Decimal(1).scaleb(-max_decimals)
    if size < floor:
        return f"{sign}<${floor:f}"
    decimals = 2
    if size < 1:
        # Two significant digits of the value rounded to two: 0.0996 needs 2 decimals (0.10), not 3.
        two_digits = size.quantize(Decimal(1).scaleb(size.adjusted() - 1), rounding=ROUND_HALF_UP)
        decimals = max(decimals, 1 - two_digits.adjusted())
    if keep_exact:
        exponent = size.normalize().as_tuple().exponent
        assert isinstance(exponent, int)  # a finite number's is
        decimals = max(decimals, -exponent)
    decimals = min(decimals, max_decimals)
    # Room for every digit: the default context's 28 would refuse a quantize past that.
    exact = Context(prec=max(28, size.adjusted() + decimals + 2))
    shown = size.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP, context=exact)
    return f"{sign}${shown:,.{decimals}f}"


def _as_money(value: object) -> Money | None:
    """What a template hands the filter: a number, None, or "" for a missing variable."""
    if value is None or isinstance(value, Decimal | float | int):
        return value
    try:
        return Decimal(str(value))
    except InvalidOperation:
        return None


@register.filter(is_safe=True)
def usd(value: object) -> str:
    return format_usd(_as_money(value))


@register.filter(is_safe=True)
def usd_rate(value: object) -> str:
    return format_usd_rate(_as_money(value))
