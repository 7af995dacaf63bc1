"""PNG plots of memory over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from memprof.analysis.findings import Findings
from memprof.report.files import write_atomic

# Points kept per panel: a few per pixel column of the 1,100-pixel-wide figure. A long
# trace's millions of steps would cost matplotlib hundreds of MiB and draw the same pixels.
_BUCKETS = 2048


def _unit(peak: int) -> tuple[str, float]:
    for name, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if peak >= 1 << shift:
            return name, float(1 << shift)
    return "B", 1.0


def _kept(allocated: np.ndarray, reserved: np.ndarray, peak: int) -> np.ndarray | slice:
    """The points to draw: all of a short timeline; of a long one, each of ``_BUCKETS``
    slices' first point and the highest and lowest allocated and reserved points in it
    (a step plot through them has the full one's outline), the peak and the last."""
    n = len(allocated)
    if n <= 4 * _BUCKETS:
        return slice(None)
    width = -(-n // _BUCKETS)
    starts = np.arange(0, n, width)
    kept = [starts, np.array([peak, n - 1])]
    for values in (allocated, reserved):
        padded = np.pad(values, (0, width * len(starts) - n), mode="edge").reshape(-1, width)
        kept += [starts + padded.argmax(axis=1), starts + padded.argmin(axis=1)]
    return np.unique(np.concatenate(kept))


def plot_timeline(findings: Findings, path: Path, title: str | None = None,
                  overwrite: bool = False) -> None:
    """Allocated (stacked by category where exact) and reserved bytes over time, one panel per
    device, the peak marked."""
    devices = findings.devices
    fig, axes = plt.subplots(len(devices), 1, figsize=(10, 3.2 * len(devices)), squeeze=False)
    for ax, d in zip(axes[:, 0], devices, strict=True):
        t = d.timeline
        unit, scale = _unit(max(d.peak_reserved_bytes, d.peak_allocated_bytes))
        if t.time_us is not None and len(t.time_us):
            x = np.concatenate([[t.time_us[0]], t.time_us]).astype(float)
            x = (x - x[0]) / 1e6
            ax.set_xlabel("seconds since the first recorded event")
        else:
            x = np.arange(-1, len(t.allocated) - 1)
            ax.set_xlabel("event")
        peak = d.peak_event_index + 1
        kept = _kept(t.allocated, t.reserved, peak)
        ax.step(x[kept], t.reserved[kept] / scale, where="post", label="reserved",
                color="black", linewidth=1)
        if d.category_timeline is not None:
            ax.stackplot(x[kept], *(v[kept] / scale for v in d.category_timeline.values()),
                         step="post", labels=[k.replace("_", " ") for k in d.category_timeline],
                         alpha=0.8)
        else:
            ax.step(x[kept], t.allocated[kept] / scale, where="post", label="allocated",
                    color="tab:blue")
        ax.axvline(x[peak], color="tab:red", linestyle=":", linewidth=1)
        ax.annotate(f"peak {d.peak_allocated_bytes / scale:.2f} {unit}",
                    (x[peak], t.allocated[peak] / scale), textcoords="offset points",
                    xytext=(6, -12), color="tab:red", fontsize=9)
        ax.set_ylabel(unit)
        ax.set_title(f"device {d.device}", loc="left", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
    # a "$" in a file name would start matplotlib's math mode
    name = (title or Path(findings.source).name).replace("$", r"\$")
    fig.suptitle(f"memprof: {name}", fontsize=10)
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), overwrite)
    finally:
        plt.close(fig)
