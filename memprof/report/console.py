"""The console report: the numbers a user needs first at the top, then the detail."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from memprof.analysis.findings import (
    BOUNDED,
    NO_GROWTH,
    NO_STEPS,
    DeviceFindings,
    Findings,
    Leak,
    Live,
    Oom,
    ReplaySummary,
    StepGrowth,
    StepPeak,
)
from memprof.analysis.modules import repeated
from memprof.analysis.sites import short_path
from memprof.analysis.steps import WARMUP_STEPS
from memprof.report.text import plain, visible
from memprof.report.units import format_bytes as fb

CATEGORY_NAMES = {
    "parameters": "parameters",
    "buffers": "buffers (module state)",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "communication": "communication buffers",
    "activations": "activations",
    "temporaries": "temporaries",
    "workspace": "library workspaces (cuBLAS)",
    "other": "other",
}

NO_STEPS_RECORDED = ("no optimizer.step() was recorded (the script updates parameters itself, or"
                     " it ended before its first step), so per-step figures and the leak"
                     " verdict are unavailable")
NO_STEPS_FOREIGN = ("the snapshot does not mark optimizer steps (memprof run records them), so"
                    " per-step figures and the leak verdict are unavailable")


def render(findings: Findings, console: Console) -> None:
    """Print the whole explanation."""
    settings = visible(findings.allocator_conf or "defaults")
    console.print(Text.assemble(("memprof explain ", "bold"), visible(findings.source),
                                (f"  (snapshot format {findings.format}, allocator: {settings})",
                                 "dim")))
    if not findings.devices:
        console.print("The snapshot is empty: no segments and no recorded events.")
        return
    for device in findings.devices:
        console.print(_device(device))
    if len({d.rank for d in findings.devices}) > 1:
        console.print(ranks_table(findings.devices))


LOWER_BOUND = ("\nThe recording ran out of memory, so its peak is a lower bound: the run never got"
               " past it, and a replay on a larger device fits only what ran. What it needs:"
               " `memprof run --virtual-gpu CARD` re-runs it with the memory raised (run.need"
               " in its report.json), and `memprof suggest RUN --predict` does for a run"
               " on a real GPU.")


def ranks_table(devices: list[DeviceFindings]) -> Table:
    """Peak memory per rank of a distributed run, and how uneven it is."""
    t = Table(title="Ranks", title_justify="left", box=None, header_style="bold")
    for col in ("rank", "device", "peak allocated", "peak reserved"):
        t.add_column(col, justify="right")
    for d in devices:
        t.add_row(str(d.rank), str(d.device), fb(d.peak_allocated_bytes),
                  fb(d.peak_reserved_bytes))
    peaks = [d.peak_allocated_bytes for d in devices]
    t.caption = (f"imbalance: the largest rank peaks at {max(peaks) / max(min(peaks), 1):.2f}x"
                 " the smallest")
    return t


def _device(d: DeviceFindings) -> Panel:
    parts: list = [_headline(d), _live_tables(d.at_peak, d.categories_inferred, "at the peak")]
    parts += [Text(""), *step_section(d)]
    parts.append(_fragmentation(d))
    parts.extend(oom_group(o, o.live.allocated_bytes == d.peak_allocated_bytes,
                           d.categories_inferred) for o in d.ooms)
    parts.extend(more_ooms(d))
    if d.ooms:
        parts.append(Text(LOWER_BOUND, "bold"))
    parts.append(replay_text(d.replay))
    title = f"device {d.device}" if d.rank is None else f"rank {d.rank}, device {d.device}"
    return Panel(Group(*parts), title=title, title_align="left")


def _headline(d: DeviceFindings) -> Table:
    when = "before the first recorded event" if d.peak_event_index < 0 else \
        f"at event {d.peak_event_index:,} of {d.events:,}"
    if d.peak_time_us is not None and d.first_time_us is not None:
        when += f" ({(d.peak_time_us - d.first_time_us) / 1e6:.3f} s into the recording)"
    t = Table.grid(padding=(0, 2))
    t.add_row(Text("peak allocated", style="bold"), Text(fb(d.peak_allocated_bytes), "bold red"),
              Text(when, "dim"))
    t.add_row("peak reserved", fb(d.peak_reserved_bytes),
              Text("what the caching allocator held from the device (nvidia-smi shows this"
                   " plus the CUDA context)", "dim"))
    t.add_row("reserved at the peak", fb(d.reserved_at_peak_bytes),
              Text(f"of which {fb(d.reserved_at_peak_bytes - d.peak_allocated_bytes)}"
                   " cached but unallocated", "dim"))
    t.add_row("at the end", f"{fb(d.end_allocated_bytes)} allocated",
              f"{fb(d.end_reserved_bytes)} reserved")
    if d.blocks_before_window:
        t.add_row("before the window", f"{d.blocks_before_window:,} blocks",
                  Text(f"{fb(d.bytes_before_window)} allocated before the first recorded event"
                       " (the trace is a ring buffer)", "dim"))
    if d.events_dropped:
        t.add_row("dropped", f"{d.events_dropped:,} events", Text(ring_buffer_note(d), "dim"))
    return t


def ring_buffer_note(d: DeviceFindings) -> str:
    """What a trace from memprof's own ring buffer still tells exactly, and what it lost."""
    note = (f"The trace is a ring buffer (--max-entries): the {d.events_dropped:,} oldest events"
            f" were dropped; the peak and steps are those of the last {d.events:,}, and every"
            " allocation still alive kept its event.")
    earlier = d.peak_before_window()
    if earlier is None:
        return note
    allocated, reserved, exact = earlier
    held = (f"{fb(allocated)} allocated" + (f", {fb(reserved)} reserved" if reserved else "")
            if exact else f"at least {fb(allocated)} allocated")
    return (f"{note} The run's peak came before them: {held} (the breakdown is the kept"
            " events'); stop earlier with --steps or keep more with --max-entries to see it.")


