// The portal's usage charts: cumulative spend this month against the budget, tokens per day.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  const series = JSON.parse(document.getElementById("usage-series").textContent);
  const budget = JSON.parse(document.getElementById("usage-budget").textContent);
  if (!window.uPlot || !series.at.length) {
    document.querySelectorAll(".chart").forEach((el) => { el.textContent = "No usage yet."; el.classList.add("muted"); });
    return;
  }
  const { formatUsd, valueAxis } = window.platformConsole;
  // The legend shows a hovered point's dollars the way the page writes them.
  const dollars = (chart, value) => formatUsd(value);
  const width = (el) => el.clientWidth || 600;
  const spendEl = document.getElementById("spend-chart");
  const spendSeries = [{}, { label: "spend this month", value: dollars, stroke: "#2357d9", fill: "rgba(35,87,217,.08)" }];
  const spendData = [series.at, series.cumulative];
  if (budget !== null) {
    spendSeries.push({ label: "budget", value: dollars, stroke: "#c53030", dash: [6, 4] });
    spendData.push(series.at.map(() => budget));
  }
  const charts = [
    [new uPlot({
      width: width(spendEl), height: 220, series: spendSeries, axes: [{}, valueAxis("$")],
    }, spendData, spendEl), spendEl],
  ];
  const tokensEl = document.getElementById("tokens-chart");
  charts.push([new uPlot({
    width: width(tokensEl), height: 200,
    series: [{}, { label: "tokens", stroke: "#1a7f4b", fill: "rgba(26,127,75,.1)", paths: uPlot.paths.bars({ size: [0.6] }) }],
    // Half a day either side, so the first and last days' bars are drawn whole.
    scales: { x: { time: true, range: (chart, min, max) => [min - 43200, max + 43200] } },
    axes: [{}, valueAxis()],
  }, [series.at, series.tokens], tokensEl), tokensEl]);
  charts.forEach(([chart, el]) => { el.uplot = chart; });
  window.addEventListener("resize", () => charts.forEach(([c, el]) => c.setSize({ width: width(el), height: c.height })));
});
