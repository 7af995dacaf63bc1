/* A report's sections for one device: the headline, timeline, the peak, modules and sites,
   the allocator, steps and leak, out-of-memory events; and the ranks of a run. */
"use strict";

MP.headline = function (dev) {
  const r = dev.report, p = r.peak;
  const when = p.event_index < 0 ? "before the first recorded event" :
    "event " + MP.count(p.event_index) + " of " + MP.count(r.events) +
    (p.time_us !== null && r.window.first_time_us !== null ?
      ", " + ((p.time_us - r.window.first_time_us) / 1e6).toFixed(3) + " s in" : "");
  return MP.cards([
    ["peak allocated (" + when + ")", MP.bytes(p.allocated_bytes), "bad"],
    ["peak reserved", MP.bytes(p.reserved_bytes)],
    ["reserved at the peak (" + MP.bytes(p.reserved_at_peak_bytes - p.allocated_bytes) +
      " cached, unallocated)", MP.bytes(p.reserved_at_peak_bytes)],
    ["at the end: allocated / reserved", MP.bytes(r.end.allocated_bytes) + " / " +
      MP.bytes(r.end.reserved_bytes)],
    dev.capacity_bytes ? ["the card's memory", MP.bytes(dev.capacity_bytes)] : null,
    r.oom_events ? ["out-of-memory events", MP.count(r.oom_events), "bad"] : null,
  ]);
};

/* The categories at the peak; ``brief``: bytes and shares only. */
MP.categoryTable = function (report, page, brief) {
  const cats = MP.categories(page), total = report.peak.allocated_bytes;
  const rows = Object.entries(report.categories).filter(([, v]) => v > 0)
    .map(([key, bytes]) => ({key, bytes, requested: (report.categories_requested || {})[key]}));
  const columns = [
    {title: "category", value: (r) => cats.get(r.key).name,
      cell: (r) => MP.el("span", {style: {whiteSpace: "nowrap"}}, MP.swatch(cats.get(r.key).colour),
        cats.get(r.key).name)},
    {title: "bytes", num: true, value: (r) => r.bytes, cell: (r) => MP.bytes(r.bytes)},
    {title: "share", num: true, value: (r) => r.bytes, cell: (r) => MP.pct(r.bytes, total)},
  ];
  if (brief) return MP.table(columns, rows, {sortBy: 1});
  columns.push({title: "exact", num: true, value: (r) => r.bytes, cell: (r) => MP.exact(r.bytes)});
  if (report.categories_requested) columns.push({title: "the tensors' own bytes", num: true,
    value: (r) => r.requested || 0, cell: (r) => MP.bytes(r.requested || 0)});
  return MP.table(columns, rows, {sortBy: 1});
};

/* Modules with the elements of module lists summed (blocks.* for blocks.0, blocks.1, ...). */
MP.moduleTable = function (modules) {
  const groups = new Map();
  for (const m of modules) {
    const key = m.module.split(".").map((part) => /^\d+$/.test(part) ? "*" : part).join(".");
    if (!groups.has(key)) groups.set(key, {module: key, bytes: 0, count: 0, share: 0, frame: m.frame, children: [], alike: true});
    const g = groups.get(key);
    g.bytes += m.bytes; g.count += m.count; g.share += m.share; g.children.push(m);
  }
  const rows = [...groups.values()].map((g) => g.children.length > 1 ? g : g.children[0]);
  return MP.table([
    {title: "module", value: (m) => m.module, cell: (m) => MP.el("span", {className: "mono"}, m.module,
      m.alike ? MP.el("span", {className: "muted"}, " (" + m.children.length + " alike, summed)") : null)},
    {title: "bytes", num: true, value: (m) => m.bytes, cell: (m) => MP.bytes(m.bytes)},
    {title: "share", num: true, value: (m) => m.share, cell: (m) => (100 * m.share).toFixed(1) + "%"},
    {title: "blocks", num: true, value: (m) => m.count, cell: (m) => MP.count(m.count)},
    {title: "model code", value: (m) => m.frame || "", cell: (m) => MP.el("span", {className: "mono"}, m.frame || "")},
  ], rows, {sortBy: 1});
};

MP.siteTable = function (sites) {
  return MP.table([
    {title: "bytes", num: true, value: (s) => s.bytes, cell: (s) => MP.bytes(s.bytes)},
    {title: "share", num: true, value: (s) => s.share, cell: (s) => (100 * s.share).toFixed(1) + "%"},
    {title: "blocks", num: true, value: (s) => s.count, cell: (s) => MP.count(s.count)},
    {title: "your line", value: (s) => s.file || s.site, cell: (s) => MP.el("span", {className: "mono"},
      s.file ? s.file + ":" + s.line + " " + s.function : s.site)},
    {title: "the library call under it", value: (s) => s.call || "",
      cell: (s) => MP.el("span", {className: "mono"}, s.call || "")},
  ], sites, {sortBy: 0});
};

MP.stepSection = function (parent, dev, page) {
  const r = dev.report, steps = r.steps || [];
  const verdict = r.step_growth.verdict;
  const kind = verdict === "leak" ? "bad" : verdict === "none" || verdict === "bounded" ? "good" : "";
  if (steps.length) {
    const top = Math.max(...steps.map((s) => s.peak_allocated_bytes));
    const shown = steps.length > 60 ? steps.filter((s, i) => i < 30 || i >= steps.length - 30 ||
      s.peak_allocated_bytes === top) : steps;
    parent.append(MP.el("p", {className: "legend"},
      MP.el("span", {}, MP.swatch(page.colours.allocated), "peak allocated in the step"),
      MP.el("span", {}, MP.swatch(MP.css("--muted")), "allocated after it (what stayed)")));
    parent.append(MP.bars(shown.map((s) => ({
      label: "step " + s.step + (s.peak_allocated_bytes === top ? " \u2190 peak" : ""),
      parts: [{value: s.peak_allocated_bytes, colour: page.colours.allocated, opacity: 0.55,
        title: "peak " + MP.exact(s.peak_allocated_bytes)},
      {value: s.end_allocated_bytes, colour: MP.css("--muted"), title: "after " + MP.exact(s.end_allocated_bytes)}],
      text: MP.bytes(s.peak_allocated_bytes) + " / " + MP.bytes(s.end_allocated_bytes),
    }))));
    if (shown.length < steps.length) parent.append(MP.el("p", {className: "muted"},
      "The middle steps are left out (" + steps.length + " in all; report.json has each)."));
  }
  parent.append(MP.note(dev.text.steps, kind));
};

