/* Two runs side by side (memprof check) and advice (memprof suggest). */
"use strict";

/* Event index -> steps: step k's events spread over [k - 1, k); without steps, the share of
   the recording. */
MP.stepCoord = function (report) {
  const steps = report.steps || [], n = Math.max(1, report.events);
  if (!steps.length) return (e) => Math.max(0, e) / n;
  const starts = steps.map((s) => s.start), last = steps[steps.length - 1];
  return (e) => {
    if (e < 0) return 0;
    if (e >= last.end) return steps.length + (e - last.end) / Math.max(1, n - last.end);
    const i = Math.max(0, MP.lower(starts, e + 1) - 1), s = steps[i];
    return i + (e - s.start) / Math.max(1, s.end - s.start);
  };
};

/* Both runs' allocated and reserved lines on one axis of steps. */
MP.CompareChart = class {
  constructor(parent, runs, page) {
    this.runs = runs; // [{label, colour, dev}]
    this.page = page;
    this.box = MP.el("div", {className: "chart", tabindex: "0", role: "img",
      ariaLabel: "both runs' memory, aligned by optimizer step"});
    this.tip = MP.el("div", {className: "tip", role: "status"});
    this.box.append(this.tip);
    parent.append(MP.el("div", {className: "legend"}, runs.map((r) => MP.el("span", {},
      MP.swatch(r.colour), r.label + ": allocated (solid), reserved (thin)"))), this.box);
  }

  async draw() {
    const stepped = this.stepped = this.runs.every((r) => (r.dev.report.steps || []).length);
    const tables = [];
    for (const r of this.runs) {
      const lv = await new MP.Series(r.dev.timeline).level(0);
      const at = stepped ? MP.stepCoord(r.dev.report) : (e) => Math.max(0, e) / Math.max(1, r.dev.report.events);
      const x = Float64Array.from(lv.pos, (p) => at(p - 1));
      for (let k = 1; k < x.length; k++) if (x[k] <= x[k - 1]) x[k] = x[k - 1] + 1e-12;
      tables.push([x, lv.values.allocated, lv.values.reserved]);
    }
    this.data = uPlot.join(tables);
    const fg = MP.css("--fg"), grid = MP.css("--grid");
    const step = uPlot.paths.stepped({align: 1});
    const series = [{label: stepped ? "step" : "share of the recording"}];
    for (const r of this.runs) {
      series.push({label: r.label + " allocated", stroke: r.colour, width: 1.75, paths: step, spanGaps: true, points: {show: false}});
      series.push({label: r.label + " reserved", stroke: r.colour, width: 1, dash: [4, 3], paths: step, spanGaps: true, points: {show: false}});
    }
    const axis = {stroke: fg, grid: {stroke: grid}, ticks: {stroke: grid}};
    const width = Math.max(320, this.box.parentElement.clientWidth - 4);
    this.plot = new uPlot({
      width, height: 300, series, legend: {show: false}, scales: {x: {time: false}},
      axes: [{...axis, values: MP.ticks, label: stepped ? "optimizer steps (each step's events spread over one unit)" :
        "share of the recording (no steps recorded)"}, {...axis, size: 88, incrs: MP.BYTE_STEPS, values: (u, t) => t.map(MP.bytes)}],
      cursor: {drag: {x: true, y: false}}, hooks: {setCursor: [(u) => this._hover(u)]},
    }, this.data, this.box);
    return this;
  }

  /* The last value at or before index ``i`` of series ``s`` (a run has no point at every x). */
  _at(s, i) {
    const col = this.data[s];
    while (i >= 0 && (col[i] === null || col[i] === undefined)) i--;
    return i < 0 ? null : col[i];
  }

  _hover(u) {
    const i = u.cursor.idx;
    if (i === null || i === undefined || u.cursor.left < 0) { this.tip.style.display = "none"; return; }
    const rows = this.runs.map((r, k) => MP.el("tr", {}, MP.el("td", {}, MP.swatch(r.colour), r.label),
      MP.el("td", {className: "num"}, MP.bytes(this._at(1 + 2 * k, i))),
      MP.el("td", {className: "num muted"}, MP.bytes(this._at(2 + 2 * k, i)) + " reserved")));
    const x = this.data[0][i];
    const steps = Math.max(...this.runs.map((r) => (r.dev.report.steps || []).length));
    const where = !this.stepped ? Math.round(100 * x) + "% into the recording" :
      Math.floor(x) >= steps ? "after the last step" :
        "in step " + (Math.floor(x) + 1) + " (" + Math.round(100 * (x % 1)) + "% through)";
    this.tip.replaceChildren(MP.el("div", {}, where), MP.el("table", {}, rows));
    const over = u.over.getBoundingClientRect(), box = this.box.getBoundingClientRect();
    const left = u.cursor.left + over.left - box.left;
    this.tip.style.display = "block";
    this.tip.style.top = (over.top - box.top + 8) + "px";
    this.tip.style.left = (left + 14 + this.tip.offsetWidth > this.box.clientWidth ?
      left - 14 - this.tip.offsetWidth : left + 14) + "px";
  }
};

