/* memprof's page: helpers shared by every part. Every text goes in as text (textContent,
   attributes set as properties), never as markup: names come from files anyone can write. */
"use strict";
const MP = {};

MP.UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
/* Tick steps of a bytes axis: 1, 2, 5, 10, ... of each binary unit (10 MiB, 20 MiB, ...). */
MP.BYTE_STEPS = MP.UNITS.flatMap((_, k) => [1, 2, 5, 10, 20, 50, 100, 200, 500].map((m) => m * 1024 ** k));

/* Bytes as memprof's console writes them: 3.00 GiB, 512 B. */
MP.bytes = function (n) {
  if (n === null || n === undefined) return "n/a";
  let v = Math.abs(n), u = 0;
  while (v >= 1024 && u < MP.UNITS.length - 1) { v /= 1024; u++; }
  const sign = n < 0 ? "-" : "";
  return u === 0 ? sign + Math.trunc(v) + " B" : sign + v.toFixed(2) + " " + MP.UNITS[u];
};

/* Exact bytes with thousands separators: 10,007,855,104 B. */
/* An axis's tick labels with as many decimals as its step needs (uPlot's own stop at 3). */
MP.ticks = (u, ticks, axis, space, incr) => {
  const decimals = Math.max(0, Math.min(9, Math.ceil(-Math.log10(incr) - 1e-9)));
  return ticks.map((v) => v.toFixed(decimals));
};

MP.exact = (n) => Math.round(n).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",") + " B";
MP.count = (n) => Math.round(n).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
MP.pct = (part, whole) => whole ? (100 * part / whole).toFixed(1) + "%" : "";
MP.signed = (n) => (n > 0 ? "+" : n < 0 ? "\u2212" : "") + MP.bytes(Math.abs(n));

/* An element: el("td", {className: "num"}, "12 B", child, ...); strings become text. */
MP.el = function (tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("aria") || k === "role" || k === "tabindex") node.setAttribute(
      k.replace(/^aria([A-Z])/, (_, c) => "aria-" + c.toLowerCase()), v);
    else node[k] = v;
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
};

MP.css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

MP.swatch = (colour) => MP.el("span", {className: "swatch", style: {background: colour}});

/* The page's categories: key -> {name, colour}, in the report's order. */
MP.categories = function (data) {
  const out = new Map();
  for (const [key, name, colour] of data.categories) out.set(key, {name, colour});
  return out;
};

MP.section = function (parent, title, id) {
  const s = MP.el("section", {id: id || ""}, MP.el("h2", {}, title));
  parent.append(s);
  return s;
};

MP.note = (text, kind) => MP.el("p", {className: "note " + (kind || "")}, text);

MP.cards = function (items) {
  return MP.el("div", {className: "cards"}, items.filter(Boolean).map(([k, v, cls]) =>
    MP.el("div", {className: "card"}, MP.el("div", {className: "v " + (cls || "")}, v),
      MP.el("div", {className: "k"}, k))));
};

/* A table; columns: [{title, num, value(row) -> sort key, cell(row) -> text or node}].
   Sortable: each header is a button. rows may have .children (shown under it, expandable). */
