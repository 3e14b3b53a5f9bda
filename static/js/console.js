// Shared helpers for console and portal pages. Page-specific code lives beside each page.
"use strict";
(function () {
  // Decimal places that tell apart ticks `step` apart (uPlot's steps are 1, 2, 2.5, 5 x 10^n).
  function stepDecimals(step) {
    let digits = 0;
    while (digits < 8) {
      const scaled = step * 10 ** digits;
      if (Math.abs(scaled - Math.round(scaled)) <= 1e-9 * Math.max(1, scaled)) break;
      digits += 1;
    }
    return digits;
  }

  // Dollars as the pages' |usd and |usd_rate filters write them (metering/templatetags/money.py):
  // cents from $1 up ("$1,234.56"); below $1 enough decimals for two significant digits
  // ("$0.0061"), at most `maxDecimals`, then "<$0.000001"; a loss as "−$12.34" (U+2212).
  // A rate (`exact`) also keeps the decimals its price has, up to four ("$0.2125").
  function formatUsd(value, maxDecimals = 6, exact = false) {
    const amount = value === null || value === undefined ? NaN : Number(value);
    if (!Number.isFinite(amount)) return "–";
    if (amount === 0) return "$0.00";
    const sign = amount < 0 ? "\u2212" : "";
    const size = Math.abs(amount);
    const floor = 10 ** -maxDecimals;
    if (size < floor) return `${sign}<$${floor.toFixed(maxDecimals)}`;
    let digits = 2;
    if (size < 1) {
      const twoDigits = Number(size.toPrecision(2)); // 0.0996 is 0.10: two decimals, not three
      digits = Math.max(digits, 1 - Math.floor(Math.log10(twoDigits)));
    }
    // The decimals the price has: the fewest that write it back exactly (as Python's repr).
    while (exact && digits < maxDecimals && Number(size.toFixed(digits)) !== size) digits += 1;
    digits = Math.min(digits, maxDecimals);
    return sign + "$" + size.toLocaleString("en-US", {
      minimumFractionDigits: digits, maximumFractionDigits: digits,
    });
  }

  // A tick label: compact from a thousand up (1.2K, 3.4M), dollars with a $ and cents below $1.
  // Ticks are `step` apart, so their decimals follow the step; dollars take formatUsd's sign,
  // "$" and en-US digits.
  function compactNumber(value, step, unit = "") {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    const money = unit === "$";
    const locale = money ? "en-US" : undefined;
    const shown = money ? Math.abs(value) : value;
    const size = Math.abs(value);
    let text;
    if (size >= 1000) {
      const scale = 10 ** (3 * Math.floor(Math.log10(size) / 3));
      const digits = Math.min(2, stepDecimals(Math.abs(step || scale) / scale));
      text = new Intl.NumberFormat(locale, {
        notation: "compact", minimumFractionDigits: 0, maximumFractionDigits: digits,
      }).format(shown);
    } else {
      let digits = stepDecimals(Math.abs(step || 1));
      if (money && digits > 0) digits = Math.max(2, digits);
      text = new Intl.NumberFormat(locale, {
        minimumFractionDigits: digits, maximumFractionDigits: digits,
      }).format(shown);
    }
    if (!money) return text;
    return (value < 0 ? "\u2212$" : "$") + text;
  }

  // uPlot's axis `size` hook: wide enough for the widest tick label, so none is cut off.
  function axisSize(chart, values, axisIdx, cycleNum) {
    const axis = chart.axes[axisIdx];
    // uPlot calls this again until the size settles; past two rounds keep what it has.
    if (cycleNum > 1) return axis._size;
    chart.ctx.font = axis.font[0];
    const widths = (values || []).map((v) => (v === null ? 0 : chart.ctx.measureText(String(v)).width));
    const widest = Math.max(0, ...widths) / (window.devicePixelRatio || 1);
    return Math.ceil(axis.ticks.size + axis.gap + widest + 4);
  }

  window.platformConsole = {
    formatNumber(value, digits = 1) {
      if (value === null || value === undefined || Number.isNaN(value)) return "–";
      return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits });
    },
    compactNumber,
    formatUsd: (value) => formatUsd(value),
    formatUsdRate: (value) => formatUsd(value, 4, true),
    // A value axis for uPlot: compact labels (unit "$" for dollars) and room for all of them.
    valueAxis(unit = "", options = {}) {
      return {
        values: (chart, splits, axisIdx, space, step) =>
          splits.map((v) => (v === null ? null : compactNumber(v, step, unit))),
        size: axisSize,
        ...options,
      };
    },
  };
})();
