"""Re-run a recorded run with a remedy applied, and read its peak: ``--verify`` and
``--fit-batch``.

The command comes from the run's report (``run.command``); it runs again as ``memprof
run`` in a subprocess, on the same virtual GPU (or the CPU recorder, or the GPU) as the
original, stopped after a few optimizer steps, from the folder it ran from.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memprof import warm
from memprof.advise.peak import Peak, peak_of
from memprof.advise.script_flags import flag_value, option_flags, parser_default, with_arg
from memprof.advise.source import Run
from memprof.collect.launch.children import FOLLOWED_CODE
from memprof.errors import MemprofError
from memprof.report.cluster import rank_reports
from memprof.report.provenance import signed_here
from memprof.trace.fields import describe

RERUN_STEPS = 3  # the peak of a training step shows by its second or third step
MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class Rerun:
    """How to re-run a run: its target, where it ran, how many steps."""

    target: list[str]  # [-m] name args...
    where: list[str]  # --virtual-gpu SPEC, --device cpu or --device cuda
    steps: int | None
    alloc_conf: str
    cwd: str | None = None  # the folder it ran from (None: the current one)
    rank: Rank | None = None  # a rank of a distributed run: the world is launched again
    env: dict[str, str] | None = None  # what its launcher set (accelerate launch's settings)

    @classmethod
    def of(cls, run: Run, given: list[str] | None = None) -> Rerun:
        """How to re-run ``run``: its recorded command, only when ``memprof run`` here wrote
        the report (``provenance.py``); else ``given``, the command the user typed (the
        script and its arguments, from the current folder)."""
        facts = run.facts
        command = facts.get("command")
        if not isinstance(command, list) or len(command) < 3 or command[:2] != ["memprof", "run"]:
            raise MemprofError(f"{run.path}: not the report of a memprof run (a snapshot or an"
                               " explain report): --verify and --fit-batch re-run its script")
        recorded = [str(c) for c in command[2:]]
        spawned = given is None and recorded[:1] == ["-c"] and len(recorded) > 1 \
            and recorded[1].startswith(FOLLOWED_CODE)
        if spawned and (spawner := _spawner(run)) is not None:
            facts = spawner  # a rank mp.spawn started: its world is the spawner's to re-run
            recorded = [str(c) for c in facts["command"][2:]]
        elif spawned:
            raise MemprofError(
                f"{run.path}: the report of a process the script spawned (memprof run followed"
                " it); its command is multiprocessing's, which cannot run again alone:"
                " give --rerun-command 'SCRIPT ARGS' with a script that runs its training"
                " in a process of its own")
        if given is None and not signed_here(facts):
            raise MemprofError(
                f"{run.path}: --verify and --fit-batch re-run the command a report recorded"
                f" ({_gist(shlex.join(recorded), 120)}), and this report was not written by"
                " memprof run here, for you: check that command, then give it with"
                " --rerun-command 'SCRIPT ARGS' to re-run it from this folder")
        # the report's fields have their types (report/checked.py); their meaning is checked
        where = _where(run.path, facts)
        conf = facts.get("allocator_conf") or ""
        if _bad_conf(conf):
            raise MemprofError(f"{run.path}: run.allocator_conf is not allocator settings")
        cwd = facts.get("cwd") if given is None else None
        env = facts.get("launcher_env") if given is None else None
        rank = _rank(run, where, facts.get("cards") if spawned else None)
        rerun = cls(given or recorded, where, _steps_to_peak(run), conf, cwd, rank, env)
        if rerun.target[0] not in ("-m", "-c") and not Path(cwd or ".", rerun.script).is_file():
            where_from = f"from {cwd}, where it ran" if cwd else \
                "from here (run memprof suggest in the folder memprof run ran in)"
            raise MemprofError(f"{run.path}: cannot find its script {rerun.script} {where_from};"
                               " --verify and --fit-batch re-run it")
        return rerun

    def peak(self, args: list[str] | None = None, apply: dict[str, Any] | None = None,
             alloc_conf: str | None = None, world: int | None = None) -> Peak | None:
        """The peak of the run with the script's ``args`` replaced, remedies applied in the
        script's process, other allocator settings, or (a rank of a distributed run) a
        world of ``world`` ranks, where it is the worst rank's; None if it ran out of
        memory."""
        target = self.target if args is None else [*self.target[:self.target.index(
            self.script) + 1], *args]
        conf = alloc_conf if alloc_conf is not None else self.alloc_conf
        with tempfile.TemporaryDirectory(prefix="memprof-suggest-") as scratch:
            out = Path(scratch) / "run"
            args = ["-m", "memprof", "run", "-o", str(out), "--no-timeline", "--no-need",
                    *self.where, *(["--steps", str(self.steps)] if self.steps else []),
                    *(["--alloc-conf", conf] if conf else []),
                    *(self.rank.options(self.where, world) if self.rank else []), *target]
            env = {**os.environ, **(self.env or {}), "MEMPROF_APPLY": json.dumps(apply or {})}
            done = warm.run(args, self.cwd or os.getcwd(), env)
            reports = [out / "report.json"] if self.rank is None else \
                list(rank_reports(out).values())
            if not reports or not all(report.is_file() for report in reports):
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise MemprofError(f"re-running {' '.join(target)} failed: {_gist(last)}")
            data = _worst([json.loads(report.read_text()) for report in reports])
        ended = data["run"]["exit"]
        if ended["status"] == "raised" and any(d.get("oom") for d in data["devices"]):
            return None
        if ended["code"]:  # a peak from a run that failed is no measurement
            changed = f" with {json.dumps(apply)}" if apply else ""
            raise MemprofError(f"re-running {' '.join(target)}{changed} failed (exit code"
                               f" {ended['code']}): {_gist(ended.get('error') or '')}")
        if not data["devices"]:
            raise MemprofError(f"re-running {' '.join(target)}: it made no CUDA tensor")
        return peak_of(max(data["devices"], key=lambda d: d["peak"]["reserved_bytes"]))

    @property
    def on_cpu(self) -> bool:
        """Whether the run is a CPU recording (``--device cpu``)."""
        return self.where == ["--device", "cpu"]

    @property
    def script(self) -> str:
        return self.target[1] if self.target[0] in ("-m", "-c") else self.target[0]

    def value_of(self, name: str) -> int:
        """The integer value of the script's ``--name``: as the command gives it, else its
        argparse default, read from the script's source (never run). MemprofError when
        neither says."""
        given = flag_value(self.args, self.flags(name))
        if given is None and self.target[0] not in ("-m", "-c"):
            given = parser_default(Path(self.cwd or ".", self.script), name)
        if given is None:
            raise MemprofError(f"--batch-arg/--fit-batch {name}: the recorded command does not"
                               f" set --{name.lstrip('-')} to a number, nor does the script's"
                               " argparse default; run it with the flag given explicitly")
        return given

    def flags(self, name: str) -> list[str]:
        """The flags that set the script's ``--name`` (``option_flags``), or ``name`` itself
        where the command gives it as ``name=VALUE`` (Hydra's and OmegaConf's overrides,
        ``trainer_config.batch_size=32``)."""
        if any(arg.startswith(f"{name}=") for arg in self.args):
            return [name]
        script = None if self.target[0] in ("-m", "-c") else Path(self.cwd or ".", self.script)
        return option_flags(script, name)

    def with_value(self, name: str, value: int) -> list[str]:
        """The script's arguments with ``--name`` (or an alias of it) set to ``value``."""
        return with_arg(self.args, self.flags(name), value)

    @property
    def args(self) -> list[str]:
        return self.target[self.target.index(self.script) + 1:]