MP.RUN_COLOURS = {baseline: "#7f7f7f", current: "#1f77b4"};

/* A table of what two runs hold, by name: rows [{name, baseline, current}]. */
MP.diffTable = function (title, rows, nameCell) {
  return MP.table([
    {title, value: (r) => r.name, cell: nameCell || ((r) => MP.el("span", {className: "mono"}, r.name))},
    {title: "baseline", num: true, value: (r) => r.baseline, cell: (r) => MP.bytes(r.baseline)},
    {title: "current", num: true, value: (r) => r.current, cell: (r) => MP.bytes(r.current)},
    {title: "change", num: true, value: (r) => r.current - r.baseline, cell: (r) => MP.signed(r.current - r.baseline)},
  ], rows, {sortBy: 3});
};

MP.checkPage = async function (main, page) {
  const v = page.verdict, [base, cur] = page.runs;
  main.append(MP.note(page.text, v.verdict === "regression" ? "bad" : "good"));
  main.append(MP.el("p", {className: "muted wrap"}, "baseline: " + base.path + "; current: " + cur.path +
    "; metric " + v.metric + ", limit " + v.max_increase));
  const cats = MP.categories(page);
  const find = (run, d) => run.devices.find((x) => x.report.device === d.device && x.report.rank === d.rank);
  for (const d of v.devices) {
    const b = find(base, d), c = find(cur, d);
    const s = MP.section(main, "Device " + d.device + (d.rank === null ? "" : ", rank " + d.rank) + ": " + d.verdict);
    s.append(MP.cards([["baseline", MP.bytes(d.baseline_bytes)], ["current", MP.bytes(d.current_bytes)],
      ["change", MP.signed(d.delta_bytes) + (d.change === null ? "" : " (" + (100 * d.change).toFixed(1) + "%)"),
        d.verdict === "regression" ? "bad" : ""], ["allowed increase", MP.bytes(d.allowed_increase_bytes)]]));
    if (d.reason) s.append(MP.note(d.reason));
    if (b && c && b.timeline && c.timeline) {
      await new MP.CompareChart(s, [{label: "baseline", colour: MP.RUN_COLOURS.baseline, dev: b},
        {label: "current", colour: MP.RUN_COLOURS.current, dev: c}], page).draw();
    } else {
      s.append(MP.note("No timeline for " + [[b, "the baseline"], [c, "the current run"]]
        .filter(([x]) => !x || !x.timeline).map(([, n]) => n).join(" or ") +
        ": its report.json has no report.html beside it (kept alone, or written by an older memprof)."));
    }
    const columns = MP.el("div", {className: "cols"});
    for (const [run, dev] of [[base, b], [cur, c]]) {
      const col = MP.el("div", {}, MP.el("h3", {}, run.role), MP.el("p", {className: "muted wrap"}, run.path));
      if (dev) col.append(MP.headline(dev), MP.categoryTable(dev.report, page, true));
      columns.append(col);
    }
    s.append(columns);
    if (b && c) {
      const keys = Object.keys(b.report.categories);
      s.append(MP.el("h3", {}, "The difference by category"));
      s.append(MP.diffTable("category", keys.map((k) => ({name: k, baseline: b.report.categories[k],
        current: c.report.categories[k] || 0})).filter((r) => r.baseline || r.current),
      (r) => [MP.swatch(cats.get(r.name).colour), cats.get(r.name).name]));
      const mods = new Map();
      for (const [key, dev] of [["baseline", b], ["current", c]]) {
        for (const m of dev.report.top_modules) {
          if (!mods.has(m.module)) mods.set(m.module, {name: m.module, baseline: 0, current: 0});
          mods.get(m.module)[key] += m.bytes;
        }
      }
      if (mods.size) {
        s.append(MP.el("h3", {}, "The difference by module (each run's top modules)"));
        s.append(MP.diffTable("module", [...mods.values()]));
      }
      if (d.sites.length) {
        s.append(MP.el("h3", {}, "Sites that changed most"));
        s.append(MP.diffTable("site", d.sites.map((x) => ({name: x.name, baseline: x.baseline_bytes, current: x.current_bytes}))));
      }
    }
  }
};

