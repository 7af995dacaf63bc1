"""``memprof suggest RUN --predict``: what a run that ran out of memory needs, where the run
itself could not tell. A real GPU cannot re-run a script with more memory than it has, and
a virtual-GPU run may have been made with ``--no-need``; either way the recorded peak is a
lower bound. The script runs again on the virtual GPU, as the card the run used (its
memory, its CUDA context as measured there) with the memory raised (``need.py``), into the
run folder's ``need/``, and ``run.need`` is written into its report, as ``memprof run``
does on the virtual GPU.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from memprof.advise.rerun import Rerun
from memprof.advise.source import Run
from memprof.collect.launch.script import Target
from memprof.collect.virtual.cards import Card, parse_spec, recorded_card
from memprof.collect.virtual.need import NEED_FOLDER, Need, predict_need
from memprof.errors import MemprofError
from memprof.report.json import write_json
from memprof.report.units import format_bytes


def card_of(run: Run) -> Card:
    """The card ``run`` ran on, as the virtual GPU models it: a virtual run's own, or, for a
    real GPU, the card of its name (a size where memprof does not know the name) with the
    memory and CUDA context the run measured."""
    virtual = run.facts.get("virtual_gpu")
    if isinstance(virtual, dict):
        try:
            card = recorded_card(virtual)
        except ValueError:
            raise MemprofError(f"{run.path}: run.virtual_gpu.spec is not a card memprof"
                               " knows") from None
        return replace(card, total_bytes=virtual.get("total_bytes", card.total_bytes))
    cuda = run.facts.get("cuda")
    total = cuda.get("total_bytes") if isinstance(cuda, dict) else None
    if type(total) is not int or total <= 0:
        raise MemprofError(f"{run.path}: the report does not say which GPU the run used"
                           " (run.cuda.total_bytes): --predict re-runs it as that card")
    name = cuda.get("name")
    try:
        card = parse_spec(name) if isinstance(name, str) else parse_spec(str(total))
    except ValueError:
        card = parse_spec(str(total))
    context = cuda.get("context_bytes")
    measured = type(context) is int and 0 <= context < total
    return replace(card, total_bytes=total,
                   context_bytes=context if measured else card.context_bytes,
                   context_measured=measured or card.context_measured)


def predict(run: Run, rerun: Rerun) -> dict[str, Any]:
    """Re-run ``run``'s script on its card with the memory raised; write ``run.need`` into
    its report and return it."""
    if (run.facts.get("world_size") or 1) > 1:
        raise MemprofError(
            f"{run.path}: a rank of a distributed run: --predict re-runs one process; run the"
            " script with memprof run --nproc-per-node N --virtual-gpu CARD, which runs a world"
            " that ran out of memory again with the memory raised")
    card = card_of(run)
    print(f"memprof: the run ran out of memory, so its peak is a lower bound; running it"
          f" again on the virtual {card.name} ({format_bytes(card.total_bytes)}) with its"
          " memory raised to tell what it needs ...", file=sys.stderr)
    option = rerun.target[0] if rerun.target[0] in ("-m", "-c") else None
    target = Target(rerun.script, tuple(rerun.args), option == "-m", option == "-c")
    steps = run.facts.get("optimizer_steps") or 0
    seconds = run.facts.get("duration_s") or 0.0
    oom = run.device.get("oom") or {}  # what the run could reserve when it ran out
    need = predict_need(target, card, rerun.alloc_conf, steps, None, seconds,
                        (run.path.parent / NEED_FOLDER).resolve(), rerun.cwd,
                        oom.get("limit_bytes"))
    facts = need.as_dict() if isinstance(need, Need) else {"unknown": need}
    write_json({**run.report, "run": {**run.facts, "need": facts}}, run.path, overwrite=True)
    return facts