@dataclass(frozen=True)
class Rank:
    """A rank of a distributed run, to re-run with its world: ``nodes`` x ``per_node``."""

    rank: int
    nodes: int
    per_node: int
    # every rank must run: a pipeline's stages wait for each other's shapes and values
    whole: bool = False
    spawned: bool = False  # a process the script started (mp.spawn), one per virtual card

    def options(self, where: list[str], world: int | None = None) -> list[str]:
        """The ``memprof run`` options that launch the world again: on virtual cards this
        rank alone (``--ranks``; every rank where ``whole``), on GPUs every rank. A world of
        another size (``world``) keeps the ranks per node where they divide it (else one
        node) and runs its first and last ranks and this one's index, where it still is
        one."""
        virtual = where[0] == "--virtual-gpu"
        if self.spawned:  # the script starts a rank per card it sees
            return ["--cards", str(world or self.per_node)]
        nodes, per_node, ranks = self.nodes, self.per_node, str(self.rank)
        if world is not None and world != nodes * per_node:
            if not virtual:
                raise MemprofError(f"a world of {world} ranks is re-run on virtual cards only:"
                                   " this run's ranks ran on GPUs")
            nodes, per_node = (world // per_node, per_node) if world % per_node == 0 \
                else (1, world)
            ranks = ",".join(map(str, sorted({0, min(self.rank, world - 1), world - 1})))
        return ["--nnodes", str(nodes), "--nproc-per-node", str(per_node),
                *(["--ranks", ranks] if virtual and not self.whole else [])]


MAX_GPU_RANKS = 64  # a GPU re-run starts every rank on this machine


def _worst(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the reports of a re-run's ranks, the one that ran out of memory or failed first
    (the cluster's answer), else the one whose peak reserved is the largest."""
    def reserved(report: dict[str, Any]) -> int:
        return max((d["peak"]["reserved_bytes"] for d in report["devices"]), default=0)
    failed = [r for r in reports if r["run"]["exit"]["code"]]
    return failed[0] if failed else max(reports, key=reserved)


def _spawner(run: Run) -> dict[str, Any] | None:
    """The ``run`` facts of the run whose script spawned ``run``'s process as a rank of its
    world, one per virtual card (``memprof run --cards N``); None where it was not one."""
    from memprof.report.checked import first_problem

    if (run.facts.get("world_size") or 1) < 2:
        return None
    with contextlib.suppress(OSError, ValueError, RecursionError):
        data = json.loads((run.path.parent.parent / "report.json").read_bytes())
        if isinstance(data, dict) and not first_problem(data) \
                and isinstance(data["run"].get("cards"), int):
            return data["run"]
    return None


def _rank(run: Run, where: list[str], cards: int | None = None) -> Rank | None:
    """The rank ``run`` is of a distributed run, and its layout (from the ``cluster.json``
    beside its folder, else one node), or None for a single process; with ``cards``, a
    rank the script spawned on one of that many cards."""
    from memprof.cli.run_cluster import CLUSTER_FILE

    world, rank = run.facts.get("world_size") or 1, run.facts.get("rank") or 0
    if world == 1:
        return None
    if cards is not None:
        return Rank(rank, 1, cards, spawned=True)
    nodes, per_node = 1, world
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        layout = json.loads((run.path.parent.parent / CLUSTER_FILE).read_text())
        if layout["nodes"] * layout["ranks_per_node"] == world:
            nodes, per_node = int(layout["nodes"]), int(layout["ranks_per_node"])
    if where[0] != "--virtual-gpu" and (nodes > 1 or world > MAX_GPU_RANKS):
        raise MemprofError(f"{run.path}: rank {rank} of {nodes} node(s) x {per_node} on GPUs:"
                           " re-running it starts every rank on this machine, which takes one"
                           " node; re-run it on virtual cards (memprof run --virtual-gpu)")
    if not 0 <= rank < world:
        raise MemprofError(f"{run.path}: run.rank {rank} is not a rank of its world of {world}")
    parallelism = (run.facts.get("model") or {}).get("parallelism") or {}
    return Rank(rank, nodes, per_node, bool(parallelism.get("pipeline")))


def _steps_to_peak(run: Run) -> int | None:
    """The optimizer steps a re-run needs to reach the phase that held the recorded peak:
    ``RERUN_STEPS`` where the peak came in them, else all of the run (a peak in an
    evaluation after training, say: None, no ``--steps``), as a run that ended on its own
    after no more steps than that does (its evaluation, the generator's step of a GAN that
    stepped once: what stopping at its last step would cut)."""
    done = run.facts.get("optimizer_steps") or 0
    if not done or (done <= RERUN_STEPS and run.facts.get("stopped_by") is None):
        return None
    steps = run.device.get("steps") or []
    if len(steps) < RERUN_STEPS and done >= RERUN_STEPS:
        return RERUN_STEPS  # a ring buffer kept fewer: the peak is among the last steps seen
    ends = [s.get("end") for s in steps[:RERUN_STEPS]]
    peak = (run.device.get("peak") or {}).get("event_index")
    if done > RERUN_STEPS and isinstance(peak, int) and ends and isinstance(ends[-1], int) \
            and peak >= ends[-1]:
        return None
    return min(done, RERUN_STEPS)


def given_command(text: str) -> list[str]:
    """``--rerun-command``: the script (or ``-m module``) and its arguments, as typed after
    ``memprof run`` (a leading ``memprof run`` is allowed)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise MemprofError(f"--rerun-command {describe(text, 100)}: {exc}") from None
    if words[:2] == ["memprof", "run"]:
        words = words[2:]
    if not words or (words[0].startswith("-") and (words[0] != "-m" or len(words) < 2)):
        raise MemprofError(f"--rerun-command {describe(text, 100)}: expected a script and its"
                           " arguments (train.py --batch 8) or -m MODULE and its arguments")
    return words


def _where(path: Path, facts: dict[str, Any]) -> list[str]:
    """The re-run's device options: the recorded virtual GPU (a card memprof knows), the
    CPU recorder, or the GPU."""
    virtual = facts.get("virtual_gpu")
    if not isinstance(virtual, dict):
        return ["--device", "cpu" if facts.get("predicted") is True else "cuda"]
    from memprof.collect.virtual.cards import card_args, recorded_card

    try:
        return card_args(recorded_card(virtual))[:2]  # a size: the memory the run was given
    except ValueError:
        raise MemprofError(f"{path}: run.virtual_gpu.spec is not a card memprof knows") from None


def _bad_conf(conf: str) -> bool:
    from memprof.analysis.settings import parse_alloc_conf

    try:
        parse_alloc_conf(conf)
    except ValueError:
        return True
    return False



def _gist(error: str, limit: int = 200) -> str:
    """An error's first line, cut at a word within ``limit`` characters."""
    line = next((text.strip() for text in error.splitlines() if text.strip()), "")
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[:cut if cut > 0 else limit].rstrip(" ,:;") + " ..."


def fit_batch(rerun: Rerun, name: str, budget: int,
              progress: Callable[[int, Peak | None], None] | None = None
              ) -> tuple[int | None, int]:
    """The largest value of ``--name`` whose peak fits ``budget`` (None: not even 1), by
    doubling or halving from the recorded value, then bisection; and the runs it took."""
    runs = 0

    def fits(value: int) -> bool:
        nonlocal runs
        runs += 1
        peak = rerun.peak(rerun.with_value(name, value))
        if progress is not None:
            progress(value, peak)
        return peak is not None and peak.reserved <= budget

    value = rerun.value_of(name)
    if fits(value):
        low, high = value, None
        while high is None and low < MAX_BATCH:
            if fits(low * 2):
                low *= 2
            else:
                high = low * 2
        if high is None:
            return low, runs
    else:
        low, high = 0, value
        while low == 0 and high > 1:
            if fits(high // 2):
                low = high // 2
            else:
                high //= 2
        if low == 0:
            return None, runs
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, runs