MP.table = function (columns, rows, opts) {
  opts = opts || {};
  const body = MP.el("tbody");
  const state = {col: opts.sortBy ?? -1, desc: true};
  const cell = (c, r) => MP.el("td", {className: c.num ? "num" : "wrap"}, c.cell(r));
  const draw = () => {
    const sorted = rows.slice();
    if (state.col >= 0) {
      const key = columns[state.col].value || columns[state.col].cell;
      sorted.sort((a, b) => {
        const x = key(a), y = key(b);
        const order = typeof x === "number" && typeof y === "number" ? x - y :
          String(x).localeCompare(String(y));
        return state.desc ? -order : order;
      });
    }
    body.replaceChildren();
    for (const r of sorted) {
      const tr = MP.el("tr", {}, columns.map((c) => cell(c, r)));
      body.append(tr);
      if (r.children && r.children.length) {
        const kids = r.children.map((k) => MP.el("tr", {className: "child", hidden: true},
          columns.map((c) => cell(c, k))));
        const open = MP.el("button", {ariaExpanded: "false", title: "show each"},
          "+" + r.children.length);
        open.addEventListener("click", () => {
          const shown = open.getAttribute("aria-expanded") === "true";
          open.setAttribute("aria-expanded", String(!shown));
          open.textContent = (shown ? "+" : "\u2212") + r.children.length;
          kids.forEach((k) => { k.hidden = shown; });
        });
        tr.firstChild.prepend(open, " ");
        body.append(...kids);
      }
    }
  };
  const head = MP.el("tr", {}, columns.map((c, i) => {
    const th = MP.el("th", {className: c.num ? "num" : "", scope: "col"});
    if (opts.sortable === false) { th.textContent = c.title; return th; }
    const b = MP.el("button", {title: "sort by " + c.title}, c.title);
    b.addEventListener("click", () => {
      state.desc = state.col === i ? !state.desc : true;
      state.col = i;
      draw();
    });
    th.append(b);
    return th;
  }));
  draw();
  return MP.el("table", {}, MP.el("thead", {}, head), body);
};

/* Horizontal bars: rows [{label, parts: [{value, colour, title}], text}], on one scale.
   lines: [{value, title}] drawn across every row (a budget). */
MP.bars = function (rows, lines) {
  const top = Math.max(1, ...rows.flatMap((r) => r.parts.map((p) => (p.from || 0) + p.value)),
    ...(lines || []).map((l) => l.value));
  const grid = MP.el("div", {className: "bars", role: "list"});
  for (const r of rows) {
    const track = MP.el("div", {className: "track"});
    for (const p of r.parts) {
      track.append(MP.el("div", {className: "bar", title: p.title || "", style: {
        left: (100 * (p.from || 0) / top) + "%", width: Math.max(0.2, 100 * p.value / top) + "%",
        background: p.colour, opacity: p.opacity ?? 1}}));
    }
    for (const l of lines || []) {
      track.append(MP.el("div", {className: "line", title: l.title,
        style: {left: (100 * l.value / top) + "%"}}));
    }
    grid.append(MP.el("div", {className: "label wrap", role: "listitem"}, r.label), track,
      MP.el("div", {className: "label"}, r.text));
  }
  return grid;
};

/* A packed level of the timeline (series.py): base64 of gzipped, byte-shuffled float64
   deltas, ``columns`` of them. */
MP.unpack = async function (b64, columns) {
  const raw = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const stream = new Blob([raw]).stream().pipeThrough(new DecompressionStream("gzip"));
  const planes = new Uint8Array(await new Response(stream).arrayBuffer());
  const values = planes.length / 8, bytes = new Uint8Array(planes.length);
  for (let j = 0; j < 8; j++) {
    for (let i = 0, from = j * values; i < values; i++) bytes[i * 8 + j] = planes[from + i];
  }
  const all = new Float64Array(bytes.buffer);
  const n = all.length / columns, out = [];
  for (let c = 0; c < columns; c++) {
    const col = all.subarray(c * n, (c + 1) * n);
    for (let i = 1; i < n; i++) col[i] += col[i - 1];
    out.push(col);
  }
  return out;
};

/* The step holding event ``e`` (steps: report.json's, events [start, end)), or null. */
MP.stepOf = function (steps, e) {
  let lo = 0, hi = steps.length - 1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (e < steps[mid].start) hi = mid - 1;
    else if (e >= steps[mid].end) lo = mid + 1;
    else return steps[mid];
  }
  return null;
};

/* The first index of sorted ``xs`` at or above ``v``. */
MP.lower = function (xs, v) {
  let lo = 0, hi = xs.length;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (xs[mid] < v) lo = mid + 1; else hi = mid; }
  return lo;
};
