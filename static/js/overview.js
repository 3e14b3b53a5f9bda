// The live overview: one WebSocket to the `fleet-live` group; each message is a snapshot.
// The chart starts from the recent history embedded in the page, then grows with each one.
"use strict";
(function () {
  const { formatNumber: fmt, formatUsd, formatUsdRate, valueAxis } = window.platformConsole;
  const MONEY = { usd: formatUsd, usd_rate: formatUsdRate };
  const GPU_STATES = ["ready", "starting", "draining", "failed", "idle", "unavailable"];
  const history = { at: [], tokens: [], queue: [] };
  const HISTORY_POINTS = 300;
  let chart = null;

  function setStatus(state, text) {
    const badge = document.getElementById("live-status");
    badge.dataset.state = state;
    badge.textContent = text;
    badge.className = "badge " + (state === "live" ? "ok" : state === "closed" ? "bad" : "warn");
  }

  function renderFigures(snapshot) {
    document.querySelectorAll("[data-live]").forEach((el) => {
      let value = snapshot[el.dataset.live];
      if (value !== null && value !== undefined && el.dataset.scale) value *= Number(el.dataset.scale);
      if (el.dataset.money) {
        el.textContent = MONEY[el.dataset.money](value);
        return;
      }
      const digits = el.dataset.digits !== undefined ? Number(el.dataset.digits) : 1;
      const shown = fmt(value, digits);
      el.textContent = shown === "–" ? shown : shown + (el.dataset.unit || "");
    });
  }

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function renderGpus(gpus) {
    const body = document.querySelector("#gpu-table tbody");
    body.replaceChildren();
    for (const [name, counts] of Object.entries(gpus)) {
      const tr = document.createElement("tr");
      tr.append(cell(name), ...GPU_STATES.map((s) => cell(counts[s] || 0)));
      body.append(tr);
    }
  }

  function renderReplicas(rows) {
    const body = document.querySelector("#replica-table tbody");
    body.replaceChildren();
    for (const r of rows) {
      const tr = document.createElement("tr");
      tr.dataset.replica = r.id;
      const link = document.createElement("a");
      link.href = `/console/fleet/replicas/${r.id}/`;
      link.textContent = r.id;
      const idCell = document.createElement("td");
      idCell.append(link);
      const badge = document.createElement("span");
      badge.className = `badge state-${r.state}`;
      badge.textContent = r.state;
      const stateCell = document.createElement("td");
      stateCell.append(badge);
      tr.append(idCell, cell(r.model), cell(r.pool), cell(r.node), stateCell,
        cell(r.running), cell(r.waiting), cell(fmt(r.kv * 100, 0) + " %"));
      body.append(tr);
    }
    if (!rows.length) {
      const tr = document.createElement("tr");
      const td = cell("No replicas.");
      td.colSpan = 8;
      td.className = "muted";
      tr.append(td);
      body.append(tr);
    }
  }

  function addPoint(at, tokens, queue) {
    // uPlot needs x in order; a broadcast that raced the page's own snapshot is dropped.
    if (history.at.length && at <= history.at[history.at.length - 1]) return;
    history.at.push(at);
    history.tokens.push(tokens);
    history.queue.push(queue);
    for (const series of Object.values(history)) {
      if (series.length > HISTORY_POINTS) series.shift();
    }
  }

  function loadHistory(recent) {
    recent.at.forEach((at, i) => addPoint(at, recent.tokens_per_s[i], recent.queue_depth[i]));
  }

  function renderChart(snapshot) {
    addPoint(snapshot.at, snapshot.tokens_per_s, snapshot.queue_depth);
    const target = document.getElementById("fleet-chart");
    if (!window.uPlot || !target) return;
    const data = [history.at, history.tokens, history.queue];
    if (!chart) {
      chart = new uPlot({
        width: target.clientWidth || 600, height: 220,
        // The page's and the socket's first snapshots have no token rate (it needs two
        // broadcasts): the line runs across them instead of breaking.
        series: [{}, { label: "tokens/s", stroke: "#2357d9", spanGaps: true }, { label: "waiting", stroke: "#b7791f", scale: "q" }],
        axes: [{}, valueAxis("", { label: "tokens/s" }),
          valueAxis("", { side: 1, scale: "q", label: "waiting", grid: { show: false } })],
      }, data, target);
      target.uplot = chart;
      window.addEventListener("resize", () => chart.setSize({ width: target.clientWidth, height: 220 }));
    } else {
      chart.setData(data);
    }
  }

  function render(snapshot) {
    renderFigures(snapshot);
    renderGpus(snapshot.gpus);
    renderReplicas(snapshot.replicas);
    renderChart(snapshot);
    document.body.dataset.fleetAt = snapshot.at;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/console/ws/fleet`);
    socket.onopen = () => setStatus("live", "live");
    socket.onmessage = (message) => render(JSON.parse(message.data));
    socket.onclose = () => {
      setStatus("closed", "reconnecting…");
      setTimeout(connect, 3000);
    };
  }

  document.addEventListener("DOMContentLoaded", () => {
    loadHistory(JSON.parse(document.getElementById("fleet-history").textContent));
    render(JSON.parse(document.getElementById("fleet-initial").textContent));
    connect();
  });
})();
