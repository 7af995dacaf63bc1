"""Attribution by nn.Module: bytes live at a moment per module path, with the model-code line.

Only ``memprof run`` knows which module made an allocation (its recorder watches them
run); snapshots recorded elsewhere carry no module and get no module table.
"""

from __future__ import annotations

from collections.abc import Iterable

from memprof.analysis.findings import ModuleUsage
from memprof.trace.model import Frame, Frames


def model_frame(frames: Frames, files: frozenset[str]) -> Frame | None:
    """The innermost frame in a file that defines a recorded module's forward: for a
    library model (Hugging Face), the model's line rather than the script's."""
    for frame in frames:
        if frame.filename in files:
            return frame
    return None


def rank_modules(rows: Iterable[tuple[str, int, Frame | None]], total: int, top: int
                 ) -> list[ModuleUsage]:
    """The ``top`` modules by bytes, from ``(module path, bytes, model frame)`` rows;
    ``total`` is what shares are of."""
    groups: dict[str, tuple[list[int], dict[Frame, int]]] = {}
    for path, size, frame in rows:
        counts, frames = groups.setdefault(path, ([0, 0], {}))
        counts[0] += size
        counts[1] += 1
        if frame is not None:
            frames[frame] = frames.get(frame, 0) + size
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1][0][0], kv[0]))[:top]
    return [ModuleUsage(path, held, count, held / total if total else 0.0,
                        max(frames, key=lambda f: (frames[f], f.filename, -f.line),
                            default=None))
            for path, ((held, count), frames) in ranked]


def rank_repeated(rows: Iterable[tuple[str, int, Frame | None]], total: int, top: int
                  ) -> list[ModuleUsage]:
    """The ``top`` patterns of repeated blocks' modules (``layers.*.mlp``, ``repeated``) by
    bytes, each summing at least two modules, from the rows ``rank_modules`` takes. An
    element of a list is a block where modules run inside it (``layers.3.mlp``): the
    elements of a list of single layers (a Sequential's conv, norm and activation) are
    different modules, not instances of one, and are not summed."""
    rows = list(rows)
    paths = {p for p, _, _ in rows}
    pattern = {path: repeated(path) for path in paths}
    blocks = {star.split(".*", 1)[0] for path, star in pattern.items()
              if not star.endswith(".*") and star != path}  # a list with modules inside
    instances: dict[str, set[str]] = {}
    for path, star in pattern.items():
        if star != path and (not star.endswith(".*") or star[:-2] in blocks):
            instances.setdefault(star, set()).add(path)
    summed = rank_modules(((pattern[p], size, frame) for p, size, frame in rows
                           if len(instances.get(pattern[p], ())) > 1), total, top)
    for m in summed:
        m.instances = len(instances[m.module])
    return summed


def repeated(path: str) -> str:
    """``path`` with the index of its outermost module list made ``*`` (``layers.3.mlp.0``:
    ``layers.*.mlp.0``; a list inside a block, ``mlp.0`` and ``mlp.2``, holds different
    modules); the first part, a root's name, is kept."""
    parts = path.split(".")
    at = next((i for i, part in enumerate(parts) if i and part.isdigit()), None)
    if at is not None:
        parts[at] = "*"
    return ".".join(parts)


def in_block(path: str) -> bool:
    """Whether a module path lies inside an element of a module list or sequence (a part
    after the first dotted part is a number: ``blocks.3.attn``, ``transformer.h.0``)."""
    return any(part.isdigit() for part in path.split(".")[1:])
