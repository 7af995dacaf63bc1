"""report.html: its size, what writing it costs, and how fast it opens in a browser, for the
quickstart run and the 1M- and 10M-event snapshots; beside PyTorch's
``torch.cuda._memory_viz.trace_plot`` page of the same files.

Pages open from disk in headless Chromium (Debian's, through chromedriver) with every host
name unresolvable, as on a machine without network. Times are the page's own
``performance`` entries: first contentful paint, and memprof's mark once every chart has
drawn; then a zoom to 1% of the timeline around the peak, until it has redrawn.

Usage: python benchmarks/html_report.py [EVENTS ...]   (default: 1000000 10000000)
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from large_snapshot import snapshot_of
from load_snapshot import Refuse
from measure import machine, write_table

from memprof.analysis.explain import explain
from memprof.report.html import write_report_page
from memprof.report.json import report_dict
from memprof.trace import load_snapshot

ROOT = Path(__file__).resolve().parent.parent
OPENS = 3  # each page is opened this many times; the medians are shown
MAX_OPENED = 200 << 20  # trace_plot pages larger than this are written and measured, not opened

ZOOM = """
return MP.shown.then(async (c) => {
  const t = performance.now(), x = c.dev.timeline.peak_x, span = (c.full[1] - c.full[0]) / 100;
  c.plot.setScale("x", {min: x - span / 2, max: x + span / 2});
  await c.settled();
  await new Promise((done) => requestAnimationFrame(() => done()));
  return performance.now() - t;
});"""
TIMES = """
const paint = performance.getEntriesByName("first-contentful-paint")[0];
const drawn = performance.getEntriesByName("memprof-drawn")[0];
return [paint ? paint.startTime : null, drawn ? drawn.startTime : null,
        document.querySelectorAll("canvas").length];"""


def browser():  # -> selenium WebDriver
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--host-resolver-rules=MAP * ~NOTFOUND"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"),
                            options=options)


def open_times(driver, page: Path, ours: bool) -> dict[str, float | None]:
    """Medians of ``OPENS`` opens: first paint and drawn (ms), and a zoom (ms, ours only)."""
    from selenium.webdriver.support.ui import WebDriverWait

    paints, drawn, zooms, canvases = [], [], [], 0
    for _ in range(OPENS):
        driver.get("about:blank")
        driver.get(page.resolve().as_uri())
        if ours:
            WebDriverWait(driver, 60).until(
                lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))
        else:
            time.sleep(5)  # whatever it can draw without the network
        paint, done, canvases = driver.execute_script(TIMES)
        paints.append(paint)
        drawn.append(done)
        if ours:
            zooms.append(driver.execute_script(ZOOM))

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {"paint": median(paints), "drawn": median(drawn), "zoom": median(zooms),
            "canvases": canvases}


def ms(value: float | None) -> str:
    return "none" if value is None else f"{value:,.0f} ms"


def mib(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:,.2f} MiB"


def trace_plot_page(snapshot: Path, out: Path) -> float:
    """PyTorch's trace_plot page of ``snapshot`` at ``out``; the seconds it took."""
    from torch.cuda._memory_viz import trace_plot

    with snapshot.open("rb") as f:
        data = Refuse(f).load()
    start = time.perf_counter()
    out.write_text(trace_plot(data))
    return time.perf_counter() - start


def memprof_page(snapshot: Path, out: Path) -> float:
    """memprof's page of ``snapshot`` at ``out``; the seconds writing it took (after the
    analysis, which ``explain`` does anyway)."""
    findings = explain(load_snapshot(snapshot), str(snapshot))
    start = time.perf_counter()
    write_report_page(findings, report_dict(findings), snapshot.name, out, overwrite=True)
    return time.perf_counter() - start


def quickstart(tmp: Path) -> tuple[Path, Path]:
    """The README's quickstart run: its folder's report.html and snapshot."""
    folder = tmp / "quickstart"
    subprocess.run([sys.executable, "-m", "memprof", "run", "-o", str(folder), "--force",
                    "--no-timeline", str(ROOT / "sample_scripts" / "transformer_lm.py"),
                    "--size", "real", "--amp", "bf16"], check=True, capture_output=True)
    return folder / "report.html", folder / "snapshot.pickle"


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1_000_000, 10_000_000]
    rows = []
    driver = browser()
    try:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            page, snap = quickstart(tmp)
            inputs = [("quickstart run (transformer_lm.py --size real --amp bf16)", snap, page,
                       None)]
            for events in sizes:
                snapshot = snapshot_of(events)
                out = tmp / f"{events}.html"
                inputs.append((f"{events:,}-event snapshot", snapshot, out,
                               memprof_page(snapshot, out)))
            for label, snapshot, page, wrote in inputs:
                ours = open_times(driver, page, True)
                theirs_page = tmp / f"trace_plot-{snapshot.stem}.html"
                took = trace_plot_page(snapshot, theirs_page)
                if theirs_page.stat().st_size > MAX_OPENED:
                    drew = "not opened (too large to be worth it: same page, nothing drawn)"
                else:
                    theirs = open_times(driver, theirs_page, False)
                    drew = "nothing (its script comes from a CDN)" if not theirs["canvases"] \
                        else f"first paint {ms(theirs['paint'])}"
                rows.append([label, mib(page), "in the run" if wrote is None else f"{wrote:.2f} s",
                             ms(ours["paint"]), ms(ours["drawn"]), ms(ours["zoom"]),
                             mib(theirs_page), f"{took:.2f} s", drew])
                theirs_page.unlink()
    finally:
        driver.quit()
    write_table("html_report",
                ["input", "report.html", "written in", "first paint", "scripts done drawing",
                 "zoom to 1% redrawn", "trace_plot HTML", "trace_plot written in",
                 "trace_plot opened offline draws"], rows,
                "memprof's page: `memprof explain SNAPSHOT --html FILE` (for the quickstart, the"
                " run folder's report.html); \"written in\" is the page's own cost after the"
                " analysis. PyTorch's: `torch.cuda._memory_viz.trace_plot(snapshot)` (what"
                " `python -m torch.cuda._memory_viz trace_plot` writes), which embeds the whole"
                " pickle in base64 and imports its viewer from cdn.jsdelivr.net, so offline it"
                " draws nothing. Headless Chromium, no network, medians of"
                f" {OPENS} opens; times since the navigation started (\"scripts done"
                " drawing\": memprof's mark once its scripts have drawn every chart, which the"
                " browser then paints)."
                f" Machine: {machine()}.")


if __name__ == "__main__":
    main()