MP.suggestPage = async function (main, page) {
  const a = page.advice, run = page.runs[0], budget = a.budget.bytes;
  const now = a.current.reserved_bytes;
  main.append(MP.cards([["budget (" + a.budget.read_as + ")", MP.bytes(budget)],
    ["peak now, reserved", MP.bytes(now), now > budget ? "bad" : "good"],
    ["peak now, allocated", MP.bytes(a.current.allocated_bytes)],
    ["the plan's peak", a.plan.peak ? MP.bytes(a.plan.peak.reserved_bytes) : "n/a", a.plan.fits ? "good" : "bad"]]));
  if (page.source.out_of_memory) main.append(MP.note(page.source.out_of_memory, "bad"));
  if (page.source.categories_inferred) main.append(MP.note("Categories inferred from stacks (a snapshot without memprof's labels): savings are rougher."));
  const dev = run.devices.slice().sort((x, y) => y.report.peak.reserved_bytes - x.report.peak.reserved_bytes)[0];
  let chart = null;
  if (dev && dev.timeline) {
    const s = MP.section(main, "Memory over time, with the budget", "timeline");
    chart = new MP.Timeline(s, dev, page, {budget});
  }
  const measuredBase = a.baseline_measured ? a.baseline_measured.reserved_bytes : null;
  const rs = MP.section(main, "Remedies by bytes saved at the peak (each alone)", "remedies");
  const accent = MP.css("--accent"), good = MP.css("--good");
  rs.append(MP.el("p", {className: "legend"}, MP.el("span", {}, MP.swatch(accent), "estimated"),
    MP.el("span", {}, MP.swatch(good), "measured by --verify (re-run)")));
  const rows = [];
  for (const r of a.remedies) {
    rows.push({label: r.title, parts: [{value: Math.max(0, r.saved_bytes), colour: accent, title: MP.exact(r.saved_bytes)}],
      text: "saves " + MP.bytes(r.saved_bytes) + (r.peak ? ", peak then " + MP.bytes(r.peak.reserved_bytes) : "") +
        " (" + String(r.cost).split(":")[0] + ")"});
    if (r.measured && measuredBase !== null) {
      const saved = measuredBase - r.measured.reserved_bytes;
      rows.push({label: "\u2003measured", parts: [{value: Math.max(0, saved), colour: good, title: MP.exact(saved)}],
        text: "saves " + MP.bytes(saved) + ", peak " + MP.bytes(r.measured.reserved_bytes)});
    } else if (r.verify_error) {
      rows.push({label: "\u2003measured", parts: [], text: "failed: " + r.verify_error});
    }
  }
  if (rows.length) rs.append(MP.bars(rows)); else rs.append(MP.el("p", {}, "No remedy applies to this run."));
  const ps = MP.section(main, a.plan.fits ? "The plan: " + a.plan.steps.length + " step(s) down to the budget" :
    "The plan: nothing fits; the steps that come nearest", "plan");
  const byKey = new Map(a.remedies.map((r) => [r.key, r]));
  const fall = [{label: "now", parts: [{value: now, colour: MP.css("--muted")}], text: MP.bytes(now)}];
  let before = now;
  for (const [i, st] of a.plan.steps.entries()) {
    if (!st.peak) continue;
    const after = st.peak.reserved_bytes, r = byKey.get(st.key);
    fall.push({label: (i + 1) + ". " + (r ? r.title : st.key), parts: [
      {from: after, value: Math.max(0, before - after), colour: accent, title: "saves " + MP.exact(before - after)}],
    text: MP.signed(after - before) + " \u2192 " + MP.bytes(after)});
    before = after;
  }
  if (a.plan.steps.length) fall.push({label: "after the plan", parts: [{value: before, colour: before <= budget ? good : MP.css("--bad")}],
    text: MP.bytes(before) + (a.plan.measured ? " (measured " + MP.bytes(a.plan.measured.reserved_bytes) + ")" : "")});
  ps.append(MP.bars(fall, [{value: budget, title: "budget " + MP.bytes(budget)}]));
  ps.append(MP.el("p", {className: "muted"}, "The red line is the budget, " + MP.bytes(budget) + "."));
  for (const [i, st] of a.plan.steps.entries()) {
    const r = byKey.get(st.key);
    if (!r) continue;
    ps.append(MP.el("h3", {}, (i + 1) + ". " + r.title), MP.el("p", {className: "muted"}, r.cost + "; assumes: " + r.assumptions),
      MP.el("pre", {className: "snippet mono"}, r.snippet));
  }
  if (a.fit_batch) main.append(MP.note(a.fit_batch.largest === null ? "No --" + a.fit_batch.arg + " fits, not even 1." :
    "Largest --" + a.fit_batch.arg + " that fits: " + a.fit_batch.largest + " (" + a.fit_batch.runs + " runs)."));
  if (chart) await chart.draw();
};