def _live_tables(live: Live, inferred: bool, moment: str) -> Group:
    how = " (inferred from stacks and lifetimes)" if inferred else ""
    cats = Table(title=f"What was allocated {moment}, by category{how}", title_justify="left",
                 box=None, show_header=True, header_style="bold")
    cats.add_column("category")
    cats.add_column("bytes", justify="right")
    cats.add_column("share", justify="right")
    total = live.allocated_bytes or 1
    for key, value in sorted(live.categories.items(), key=lambda kv: -kv[1]):
        if value:
            cats.add_row(CATEGORY_NAMES[key], fb(value), f"{100 * value / total:.1f}%")
    if live.requested:  # the bytes above are the allocator's blocks: what a hand count finds
        cats.add_row(Text("the tensors' own bytes (blocks round up)", "dim"),
                     Text(fb(sum(live.requested.values())), "dim"), "")
    parts = [Text(""), cats, Text(""), sites_table(live, moment)]
    if live.modules:
        parts += [Text(""), modules_table(live, moment)]
    return Group(*parts)


def sites_table(live: Live, moment: str) -> Table:
    """The allocation sites that held the most memory at ``moment``."""
    sites = Table(title=f"Top allocation sites {moment}", title_justify="left", box=None,
                  header_style="bold")
    sites.add_column("bytes", justify="right")
    sites.add_column("share", justify="right")
    sites.add_column("blocks", justify="right")
    sites.add_column("site (your line → the library call under it)")
    for s in live.sites:
        sites.add_row(fb(s.bytes), f"{100 * s.share:.1f}%", f"{s.count:,}", plain(s.label))
    return sites


def modules_table(live: Live, moment: str) -> Table:
    """The nn.Modules whose allocations held the most memory at ``moment``: repeated
    blocks summed (``layers.*.mlp x32``) in place of their blocks' rows, most first, so a
    large module outside them (an output layer) keeps its row."""
    summed = " (repeated blocks summed)" if live.repeated_modules else ""
    t = Table(title=f"Top modules {moment} (the innermost one running at each allocation)"
              f"{summed}", title_justify="left", box=None, header_style="bold")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    t.add_column("blocks", justify="right")
    t.add_column("module", overflow="fold")  # cut, paths alike would all read the same
    framed = any(m.frame for m in live.modules)  # none where no stacks were recorded
    if framed:
        t.add_column("model code")
    patterns = {m.module for m in live.repeated_modules}
    rows = sorted([*live.repeated_modules, *(m for m in live.modules
                                             if repeated(m.module) not in patterns)],
                  key=lambda m: -m.bytes)
    for m in rows[:max(len(live.modules), len(live.repeated_modules))]:
        name = f"{m.module} x{m.instances}" if m.instances > 1 else m.module
        row = [fb(m.bytes), f"{100 * m.share:.1f}%", f"{m.count:,}", plain(name)]
        if framed:
            row.append(plain(f"{short_path(m.frame.filename, 1)}:{m.frame.line} {m.frame.name}"
                             if m.frame else ""))
        t.add_row(*row)
    return t


# rows of the per-step table before its middle is elided (report.json keeps every step)
MAX_STEP_ROWS = 16


