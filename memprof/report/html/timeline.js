/* The timeline: memory over time, stacked by category, with allocated and reserved lines,
   the card's capacity and a budget, the steps and the peak. The page holds the series at
   several resolutions (series.py); each zoom draws the coarsest that shows every bucket. */
"use strict";

MP.MAX_POINTS = 6000; // points drawn at once: a few per pixel of a wide chart

/* One device's series: its levels, unpacked when first needed. */
MP.Series = class {
  constructor(tl) {
    this.tl = tl;
    this.timed = tl.x === "seconds";
    this.cache = new Map();
  }

  /* Level ``i`` as {pos, x, values: {name: Float64Array}}. */
  async level(i) {
    if (!this.cache.has(i)) {
      const tl = this.tl, timed = this.timed;
      this.cache.set(i, MP.unpack(tl.levels[i].data, 1 + (timed ? 1 : 0) + tl.series.length)
        .then((cols) => {
          const pos = cols[0], x = new Float64Array(pos.length);
          for (let k = 0; k < pos.length; k++) {
            x[k] = timed ? (cols[1][k] - tl.t0_us) / 1e6 : pos[k] - 1;
          }
          const values = {};
          tl.series.forEach((name, s) => { values[name] = cols[1 + (timed ? 1 : 0) + s]; });
          return {pos, x, values};
        }));
    }
    return this.cache.get(i);
  }

  loaded(i) { return this.cache.get(i); }
};

