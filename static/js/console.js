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

  // A tick label: compact from a thousand up (1.2K, 3.4M), dollars with a $ and cents below $1.
  function compactNumber(value, step, unit = "") {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    const money = unit === "$" ? { style: "currency", currency: "USD" } : {};
    const size = Math.abs(value);
    if (size >= 1000) {
      const scale = 10 ** (3 * Math.floor(Math.log10(size) / 3));
      const digits = Math.min(2, stepDecimals(Math.abs(step || scale) / scale));
      return new Intl.NumberFormat(undefined, {
        ...money, notation: "compact", minimumFractionDigits: 0, maximumFractionDigits: digits,
      }).format(value);
    }
    let digits = stepDecimals(Math.abs(step || 1));
    if (money.style && digits > 0) digits = Math.max(2, digits);
    return new Intl.NumberFormat(undefined, {
      ...money, minimumFractionDigits: digits, maximumFractionDigits: digits,
    }).format(value);
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