def steps_table(steps: list[StepPeak], peak_event: int | None = None,
                peak_bytes: int = 0) -> Table:
    """Peak and retained memory per optimizer step: consecutive steps that read the same
    share a row, the peak's step has its own, and a long run shows its first and last rows."""
    t = Table(title="Per step (steps end at optimizer.step())", title_justify="left", box=None,
              header_style="bold")
    t.add_column("step", justify="right")
    t.add_column("peak allocated", justify="right")
    t.add_column("allocated after the step", justify="right")
    # the run's peak outside every step (an evaluation after the last, the model built
    # before the first): a row of its own, and no step marked
    outside = peak_event is not None and not any(p.start <= peak_event < p.end for p in steps)
    top = None if outside else max(steps, key=lambda p: p.peak_allocated_bytes)
    runs: list[list[StepPeak]] = []
    for p in steps:
        last = runs[-1][-1] if runs else None
        if (last is None or p is top or last is top
                or (fb(p.peak_allocated_bytes), fb(p.end_allocated_bytes))
                != (fb(last.peak_allocated_bytes), fb(last.end_allocated_bytes))):
            runs.append([p])
        else:
            runs[-1].append(p)
    peak_run = next((i for i, run in enumerate(runs) if run[0] is top), 0)
    half = MAX_STEP_ROWS // 2
    shown = set(range(len(runs))) if len(runs) <= MAX_STEP_ROWS else \
        {*range(half), *range(len(runs) - half + 1, len(runs)), peak_run}
    for i, run in enumerate(runs):
        if i not in shown:
            if i - 1 in shown:
                t.add_row("…", "", "")
            continue
        first, last = run[0], run[-1]
        label = str(first.step) if first is last else f"{first.step}–{last.step}"
        mark = " ← peak" if first is top else ""
        t.add_row(label, fb(first.peak_allocated_bytes) + mark, fb(first.end_allocated_bytes))
    if outside:
        after = peak_event >= steps[-1].end  # type: ignore[operator]
        t.add_row(f"after {steps[-1].step}" if after else f"before {steps[0].step}",
                  f"{fb(peak_bytes)} ← peak", "")
    return t


def step_section(d: DeviceFindings) -> list[Table | Text]:
    """The per-step table and the leak verdict, or why there are none."""
    if d.step_growth.verdict == NO_STEPS:
        why = NO_STEPS_FOREIGN if d.categories_inferred else NO_STEPS_RECORDED
        return [Text(f"No step section: {why}.", "yellow")]
    return [steps_table(d.steps, d.peak_event_index, d.peak_allocated_bytes),
            growth_text(d.step_growth, d.leak)]


def growth_text(growth: StepGrowth, leak: Leak | None) -> Text:
    """The verdict on the memory left allocated after each step, one line."""
    if leak is not None:  # set exactly when the verdict is a leak
        where = f"; grows most: {visible(leak.site.label)} (+{fb(leak.site_growth_bytes)})" \
            if leak.site else ""
        return Text.assemble(
            ("PROBABLE LEAK", "bold white on red"),
            f" memory left allocated grew by {fb(leak.growth_per_step_bytes)} per step over"
            f" {leak.steps} steps, through the last{where}. Something keeps tensors (or their"
            " autograd graph) alive across steps, e.g. accumulating a loss without .item() or"
            " .detach().")
    if growth.verdict == NO_GROWTH:
        return Text(f"No growth across {growth.steps} steps: no sign of a leak.", "green")
    if growth.verdict == BOUNDED:
        return Text(_bounded(growth), "green")
    still = f", and memory left after each step still grows unevenly (+{fb(growth.growth_bytes)}" \
        f" after step {WARMUP_STEPS})" if growth.growth_bytes else ""
    return Text(f"Too few steps to tell whether memory leaks: {growth.steps} recorded{still}; a"
                f" verdict needs {growth.steps_needed} (e.g. memprof run --steps"
                f" {growth.steps_needed}, with a script that runs that long).", "yellow")


def _bounded(growth: StepGrowth) -> str:
    state = growth.optimizer_state_growth_bytes
    parts = [f"memory left allocated grew by {fb(growth.growth_bytes)}"] \
        if growth.growth_bytes else []
    if state:
        parts.append(f"optimizer state grew by {fb(state)} (e.g. LBFGS history, bounded by"
                     " its history_size)")
    ended = "through the last step" if growth.grew_until_step == growth.steps else \
        f"then stopped after step {growth.grew_until_step}"
    return (f"Bounded growth, not a leak: after step {WARMUP_STEPS} {' and '.join(parts)},"
            f" {ended}; a leak grows by a steady amount every step.")


