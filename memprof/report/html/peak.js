/* The peak: an icicle of what was live (category -> module path -> site, click to zoom in),
   and the allocator's map (the segments at the peak, their blocks by category). */
"use strict";

MP.ROW_PX = 28;
MP.MIN_SHARE = 0.004; // nodes narrower than this share of the view are left out

/* Black or white text, whichever reads on ``colour`` (#rrggbb). */
MP.ink = function (colour) {
  const n = parseInt(colour.slice(1, 7), 16), r = n >> 16, g = (n >> 8) & 255, b = n & 255;
  return 0.299 * r + 0.587 * g + 0.114 * b > 150 ? "#000" : "#fff";
};

/* The tree of parts: [category, module path or null, site, bytes, blocks]. */
MP.partTree = function (parts, cats) {
  const root = {name: "at the peak", bytes: 0, count: 0, children: new Map(), path: []};
  const moduled = parts.some((p) => p[1] !== null);
  for (const [cat, module, site, bytes, count] of parts) {
    const names = [cats.get(cat) ? cats.get(cat).name : cat];
    if (moduled) names.push(...(module === null ? ["(no module)"] : module.split(".")));
    names.push(site);
    let node = root;
    node.bytes += bytes; node.count += count;
    for (const [depth, name] of names.entries()) {
      if (!node.children.has(name)) {
        node.children.set(name, {name, bytes: 0, count: 0, children: new Map(), parent: node,
          colour: cats.get(cat) ? cats.get(cat).colour : "#7f7f7f", depth: depth + 1,
          site: depth === names.length - 1});
      }
      node = node.children.get(name);
      node.bytes += bytes; node.count += count;
    }
  }
  return root;
};

MP.Icicle = class {
  constructor(parent, parts, page, peakBytes) {
    this.tree = MP.partTree(parts, MP.categories(page));
    this.peak = peakBytes;
    this.crumbs = MP.el("nav", {className: "crumbs", ariaLabel: "icicle path"});
    this.box = MP.el("div", {className: "icicle"});
    parent.append(this.crumbs, this.box);
    this.show(this.tree);
  }

  show(root) {
    this.root = root;
    const path = [];
    for (let n = root; n; n = n.parent) path.unshift(n);
    this.crumbs.replaceChildren(...path.map((n, i) => {
      const b = MP.el("button", {title: "zoom out to " + n.name}, n.name);
      b.addEventListener("click", () => this.show(n));
      return i === path.length - 1 ? MP.el("strong", {className: "wrap"}, n.name) : b;
    }));
    this.box.replaceChildren();
    let depth = 0;
    const place = (node, left, width, level) => {
      depth = Math.max(depth, level);
      const share = node.bytes / this.peak;
      const label = node.name + "  " + MP.bytes(node.bytes) + " (" + MP.pct(node.bytes, this.peak) + ")";
      const colour = level === 0 ? MP.css("--panel") : node.colour;
      const b = MP.el("button", {
        title: (node === this.tree ? "" : this._path(node) + "\n") + MP.exact(node.bytes) + ", " +
          MP.count(node.count) + " blocks, " + (100 * share).toFixed(2) + "% of the peak" +
          (node.children.size ? "\nclick to zoom in" : ""),
        style: {left: (100 * left) + "%", width: (100 * width) + "%", top: (level * MP.ROW_PX) + "px",
          height: MP.ROW_PX + "px", background: colour, color: level === 0 ? MP.css("--fg") : MP.ink(colour),
          opacity: node.site ? 0.85 : 1}}, label);
      b.dataset.bytes = String(node.bytes);
      if (node.children.size) b.addEventListener("click", () => this.show(node === this.root && node.parent ? node.parent : node));
      this.box.append(b);
      let at = left;
      const kids = [...node.children.values()].sort((a, c) => c.bytes - a.bytes);
      for (const kid of kids) {
        const w = width * kid.bytes / (node.bytes || 1);
        if (w >= MP.MIN_SHARE) place(kid, at, w, level + 1);
        at += w;
      }
    };
    place(root, 0, 1, 0);
    this.box.style.height = ((depth + 1) * MP.ROW_PX + 2) + "px";
  }

  _path(node) {
    const names = [];
    for (let n = node; n && n.parent; n = n.parent) names.unshift(n.name);
    return names.join(" \u203a ");
  }
};

