/* The page's start: read the data, write the title, draw the kind of page it is. */
"use strict";

MP.start = async function () {
  const page = JSON.parse(document.getElementById("memprof-data").textContent);
  const main = document.getElementById("main");
  main.replaceChildren();
  const what = {report: "memprof report", check: "memprof check", suggest: "memprof suggest"}[page.kind];
  document.title = what + ": " + page.title;
  document.getElementById("title").textContent = what + ": " + page.title;
  const sub = document.getElementById("subtitle");
  if (page.kind === "report") {
    const run = page.run;
    sub.textContent = run ? [run.device, run.exit && run.exit.status, run.duration_s !== undefined &&
      run.duration_s !== null ? run.duration_s.toFixed(1) + " s" : null, run.torch_version &&
      "PyTorch " + run.torch_version].filter(Boolean).join(" \u00b7 ") :
      "snapshot " + page.source.path + " (format " + page.source.format + ")";
    MP.ranksSection(main, page);
    await MP.tabs(main, page);
  } else if (page.kind === "check") {
    await MP.checkPage(main, page);
  } else {
    sub.textContent = "advice on " + page.runs[0].path;
    await MP.suggestPage(main, page);
  }
  performance.mark("memprof-drawn");
  document.body.dataset.ready = "true";
};

/* One tab per device (a run folder of several ranks, a snapshot of several devices). */
MP.tabs = function (main, page) {
  const nav = document.getElementById("tabs"), body = MP.el("div");
  main.append(body);
  if (!page.devices.length) {
    body.append(MP.note("The snapshot is empty: no segments and no recorded events."));
    return null;
  }
  const buttons = page.devices.map((dev, i) => {
    const r = dev.report;
    const b = MP.el("button", {role: "tab", ariaSelected: i === 0 ? "true" : "false"},
      (r.rank === null ? "" : "rank " + r.rank + ", ") + "device " + r.device + " \u00b7 peak " +
      MP.bytes(r.peak.allocated_bytes));
    b.addEventListener("click", () => show(i));
    return b;
  });
  nav.setAttribute("role", "tablist");
  if (buttons.length > 1) nav.replaceChildren(...buttons);
  const show = (i) => {
    buttons.forEach((b, k) => b.setAttribute("aria-selected", String(k === i)));
    body.replaceChildren();
    MP.shown = MP.devicePage(body, page.devices[i], page);
    return MP.shown;
  };
  return show(0);
};

addEventListener("DOMContentLoaded", () => {
  MP.start().catch((err) => {
    document.getElementById("main").prepend(MP.note("The page could not be drawn: " + err, "bad"));
    throw err;
  });
});