def _fragmentation(d: DeviceFindings) -> Group:
    f = d.fragmentation
    t = Table(title="Allocator cache and fragmentation", title_justify="left", box=None,
              header_style="bold")
    t.add_column("")
    t.add_column("at the peak", justify="right")
    t.add_column("at the end", justify="right")
    t.add_row("reserved but unallocated", fb(f.unallocated_at_peak_bytes),
              fb(f.unallocated_at_end_bytes))
    t.add_row("largest free block", fb(f.largest_free_block_at_peak_bytes),
              fb(f.largest_free_block_at_end_bytes))
    pools = Table(box=None, header_style="bold")
    for col in ("pool", "stream", "segments", "reserved", "allocated"):
        pools.add_column(col, justify="left" if col == "pool" else "right")
    for p in f.pools_at_end:
        pools.add_row(plain(p.pool), str(p.stream), f"{p.segments:,}", fb(p.reserved_bytes),
                      fb(p.allocated_bytes))
    return Group(Text(""), t, Text("Segments at the end, by pool and stream", "bold"), pools)


def more_ooms(d: DeviceFindings) -> list[Text]:
    """A line for the out-of-memory events past those described, if any."""
    more = d.oom_events - len(d.ooms)
    return [Text(f"... and {more:,} more out-of-memory events (the first {len(d.ooms)} are"
                 " described)")] if more > 0 else []


def oom_group(o: Oom, same_as_peak: bool, inferred: bool) -> Group:
    """An out-of-memory event: the request, why it failed, what held the memory
    (``inferred``: its categories come from stacks, the snapshot has no labels)."""
    head = oom_text(o)
    if same_as_peak:
        return Group(Text(""), head, Text("What held the memory: the peak, above.", "bold"))
    return Group(Text(""), head, _live_tables(o.live, inferred, "at the OOM"))


def oom_text(o: Oom) -> Text:
    """An out-of-memory event's request and why it failed."""
    if o.kind == "fragmentation":
        why = (f"Fragmentation: replayed with expandable segments in the same"
               f" {fb(o.limit_bytes)}, the request fits ({fb(o.expandable_reserved_bytes)}"
               f" reserved before it, against {fb(o.reserved_bytes)} recorded; the largest free"
               f" block was {fb(o.largest_free_block_bytes)}). Set"
               " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    else:
        why = (f"A real shortage: the request needed {fb(o.short_bytes)} more than the"
               f" {fb(o.limit_bytes)} PyTorch could reserve; replayed with expandable segments"
               f" it does not fit either (not fragmentation). {fb(o.cached_free_bytes)} was"
               " cached free. Reduce what is live (see below) or shard/offload it.")
    return Text.assemble(
        ("OUT OF MEMORY", "bold white on red"),
        f" at event {o.event_index:,}: asked for {fb(o.requested_bytes)} (tried to obtain"
        f" {fb(o.device_alloc_bytes)} from the device) with {fb(o.allocated_bytes)} allocated"
        f" and {fb(o.reserved_bytes)} reserved.\n", why)


def replay_text(r: ReplaySummary) -> Text:
    """The allocator replay's check and its what-ifs."""
    if not r.modelled:
        line = "not modelled"
    elif not r.decisions_total:
        line = "no allocation in the trace to check the allocator model against"
    else:
        line = (f"{r.decisions_matched:,}/{r.decisions_total:,} decisions and"
                f" {r.addresses_matched:,}/{r.addresses_total:,} block addresses reproduced;"
                f" {r.segments_predicted}/{r.segments_recorded} new segments predicted/recorded;"
                f" peak reserved predicted {fb(r.reserved_bytes_predicted_peak)},"
                f" recorded {fb(r.reserved_bytes_recorded_peak)}")
    text = Text.assemble(("\nAllocator replay: ", "bold"), line, f" ({visible(r.note)})")
    for w in r.what_if:
        text.append(f"\n  what if {visible(w.settings)}")
        if w.device_memory_bytes is not None:
            text.append(f" on a device with {fb(w.device_memory_bytes)} for PyTorch")
        if w.oom_event_index is not None:
            where = "before the first event" if w.oom_event_index < 0 else \
                f"at event {w.oom_event_index:,}"
            text.append(f": OUT OF MEMORY {where}, asking for {fb(w.oom_requested_bytes or 0)}",
                        style="bold red")
            continue
        change = f"{fb(w.saved_bytes)} less" if w.saved_bytes >= 0 else \
            f"{fb(-w.saved_bytes)} more"
        fits = ", fits" if w.device_memory_bytes is not None else ""
        text.append(f": peak reserved {fb(w.peak_reserved_bytes)}{fits}; {change} than the"
                    " recorded settings in the same simulation")
    return text
