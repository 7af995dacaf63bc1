"""PNG plots of memory over time: the points to draw (`timeline_panels`, numpy alone) and
the drawing (`draw_timeline`, matplotlib). Importing matplotlib takes a third of a second,
so ``memprof run`` draws in a child process that loads it while the trace is analysed
(`background_plot`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from memprof.report.colours import ALLOCATED_COLOUR, CATEGORY_COLOURS, PEAK_COLOUR, RESERVED_COLOUR
from memprof.report.files import write_atomic
from memprof.report.text import visible

if TYPE_CHECKING:
    from memprof.analysis.findings import Findings

# Points kept per panel: a few per pixel column of the 1,100-pixel-wide figure. A long
# trace's millions of steps would cost matplotlib hundreds of MiB and draw the same pixels.
_BUCKETS = 2048
_TITLE_CHARS = 130  # at the title's font size, what fits across the figure
_WIDTH_IN, _PANEL_IN = 10, 3.2  # the figure's width, and its height per panel
# margins: y tick labels and unit; x tick labels and label; the title and a panel's own;
# between panels, a panel's x labels and the next one's title
_LEFT_IN, _RIGHT_IN, _BOTTOM_IN, _TOP_IN, _GAP_IN = 0.7, 0.15, 0.55, 0.62, 0.85


@dataclass(frozen=True, slots=True)
class Panel:
    """One device's timeline as drawn: the kept points, already in ``unit``."""

    device: int
    x: np.ndarray  # seconds since the first event, or event numbers
    xlabel: str
    unit: str
    reserved: np.ndarray
    allocated: np.ndarray  # drawn as one line where there are no categories
    categories: dict[str, np.ndarray] | None  # allocated bytes stacked by category
    peak: int  # index of the peak in the kept points
    peak_label: str


def _unit(peak: int) -> tuple[str, float]:
    for name, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if peak >= 1 << shift:
            return name, float(1 << shift)
    return "B", 1.0


def kept_points(allocated: np.ndarray, reserved: np.ndarray, peak: int,
                buckets: int = _BUCKETS) -> np.ndarray:
    """The points to draw: all of a short timeline; of a long one, each of ``buckets``
    slices' first point and the highest and lowest allocated and reserved points in it
    (a step plot through them has the full one's outline), the peak and the last."""
    n = len(allocated)
    if n <= 4 * buckets:
        return np.arange(n)
    width = -(-n // buckets)
    starts = np.arange(0, n, width)
    kept = [starts, np.array([peak, n - 1])]
    for values in (allocated, reserved):
        padded = np.pad(values, (0, width * len(starts) - n), mode="edge").reshape(-1, width)
        kept += [starts + padded.argmax(axis=1), starts + padded.argmin(axis=1)]
    chosen = np.zeros(n, bool)
    chosen[np.minimum(np.concatenate(kept), n - 1)] = True  # the padding's are the last's
    return np.flatnonzero(chosen)


def timeline_panels(findings: Findings) -> list[Panel]:
    """One panel per device of ``findings``, reduced to the points worth drawing."""
    panels = []
    for d in findings.devices:
        t = d.timeline
        unit, scale = _unit(max(d.peak_reserved_bytes, d.peak_allocated_bytes))
        if t.time_us is not None and len(t.time_us):
            x = np.concatenate([[t.time_us[0]], t.time_us]).astype(float)
            x, xlabel = (x - x[0]) / 1e6, "seconds since the first recorded event"
        else:
            x, xlabel = np.arange(-1, len(t.allocated) - 1), "event"
        kept = kept_points(t.allocated, t.reserved, d.peak_event_index + 1)
        categories = None if d.category_timeline is None else {  # none empty in the legend
            name: v[kept] / scale for name, v in d.category_timeline.items() if v.any()}
        panels.append(Panel(
            d.device, x[kept], xlabel, unit, t.reserved[kept] / scale,
            t.allocated[kept] / scale, categories,
            int(np.searchsorted(kept, d.peak_event_index + 1)),
            f"peak {d.peak_allocated_bytes / scale:.2f} {unit}"))
    return panels


def timeline_title(findings: Findings, title: str | None = None) -> str:
    """The figure's title: ``title`` (a command line), or the snapshot's file name; cut to
    the figure's width."""
    text = f"memprof: {visible(title or Path(findings.source).name)}"  # a file's name: text
    return text if len(text) <= _TITLE_CHARS else text[:_TITLE_CHARS - 1] + "\u2026"


def load_matplotlib() -> None:
    """Import what `draw_timeline` uses (the slow part of drawing)."""
    import matplotlib.backends.backend_agg
    import matplotlib.figure  # noqa: F401


def draw_timeline(panels: list[Panel], title: str, path: Path, overwrite: bool = False
                  ) -> None:
    """Draw ``panels`` (allocated, stacked by category where exact, and reserved bytes over
    time; the peak marked) one under the other into the PNG ``path``, atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(panels)
    fig = Figure(figsize=(_WIDTH_IN, _PANEL_IN * n))
    FigureCanvasAgg(fig)
    # fixed margins (inches): tight_layout would measure every text first, a third of
    # the drawing's time, to find the same ones for this fixed kind of figure
    height = _PANEL_IN * n
    axes_in = (height - _TOP_IN - _BOTTOM_IN - _GAP_IN * (n - 1)) / n
    fig.subplots_adjust(left=_LEFT_IN / _WIDTH_IN, right=1 - _RIGHT_IN / _WIDTH_IN,
                        bottom=_BOTTOM_IN / height, top=1 - _TOP_IN / height,
                        hspace=_GAP_IN / axes_in)
    axes = fig.subplots(n, 1, squeeze=False)
    for ax, p in zip(axes[:, 0], panels, strict=True):
        ax.step(p.x, p.reserved, where="post", label="reserved", color=RESERVED_COLOUR,
                linewidth=1)
        if p.categories:
            ax.stackplot(p.x, *p.categories.values(), step="post",
                         labels=[k.replace("_", " ") for k in p.categories], alpha=0.8,
                         colors=[CATEGORY_COLOURS[k] for k in p.categories])
        else:
            ax.step(p.x, p.allocated, where="post", label="allocated", color=ALLOCATED_COLOUR)
        ax.axvline(p.x[p.peak], color=PEAK_COLOUR, linestyle=":", linewidth=1)
        ax.annotate(p.peak_label, (p.x[p.peak], p.allocated[p.peak]),
                    textcoords="offset points", xytext=(6, -12), color=PEAK_COLOUR, fontsize=9)
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.unit)
        ax.set_title(f"device {p.device}", loc="left", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title.replace("$", r"\$"), fontsize=10, y=1 - 0.12 / height)  # "$": math mode
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), overwrite)


def plot_timeline(findings: Findings, path: Path, title: str | None = None,
                  overwrite: bool = False) -> None:
    """Draw the timeline of every device of ``findings`` into the PNG ``path``, here."""
    draw_timeline(timeline_panels(findings), timeline_title(findings, title), path, overwrite)