MP.allocatorSection = function (parent, dev, page) {
  const r = dev.report, f = r.fragmentation;
  parent.append(MP.cards([
    ["reserved but unallocated at the peak", MP.bytes(f.unallocated_at_peak_bytes)],
    ["largest free block at the peak", MP.bytes(f.largest_free_block_at_peak_bytes)],
    ["segments at the peak", dev.segments ? MP.count(dev.segments.segments.length) : "n/a"],
  ]));
  if (dev.segments && dev.segments.segments.length) {
    const present = new Set(dev.segments.segments.flatMap((s) => s[4].map((run) => run[2])));
    const cats = MP.categories(page);
    parent.append(MP.el("div", {className: "legend"},
      [...cats.entries()].filter(([k]) => present.has(k)).map(([, c]) =>
        MP.el("span", {}, MP.swatch(c.colour), c.name)),
      MP.el("span", {}, MP.swatch(MP.css("--free")), "free (cached by the allocator)"),
      MP.el("span", {className: "muted"}, "segments in address order, each one's start marked; hover for details")));
    new MP.SegmentMap(parent, dev.segments, page).draw();
    if (dev.segments.merged) parent.append(MP.el("p", {className: "muted"},
      "Too many blocks to draw each: neighbouring blocks are drawn together."));
    if (dev.segments.blocks_outside) parent.append(MP.note(MP.count(dev.segments.blocks_outside) +
      " live blocks lie in no known segment (the trace lost segment events)."));
  }
  parent.append(MP.el("h3", {}, "Segments at the peak, by pool and stream"));
  parent.append(MP.table(["pool", "stream", "segments", "reserved_bytes", "allocated_bytes"].map((k) => ({
    title: k.replace("_bytes", "").replace("_", " "), num: k !== "pool", value: (p) => p[k],
    cell: (p) => k.endsWith("_bytes") ? MP.bytes(p[k]) : typeof p[k] === "number" ? MP.count(p[k]) : p[k]})),
  f.pools_at_peak, {sortBy: 3}));
  parent.append(MP.note(dev.text.replay, r.replay.modelled ? "" : "bad"));
};

MP.ranksSection = function (parent, page) {
  const devs = page.devices.map((d) => d.report).filter((r) => r.rank !== null);
  if (new Set(devs.map((r) => r.rank)).size < 2) return;
  const s = MP.section(parent, "Ranks", "ranks");
  const im = page.imbalance;
  if (im) s.append(MP.el("p", {}, "The largest rank peaks at " + im.max_over_min.toFixed(2) +
    "x the smallest."));
  const worst = devs.slice().sort((a, b) => b.peak.allocated_bytes - a.peak.allocated_bytes);
  s.append(MP.table([
    {title: "rank", num: true, value: (r) => r.rank, cell: (r) => String(r.rank)},
    {title: "device", num: true, value: (r) => r.device, cell: (r) => String(r.device)},
    {title: "peak allocated", num: true, value: (r) => r.peak.allocated_bytes, cell: (r) => MP.bytes(r.peak.allocated_bytes)},
    {title: "peak reserved", num: true, value: (r) => r.peak.reserved_bytes, cell: (r) => MP.bytes(r.peak.reserved_bytes)},
    {title: "out of memory", num: true, value: (r) => r.oom_events, cell: (r) => MP.count(r.oom_events)},
  ], worst, {sortBy: -1}));
};

/* Every section of one device of a report. */
MP.devicePage = async function (main, dev, page) {
  const r = dev.report;
  main.append(MP.headline(dev));
  if (dev.text.ring_buffer) main.append(MP.note(dev.text.ring_buffer));
  for (const oom of dev.text.ooms) main.append(MP.note(oom, "bad"));
  const tl = MP.section(main, "Memory over time", "timeline");
  const chart = new MP.Timeline(tl, dev, page, {});
  const peak = MP.section(main, "What was allocated at the peak" +
    (r.categories_inferred ? " (categories inferred from stacks and lifetimes)" : ""), "peak");
  peak.append(MP.categoryTable(r, page));
  if (dev.parts.length) {
    peak.append(MP.el("h3", {}, "By category, module and site (click a box to zoom in)"));
    new MP.Icicle(peak, dev.parts, page, r.peak.allocated_bytes);
  }
  const where = MP.section(main, "Modules and allocation sites at the peak", "modules");
  if (r.top_modules.length) {
    where.append(MP.el("h3", {}, "Modules (the innermost one running at each allocation; module lists summed, + shows each)"));
    where.append(MP.moduleTable(r.top_modules));
  }
  where.append(MP.el("h3", {}, "Allocation sites (your line, and the library call under it)"));
  where.append(MP.siteTable(r.top_sites));
  MP.allocatorSection(MP.section(main, "The allocator at the peak", "allocator"), dev, page);
  MP.stepSection(MP.section(main, "Steps and leaks", "steps"), dev, page);
  await chart.draw();
  return chart;
};
