// Shared helpers for console and portal pages. Page-specific code lives beside each page.
"use strict";
window.platformConsole = {
  formatNumber(value, digits = 1) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits });
  },
};