/* The segments at the peak as one strip wrapped into rows, in address order: blocks
   coloured by category, free space plain, each segment's start marked. */
MP.SegmentMap = class {
  constructor(parent, map, page) {
    this.map = map;
    this.cats = MP.categories(page);
    this.starts = [];
    let total = 0;
    for (const s of map.segments) { this.starts.push(total); total += s[1]; }
    this.total = total;
    this.canvas = MP.el("canvas", {className: "map", tabindex: "0", role: "img",
      ariaLabel: "the allocator's segments at the peak: " + map.segments.length + " segments, " +
        MP.bytes(total) + " reserved"});
    this.tip = MP.el("div", {className: "tip", role: "status"});
    parent.append(MP.el("div", {className: "map-wrap"}, this.canvas, this.tip));
    this.canvas.addEventListener("mousemove", (e) => this._hover(e));
    this.canvas.addEventListener("mouseleave", () => { this.tip.style.display = "none"; });
    new ResizeObserver(() => this.draw()).observe(parent);
  }

  draw() {
    const dpr = devicePixelRatio || 1, w = Math.max(300, this.canvas.parentElement.clientWidth);
    this.rows = Math.max(4, Math.min(60, Math.ceil(this.map.segments.length / 4) + 8));
    this.rowPx = 7;
    const h = this.rows * this.rowPx;
    this.canvas.width = w * dpr; this.canvas.height = h * dpr;
    this.canvas.style.height = h + "px";
    this.width = w;
    const ctx = this.canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    this.perPx = this.total / (w * this.rows) || 1;
    ctx.fillStyle = MP.css("--free");
    this._span(ctx, 0, this.total);
    this.map.segments.forEach((s, i) => {
      for (const [offset, size, cat] of s[4]) {
        ctx.fillStyle = this.cats.get(cat) ? this.cats.get(cat).colour : "#7f7f7f";
        this._span(ctx, this.starts[i] + offset, size);
      }
    });
    if (this.map.segments.length * 3 < w * this.rows) {
      ctx.fillStyle = MP.css("--fg");
      for (const start of this.starts) this._span(ctx, start, this.perPx * 0.8, 1);
    }
  }

  /* Fill ``bytes`` from ``from`` (bytes into the strip) across the rows they cover. */
  _span(ctx, from, bytes, minPx) {
    let p = from / this.perPx;
    const end = p + Math.max(bytes / this.perPx, minPx || 0);
    while (p < end - 1e-9) {
      const row = Math.floor(p / this.width), x = p - row * this.width;
      const run = Math.min(end - p, this.width - x);
      ctx.fillRect(x, row * this.rowPx, run, this.rowPx - 1);
      p += run;
    }
  }

  _hover(e) {
    const rect = this.canvas.getBoundingClientRect();
    const x = e.clientX - rect.left, y = e.clientY - rect.top;
    const at = (Math.floor(y / this.rowPx) * this.width + x) * this.perPx;
    const i = MP.lower(this.starts, at + 1) - 1;
    if (i < 0 || at >= this.total) { this.tip.style.display = "none"; return; }
    const [address, size, pool, stream, runs] = this.map.segments[i], offset = at - this.starts[i];
    const lines = ["segment 0x" + address.toString(16) + ": " + MP.bytes(size) + ", " + pool +
      " pool, stream " + stream];
    const k = MP.lower(runs.map((r) => r[0]), offset + 1) - 1;
    const run = k >= 0 ? runs[k] : null;
    if (run && offset < run[0] + run[1]) {
      const cat = this.cats.get(run[2]);
      lines.push((cat ? cat.name : run[2]) + ": " + MP.bytes(run[1]) + " in " + MP.count(run[3]) +
        " block" + (run[3] === 1 ? "" : "s") + " at +" + MP.bytes(run[0]));
    } else {
      const from = run ? run[0] + run[1] : 0, to = k + 1 < runs.length ? runs[k + 1][0] : size;
      lines.push("free: " + MP.bytes(to - from) + " (cached by the allocator)");
    }
    this.tip.replaceChildren(...lines.map((l) => MP.el("div", {}, l)));
    this.tip.style.display = "block";
    this.tip.style.left = Math.min(x + 14, this.width - this.tip.offsetWidth - 4) + "px";
    this.tip.style.top = (y + 14) + "px";
  }
};
