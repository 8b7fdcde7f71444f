"use strict";
// The page's behaviour: flame graph tabs (each inferno SVG in a frame of its own), the
// charts' read-out, sortable tables. Any script error is shown on the page and counted in
// body[data-errors], so that a test in a real browser sees it.
(function () {
  const errors = [];
  function fail(message) {
    errors.push(message);
    const box = document.getElementById("errors");
    box.hidden = false;
    box.textContent = errors.join("\n");
    document.body.dataset.errors = String(errors.length);
  }
  window.addEventListener("error", (e) => fail("error: " + e.message));
  window.addEventListener("unhandledrejection", (e) => fail("unhandled rejection: " + e.reason));

  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  function bytes(n) {
    let v = n, u = 0;
    while (v >= 1024 && u + 1 < units.length) { v /= 1024; u++; }
    return u === 0 ? n + " B" : v.toFixed(1) + " " + units[u];
  }
  function duration(ns) {
    if (ns < 1e3) return ns + "ns";
    if (ns < 1e6) return (ns / 1e3).toFixed(1) + "µs";
    if (ns < 1e9) return (ns / 1e6).toFixed(1) + "ms";
    return (ns / 1e9).toFixed(1) + "s";
  }

  // Flame graphs.
  const data = JSON.parse(document.getElementById("flamegraph-data").textContent);
  const frame = document.getElementById("flame");
  const empty = document.getElementById("flame-empty");
  // The domains in the order of their buttons (user first).
  const domains = Array.from(document.querySelectorAll("button[data-domain]"), (b) => b.dataset.domain)
    .filter((d) => d in data);
  const params = new URLSearchParams(location.hash.slice(1));
  let view = params.get("flame") || "bytes";
  let domain = domains.includes(params.get("domain")) ? params.get("domain") : domains[0];
  // Each SVG is deflated in the page's data: inflated once, when first shown.
  const inflated = new Map();
  function svgOf(key, packed) {
    if (!inflated.has(key)) {
      const bytes = Uint8Array.from(atob(packed), (c) => c.charCodeAt(0));
      const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
      inflated.set(key, new Response(stream).text());
    }
    return inflated.get(key);
  }
  // The tab chosen last wins over an earlier one still inflating.
  let shown = 0;
  function show() {
    for (const b of document.querySelectorAll("[data-view]")) b.setAttribute("aria-selected", String(b.dataset.view === view));
    for (const b of document.querySelectorAll("[data-domain]")) {
      if (b.tagName === "BUTTON") b.setAttribute("aria-selected", String(b.dataset.domain === domain));
    }
    const f = data[domain] && data[domain][view];
    frame.dataset.view = view;
    frame.dataset.domain = domain;
    delete frame.dataset.frames;
    const ticket = ++shown;
    if (!f || !f.svgz) {
      frame.hidden = true;
      empty.hidden = false;
      empty.textContent = f ? f.empty : "No flame graph.";
      return;
    }
    frame.hidden = false;
    empty.hidden = true;
    frame.style.height = f.height + 2 + "px";
    svgOf(domain + "/" + view, f.svgz).then((svg) => {
      if (ticket !== shown) return;
      frame.srcdoc = "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><style>html,body{margin:0}svg{display:block;width:100%}</style></head><body>" +
        svg + "</body></html>";
    }, (e) => fail("flame graph: " + e));
  }
  frame.addEventListener("load", () => {
    if (!frame.srcdoc) return;
    try {
      const doc = frame.contentDocument;
      frame.contentWindow.addEventListener("error", (e) => fail("flame graph: " + e.message));
      const frames = doc.getElementById("frames");
      frame.dataset.frames = String(frames ? frames.children.length : 0);
      const svg = doc.querySelector("svg");
      if (svg) frame.style.height = Math.ceil(svg.getBoundingClientRect().height) + 2 + "px";
    } catch (e) {
      fail("flame graph frame: " + e);
    }
  });
  for (const b of document.querySelectorAll("button[data-view]")) {
    b.addEventListener("click", () => { view = b.dataset.view; show(); });
  }
  for (const b of document.querySelectorAll("button[data-domain]")) {
    b.addEventListener("click", () => { domain = b.dataset.domain; show(); });
  }
  if (domains.length) show();

  // Memory over time: what each interval held, under the pointer.
  for (const fig of document.querySelectorAll("figure.chart")) {
    const svg = fig.querySelector("svg");
    const readout = fig.querySelector(".readout");
    const values = fig.dataset.values.split(" ").map(Number);
    const width = Number(fig.dataset.width), left = Number(fig.dataset.left), right = Number(fig.dataset.right);
    const interval = Number(fig.dataset.intervalNs);
    const cursor = document.createElementNS("http://www.w3.org/2000/svg", "line");
    cursor.setAttribute("stroke", "#444");
    cursor.setAttribute("stroke-width", "1");
    cursor.setAttribute("visibility", "hidden");
    svg.appendChild(cursor);
    svg.addEventListener("mousemove", (e) => {
      const box = svg.getBoundingClientRect();
      const x = (e.clientX - box.left) * width / box.width;
      const i = Math.floor((x - left) / (right - left) * values.length);
      if (i < 0 || i >= values.length) { readout.hidden = true; cursor.setAttribute("visibility", "hidden"); return; }
      const cx = left + (i + 0.5) * (right - left) / values.length;
      for (const [k, v] of [["x1", cx], ["x2", cx], ["y1", 12], ["y2", svg.viewBox.baseVal.height - 40]]) cursor.setAttribute(k, v);
      cursor.setAttribute("visibility", "visible");
      readout.hidden = false;
      readout.textContent = duration(i * interval) + "–" + duration((i + 1) * interval) + ": " + bytes(values[i]) + " live" +
        (String(i) === fig.dataset.peakInterval ? " (the peak)" : "");
    });
    svg.addEventListener("mouseleave", () => { readout.hidden = true; cursor.setAttribute("visibility", "hidden"); });
  }

  // Sortable tables: numbers largest first, text A to Z; click again to reverse.
  for (const table of document.querySelectorAll("table.sortable")) {
    const heads = Array.from(table.tHead.rows[0].cells);
    heads.forEach((th, column) => th.addEventListener("click", () => {
      const text = th.dataset.sort === "text";
      const current = th.getAttribute("aria-sort");
      // First click: numbers largest first, text A to Z; then each click reverses.
      const down = current ? current === "ascending" : !text;
      for (const h of heads) h.removeAttribute("aria-sort");
      th.setAttribute("aria-sort", down ? "descending" : "ascending");
      const key = (row) => {
        const cell = row.cells[column];
        return text ? (cell.dataset.value || cell.textContent) : Number(cell.dataset.value);
      };
      const rows = Array.from(table.tBodies[0].rows);
      rows.sort((a, b) => {
        const x = key(a), y = key(b);
        const order = text ? String(x).localeCompare(String(y)) : x - y;
        return down ? -order : order;
      });
      for (const r of rows) table.tBodies[0].appendChild(r);
    }));
  }
  document.body.dataset.ready = "1";
})();