/* The chart of one device: ``dev`` is the page's device entry, ``opts.budget`` a line. */
MP.Timeline = class {
  constructor(parent, dev, page, opts) {
    this.dev = dev;
    this.report = dev.report;
    this.page = page;
    this.opts = opts || {};
    this.series = new MP.Series(dev.timeline);
    this.cats = MP.categories(page);
    this.stacked = dev.timeline.series.filter((s) => this.cats.has(s));
    this.box = MP.el("div", {className: "chart", tabindex: "0", role: "img",
      ariaLabel: "memory over time; arrow keys pan, + and - zoom, 0 resets, p goes to the peak"});
    this.tip = MP.el("div", {className: "tip", role: "status"});
    this.tools = this._tools();
    this.legend = this._legend();
    parent.append(this.tools, this.box, this.legend);
    this.box.append(this.tip);
  }

  async draw() {
    const first = await this.series.level(0), xs = first.x;
    this.full = [xs[0], xs[xs.length - 1] > xs[0] ? xs[xs.length - 1] : xs[0] + 1];
    this.view = this.full.slice();
    this.plot = new uPlot(this._options(), this._columns(first, 0, xs.length), this.box);
    this.plot.setScale("x", {min: this.full[0], max: this.full[1]});
    this._scaleY();
    this._interact();
    new ResizeObserver(() => this.plot.setSize(this._size())).observe(this.box.parentElement);
    return this;
  }

  _size() {
    const width = Math.max(320, this.box.parentElement.clientWidth - 4);
    return {width, height: Math.round(Math.min(420, Math.max(260, width * 0.36)))};
  }

  _options() {
    const fg = MP.css("--fg"), grid = MP.css("--grid"), tl = this.dev.timeline;
    const step = uPlot.paths.stepped({align: 1});
    const series = [{label: tl.x === "seconds" ? "seconds" : "event"}];
    const bands = [];
    this.stacked.forEach((key, i) => {
      const c = this.cats.get(key);
      series.push({label: c.name, stroke: c.colour, fill: c.colour + "cc", width: 0,
        paths: step, points: {show: false}});
      if (i > 0) bands.push({series: [i + 1, i], fill: c.colour + "cc"});
    });
    const stackedFirst = series.length > 1;
    if (stackedFirst) series[1].fill = this.cats.get(this.stacked[0]).colour + "cc";
    series.push({label: "allocated", stroke: stackedFirst ? fg : this.page.colours.allocated,
      width: stackedFirst ? 1 : 1.5, paths: step, points: {show: false},
      fill: stackedFirst ? undefined : this.page.colours.allocated + "55"});
    series.push({label: "reserved", stroke: MP.css("--reserved"), width: 1, paths: step,
      points: {show: false}});
    if (bands.length) for (const b of bands) b.fill = series[b.series[0]].fill;
    const axis = {stroke: fg, grid: {stroke: grid}, ticks: {stroke: grid}};
    return {
      ...this._size(), series, bands: bands.length ? bands : undefined,
      legend: {show: false},
      scales: {x: {time: false, auto: false}, y: {auto: false}},
      axes: [{...axis, label: tl.x === "seconds" ? "seconds since the first recorded event" :
        "event", values: MP.ticks}, {...axis, size: 88, incrs: MP.BYTE_STEPS, values: (u, ticks) => ticks.map(MP.bytes)}],
      cursor: {dataIdx: (u, s, closest, xValue) => this._pick(u, closest, xValue),
        drag: {x: true, y: false}},
      hooks: {draw: [(u) => this._marks(u)], setCursor: [(u) => this._hover(u)],
        setScale: [(u, key) => { if (key === "x") this._zoomed(u); }]},
    };
  }

  /* The y range: up to the highest reserved, the budget and the capacity when shown. */
  _scaleY() {
    let top = Math.max(this.report.peak.reserved_bytes, this.report.peak.allocated_bytes);
    if (this.opts.budget) top = Math.max(top, this.opts.budget);
    if (this.showCapacity && this.dev.capacity_bytes) top = Math.max(top, this.dev.capacity_bytes);
    this.plot.setScale("y", {min: 0, max: top * 1.05 || 1});
  }

  /* Level data [from, to) as uPlot's columns: x, cumulative stacks, allocated, reserved. */
  _columns(lv, from, to) {
    const out = [lv.x.subarray(from, to)];
    let below = null;
    for (const key of this.stacked) {
      const v = lv.values[key].subarray(from, to);
      const sum = below ? v.map((y, k) => y + below[k]) : Float64Array.from(v);
      out.push(sum);
      below = sum;
    }
    out.push(lv.values.allocated.subarray(from, to), lv.values.reserved.subarray(from, to));
    this.shown = {lv, from};
    return out;
  }

  /* The point under the cursor: of those within a pixel, the one with most allocated. */
  _pick(u, closest, xValue) {
    if (closest === null || closest === undefined) return closest;
    const xs = u.data[0], px = u.posToVal(1, "x") - u.posToVal(0, "x");
    const alloc = u.data[u.data.length - 2];
    let best = closest;
    const lo = MP.lower(xs, xValue - px), hi = MP.lower(xs, xValue + px);
    for (let k = lo; k < hi && k < xs.length; k++) if (alloc[k] > alloc[best]) best = k;
    return best;
  }

  _hover(u) {
    const i = u.cursor.idxs[0]; // `_pick`'s choice (cursor.idx is the closest point)
    if (i === null || i === undefined || u.cursor.left < 0) { this.tip.style.display = "none"; return; }
    const lv = this.shown.lv, k = this.shown.from + i;
    const event = lv.pos[k] - 1, r = this.report;
    const step = MP.stepOf(r.steps || [], event);
    const rows = [["allocated", MP.bytes(lv.values.allocated[k]), MP.exact(lv.values.allocated[k])],
      ["reserved", MP.bytes(lv.values.reserved[k]), MP.exact(lv.values.reserved[k])]];
    for (const key of this.stacked.slice().reverse()) {
      rows.push([this.cats.get(key), MP.bytes(lv.values[key][k]), ""]);
    }
    const when = this.dev.timeline.x === "seconds" ? lv.x[k].toFixed(6) + " s, " : "";
    this.tip.replaceChildren(
      MP.el("div", {}, when + (event < 0 ? "before the first event" : "event " + MP.count(event)) +
        (step ? ", step " + step.step : "") + (event === r.peak.event_index ? " \u2014 the peak" : "")),
      MP.el("table", {}, rows.map(([label, human, exact]) => MP.el("tr", {},
        MP.el("td", {}, typeof label === "string" ? label : [MP.swatch(label.colour), label.name]),
        MP.el("td", {className: "num"}, human), MP.el("td", {className: "num muted"}, exact)))));
    const over = u.over.getBoundingClientRect(), box = this.box.getBoundingClientRect();
    const left = u.cursor.left + over.left - box.left, w = this.box.clientWidth;
    this.tip.style.display = "block";
    this.tip.style.top = (over.top - box.top + 8) + "px";
    this.tip.style.left = (left + 14 + this.tip.offsetWidth > w ? left - 14 - this.tip.offsetWidth
      : left + 14) + "px";
  }

  /* Steps, the peak, the capacity and the budget, drawn over the series. */
  _marks(u) {
    const ctx = u.ctx, tl = this.dev.timeline, dpr = devicePixelRatio || 1;
    const {left, top, width, height} = u.bbox;
    ctx.save();
    ctx.font = (11 * dpr) + "px system-ui, sans-serif";
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    ctx.lineWidth = dpr;
    const bg = MP.css("--bg");
    const text = (label, x, y, colour) => { // on a backdrop, readable over the series
      ctx.fillStyle = bg;
      ctx.globalAlpha = 0.8;
      ctx.fillRect(x - 2 * dpr, y - 10 * dpr, ctx.measureText(label).width + 4 * dpr, 13 * dpr);
      ctx.globalAlpha = 1;
      ctx.fillStyle = colour;
      ctx.fillText(label, x, y);
    };
    const vline = (x, colour, dash, label, row) => {
      const px = u.valToPos(x, "x", true);
      if (px < left - 1 || px > left + width + 1) return null;
      ctx.strokeStyle = colour; ctx.fillStyle = colour; ctx.setLineDash(dash);
      ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, top + height); ctx.stroke();
      if (label) {
        const w = ctx.measureText(label).width, at = px + 3 * dpr > left + width - w ? px - 3 * dpr - w : px + 3 * dpr;
        text(label, at, top + (12 + 14 * row) * dpr, colour);
      }
      return px;
    };
    let labelled = -Infinity; // step labels at least 60 px apart
    (this.report.steps || []).forEach((s, i) => {
      const px = u.valToPos(tl.step_x[i][1], "x", true);
      const label = px - labelled >= 60 * dpr ? "step " + s.step : "";
      if (vline(tl.step_x[i][1], MP.css("--muted"), [3 * dpr, 3 * dpr], label, 0) !== null && label) labelled = px;
    });
    vline(tl.peak_x, this.page.colours.peak, [dpr, 2 * dpr], "peak " + MP.bytes(this.report.peak.allocated_bytes), 1);
    const hline = (y, colour, label) => {
      const py = u.valToPos(y, "y", true);
      if (py < top || py > top + height) return;
      ctx.strokeStyle = colour; ctx.fillStyle = colour; ctx.setLineDash([6 * dpr, 4 * dpr]);
      ctx.beginPath(); ctx.moveTo(left, py); ctx.lineTo(left + width, py); ctx.stroke();
      text(label, left + width - ctx.measureText(label).width - 4 * dpr, py - 4 * dpr, colour);
    };
    if (this.dev.capacity_bytes) hline(this.dev.capacity_bytes, MP.css("--bad"),
      "card capacity " + MP.bytes(this.dev.capacity_bytes));
    if (this.opts.budget) hline(this.opts.budget, MP.css("--warn"), "budget " + MP.bytes(this.opts.budget));
    ctx.restore();
  }

  /* A new x range (uPlot calls this after each change of scale): draw the finest level
     that fits it, unpacked first if need be. */
  _zoomed(u) {
    const min = u.scales.x.min, max = u.scales.x.max;
    if (min === undefined || max === undefined) return;
    this.view = [min, max];
    if (this.drawn && this.drawn[0] === min && this.drawn[1] === max) return; // our own redraw
    const levels = this.dev.timeline.levels, share = (max - min) / (this.full[1] - this.full[0]);
    let want = 0;
    while (want + 1 < levels.length && levels[want + 1].points * share <= MP.MAX_POINTS) want++;
    this.pending = this.series.level(want).then((lv) => this._show(lv, want, min, max));
  }

  /* Level ``level`` between ``min`` and ``max``, unless the view moved on meanwhile. */
  _show(lv, level, min, max) {
    if (this.view[0] !== min || this.view[1] !== max) return;
    const xs = lv.x;
    const from = Math.max(0, MP.lower(xs, min) - 1), to = Math.min(xs.length, MP.lower(xs, max) + 2);
    this.drawn = [min, max];
    this.plot.setData(this._columns(lv, from, to)); // keeps x (not auto): redraws, calls _zoomed
    this.box.dataset.level = String(level);
  }

  /* Once the last change of scale has been drawn. */
  async settled() {
    await new Promise((done) => setTimeout(done, 0)); // uPlot applies scales in a microtask
    await this.pending;
  }

  /* Zoom by ``factor`` around ``at`` (default: the middle), within the full range. */
  zoom(factor, at) {
    const [lo, hi] = this.view, mid = at ?? (lo + hi) / 2;
    const span = Math.min(this.full[1] - this.full[0], Math.max((hi - lo) * factor, 1e-9));
    let a = mid - (mid - lo) * span / (hi - lo);
    a = Math.max(this.full[0], Math.min(a, this.full[1] - span));
    this.plot.setScale("x", {min: a, max: a + span});
  }

  pan(fraction) {
    const [lo, hi] = this.view, span = hi - lo;
    const a = Math.max(this.full[0], Math.min(lo + span * fraction, this.full[1] - span));
    this.plot.setScale("x", {min: a, max: a + span});
  }

  reset() { this.plot.setScale("x", {min: this.full[0], max: this.full[1]}); }

  /* Zoom around the peak and put the cursor on it. */
  async toPeak() {
    const x = this.dev.timeline.peak_x, span = (this.full[1] - this.full[0]) / 50;
    const lo = Math.max(this.full[0], Math.min(x - span / 2, this.full[1] - span));
    this.plot.setScale("x", {min: lo, max: lo + span});
    await this.settled();
    const left = this.plot.valToPos(x, "x");
    this.plot.setCursor({left, top: this.plot.bbox.height / (2 * (devicePixelRatio || 1))});
  }

  _interact() {
    const over = this.plot.over;
    over.addEventListener("wheel", (e) => {
      e.preventDefault();
      const at = this.plot.posToVal(e.offsetX, "x");
      this.zoom(e.deltaY < 0 ? 0.75 : 1 / 0.75, at);
    }, {passive: false});
    over.addEventListener("mousedown", (e) => { // shift-drag pans; a plain drag zooms
      if (!e.shiftKey) return;
      e.stopPropagation();
      const start = e.clientX, [lo, hi] = this.view, per = (hi - lo) / over.clientWidth;
      const move = (m) => {
        const shift = (start - m.clientX) * per, span = hi - lo;
        const a = Math.max(this.full[0], Math.min(lo + shift, this.full[1] - span));
        this.plot.setScale("x", {min: a, max: a + span});
      };
      const up = () => { removeEventListener("mousemove", move); removeEventListener("mouseup", up); };
      addEventListener("mousemove", move);
      addEventListener("mouseup", up);
    }, true);
    this.box.addEventListener("keydown", (e) => {
      const keys = {ArrowLeft: () => this.pan(-0.2), ArrowRight: () => this.pan(0.2),
        "+": () => this.zoom(0.5), "=": () => this.zoom(0.5), "-": () => this.zoom(2),
        "0": () => this.reset(), Home: () => this.reset(), p: () => this.toPeak()};
      if (keys[e.key]) { e.preventDefault(); keys[e.key](); }
    });
  }

  _tools() {
    const b = (label, title, act) => {
      const button = MP.el("button", {title}, label);
      button.addEventListener("click", act);
      return button;
    };
    const tools = MP.el("div", {className: "chart-tools"},
      b("\u25c0", "pan left (\u2190)", () => this.pan(-0.2)),
      b("+", "zoom in (+)", () => this.zoom(0.5)),
      b("\u2212", "zoom out (-)", () => this.zoom(2)),
      b("\u25b6", "pan right (\u2192)", () => this.pan(0.2)),
      b("reset", "whole timeline (0)", () => this.reset()),
      b("peak", "zoom to the peak (p)", () => this.toPeak()),
      MP.el("span", {className: "muted"}, "drag to zoom, wheel to zoom, shift-drag to pan, double-click to reset"));
    if (this.dev.capacity_bytes) {
      const cap = b("scale to the card", "include the card's capacity in the y range", () => {
        this.showCapacity = !this.showCapacity;
        cap.setAttribute("aria-pressed", String(this.showCapacity));
        this._scaleY();
      });
      cap.setAttribute("aria-pressed", "false");
      tools.append(cap);
    }
    return tools;
  }

  _legend() {
    const items = this.stacked.map((k) => MP.el("span", {}, MP.swatch(this.cats.get(k).colour),
      this.cats.get(k).name));
    items.push(MP.el("span", {}, MP.swatch(MP.css("--reserved")), "reserved"));
    if (!this.stacked.length) items.unshift(MP.el("span", {}, MP.swatch(this.page.colours.allocated), "allocated"));
    if (this.dev.capacity_bytes) items.push(MP.el("span", {className: "muted"}, "card capacity " +
      MP.bytes(this.dev.capacity_bytes)));
    return MP.el("div", {className: "legend"}, items);
  }
};
