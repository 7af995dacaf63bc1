"""Training scripts nobody here wrote, on a real GPU and on the virtual one.

``gpu_validation.py device`` runs each job on the card under ``gpu_probe.py`` (PyTorch's
own counters) and, for the third-party ones, under ``memprof run`` (the card's snapshot);
``gpu_validation.py table`` keeps the card's counters in ``results/gpu-thirdparty.json``
and predicts each job here with ``memprof run --virtual-gpu`` for the table. The jobs:
nanoGPT's ``train.py`` (Shakespeare-character config, bf16 autocast, dropout 0.2; eager,
and compiled as its README runs it), minGPT's chargpt, and ground-truth scripts (the
CS336 runs of ``groundtruth.py``) that dump their own snapshot, recorded again on this
card. Checkouts come from the ``fetch`` tool; their code is never copied here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from measure import RESULTS

ROOT = Path(__file__).resolve().parent.parent
COUNTERS = RESULTS / "gpu-thirdparty.json"
KEPT = ("max_memory_allocated", "max_memory_reserved", "compiled_graphs", "torch", "name",
        "exit_code")
# ground-truth runs whose script dumps its own snapshot, recorded again on the card
GROUNDTRUTH_ON_CARD = (
    "Wedsonlin+assignment2-systems+results_medium_128_inference_memory_snapshot.pickle",
    "Wedsonlin+assignment2-systems+results_medium_512_training_memory_snapshot.pickle",
    "NiuHuangxiaozi+assignment2-systems+cs336_systems_profile_memory_forward_and_backward_"
    "memory_snapshot_200.pickle")


@dataclass(frozen=True)
class Job:
    name: str
    argv: list[str]  # the script (absolute) and its arguments
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    recorded: bool = True  # also run under memprof run on the card
    python: tuple[int, int] = (3, 10)  # the oldest Python that parses the script
    note: str = ""


def jobs(nanogpt: Path | None, mingpt: Path | None, checkouts: dict[str, Path], out: Path
         ) -> list[Job]:
    """The jobs these checkouts allow, with their data and scratch folders under ``out``."""
    from groundtruth import RUNS
    from real_scripts import mingpt as mingpt_workload
    from real_scripts import nanogpt_argv

    found = []
    if nanogpt is not None:
        argv = [str(nanogpt / "train.py"), *nanogpt_argv(out)[1:]]
        found += [Job("nanoGPT eager", [*argv, "--compile=False", "--max_iters=10"], nanogpt),
                  Job("nanoGPT compiled", [*argv, "--max_iters=10"], nanogpt, recorded=False,
                      note="the virtual GPU runs torch.compile's code eagerly")]
    if mingpt is not None:
        work = mingpt_workload(mingpt, 20, out)
        found.append(Job("minGPT chargpt", work.argv, work.cwd, _path(work.env["PYTHONPATH"])))
    for run in RUNS:
        checkout = checkouts.get(run.checkout)
        if checkout is None or run.fixture not in GROUNDTRUTH_ON_CARD:
            continue
        scratch = out / "groundtruth" / run.fixture.removesuffix(".pickle")
        (scratch / run.dump).parent.mkdir(parents=True, exist_ok=True)
        (scratch / run.cwd).mkdir(parents=True, exist_ok=True)
        found.append(Job(run.label, [str(checkout / run.script), *run.args], scratch / run.cwd,
                         _path(*(str(checkout / p) for p in run.pythonpath)), recorded=False,
                         python=run.python))
    return found


def _path(*folders: str) -> dict[str, str]:
    """A PYTHONPATH with memprof's source tree, ``folders``, and the one set now."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), *folders,
                                           os.environ.get("PYTHONPATH", "")])}


def keep(results: dict[str, Any]) -> None:
    """Save the card's counters of a ``gpu_validation.py device`` folder's third-party
    jobs in ``results/gpu-thirdparty.json`` (merged by job)."""
    kept = json.loads(COUNTERS.read_text()) if COUNTERS.is_file() else {}
    for name, ran in results.get("third_party", {}).items():
        probe = ran["plain"].get("probe", {})
        if probe.get("exit_code") == 0:
            kept[name] = {k: probe[k] for k in KEPT if k in probe}
    COUNTERS.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def rows(nanogpt: Path | None, mingpt: Path | None, checkouts: dict[str, Path]
         ) -> list[list[str]]:
    """A row per job the card ran and these checkouts allow: the card's peaks against
    ``memprof run --virtual-gpu`` on the card's name, as its torch lays out cuBLASLt."""
    from measure import error

    from memprof.collect.virtual.workspaces import unified_setting

    card = json.loads(COUNTERS.read_text()) if COUNTERS.is_file() else {}
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for job in jobs(nanogpt, mingpt, checkouts, Path(tmp)):
            real = card.get(job.name)
            if real is None:
                continue
            a, r = real["max_memory_allocated"], real["max_memory_reserved"]
            peak = _predict(job, real, Path(tmp) / "memprof", unified_setting(real["torch"]))
            if isinstance(peak, str):
                found.append([job.name, f"{a:,}", peak, "", f"{r:,}", "", "", job.note])
                continue
            pa, pr = peak["allocated_bytes"], peak["reserved_bytes"]
            found.append([job.name, f"{a:,}", f"{pa:,}", error(pa, a), f"{r:,}", f"{pr:,}",
                          error(pr, r), job.note])
    return found


def _predict(job: Job, real: dict[str, Any], out: Path, unified: str) -> dict[str, int] | str:
    """The virtual GPU's peaks for ``job``, or why there are none."""
    if sys.version_info[:2] < job.python:
        return f"not predicted: the script needs Python {'.'.join(map(str, job.python))}"
    done = subprocess.run(
        [sys.executable, "-m", "memprof", "run", "--virtual-gpu", real["name"].split()[-1],
         "--no-timeline", "--force", "-o", str(out), *job.argv], cwd=job.cwd,
        env={**os.environ, **job.env, "TORCH_CUBLASLT_UNIFIED_WORKSPACE": unified},
        capture_output=True, text=True, check=False)
    report = out / "report.json"
    if done.returncode != 0 or not report.is_file():
        return f"not predicted: exit {done.returncode}"
    return json.loads(report.read_text())["devices"][0]["peak"]
