"""The README and docs/ as a reader meets them: every relative link leads somewhere, no
path of the machine they were written on, and every README command runs as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import WORKERS

from memprof import warm

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"^\$ (memprof .*?)(?:\s+#\s*exit (\d+))?$")


def _slug(heading: str) -> str:
    """The anchor GitHub and MkDocs give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines()
            if line.startswith("#")}


def _code(page: Path) -> list[str]:
    """The lines inside the page's fenced code blocks."""
    inside, lines = False, []
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_lead_somewhere(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing_anchor = anchor and dest.suffix == ".md" and anchor not in _anchors(dest)
        if not dest.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_path_of_the_machine_it_was_written_on(page: Path) -> None:
    found = re.findall(r"(?<![\w.])/(?:work|root|home|tmp|Users)/\S*", page.read_text())
    assert not found, f"{page.name}: machine paths {found}"


def test_every_readme_command_runs_as_written(tmp_path: Path) -> None:
    """The ``$ memprof ...`` lines of the README's examples, in order, in a fresh folder
    beside the samples: each exits as the README says (0 unless ``# exit N``). A command
    starts once the commands before it that write a run folder it names (``-o reports/X``)
    have ended; the others run beside it."""
    commands = [m.groups() for line in _code(ROOT / "README.md")
                if (m := COMMAND.match(line))]
    assert len(commands) >= 6, commands
    (tmp_path / "sample_scripts").symlink_to(ROOT / "sample_scripts")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(words: list[str], after: list[Future[Any]]) -> subprocess.CompletedProcess[str]:
        for earlier in after:
            earlier.exception()  # ended, however
        return warm.run(["-m", *words], tmp_path, env, timeout=300)  # as python -m does

    writes: dict[str, Future[Any]] = {}  # run folder: the command that writes it
    started = []
    # the pool takes commands in order: a command waits only for ones that have started
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for command, code in commands:
            words = shlex.split(command)
            after = [f for folder, f in writes.items()
                     if any(w == folder or w.startswith(f"{folder}/") for w in words)]
            started.append((command, code, pool.submit(run, words, after)))
            if "-o" in words:
                writes[words[words.index("-o") + 1]] = started[-1][2]
        for command, code, future in started:
            done = future.result()
            assert done.returncode == int(code or 0), (command, done.stderr[-2000:])
            assert "Traceback" not in done.stderr or "OutOfMemoryError" in done.stderr, command
