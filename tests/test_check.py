"""``memprof check`` and ``memprof run --max-peak`` as CI runs them: real runs of the samples,
the real command line, its exit codes and outputs (``check`` by memprof's entry point in this
process: it starts none of its own)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from conftest import Jobs

from tests.test_run_cli import (
    ROOT,
    SAMPLES,
    Result,
    block,
    flags,
    load_sample,
    memprof_here,
    memprof_run,
    report,
    run_python,
)

# big enough that model state outweighs the virtual H100's 32 MiB cuBLAS workspace
SMALL = {"hidden": 1024, "layers": 2, "batch": 8, "steps": 3}
WIDER = {**SMALL, "hidden": 1280}  # the change a pull request makes: a wider model


def check(cwd: Path, *args: str | Path) -> Result:
    return memprof_here(cwd, "check", *args)


# --- the runs: started together on first use, each in a folder of its own ----------------

jobs = Jobs()


def _recorded(where: Path, size: dict[str, int]) -> Path:
    result = memprof_run(where, "-o", where / "out", SAMPLES / "mlp_adam.py", *flags(size))
    assert result.code == 0, result.stderr
    return where / "out"


@jobs
def base(where: Path) -> Path:
    return _recorded(where, SMALL)


@jobs
def again(where: Path) -> Path:
    return _recorded(where, SMALL)


@jobs
def wider(where: Path) -> Path:
    return _recorded(where, WIDER)


@jobs
def max_peak(where: Path) -> tuple[Result, int, Result, Result, Path]:
    """``--max-peak`` under the run's peak, at it, and not a size."""
    args = [SAMPLES / "mlp_adam.py", *flags(SMALL)]
    over = memprof_run(where, "-o", where / "over", "--max-peak", "1MiB", *args)
    peak = report(where / "over")["devices"][0]["peak"]["reserved_bytes"]
    under = memprof_run(where, "-o", where / "under", "--max-peak", str(peak), *args)
    bad = memprof_run(where, "--max-peak", "lots", *args)
    return over, peak, under, bad, where


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    yield from jobs.started(tmp_path_factory, "check")


@pytest.fixture(scope="module")
def runs(processes: dict[str, Future[Any]]) -> dict[str, Path]:
    """The small MLP twice (a rerun) and the wider one."""
    return {name: processes[name].result() for name in ("base", "again", "wider")}


def param_blocks(size: dict[str, int]) -> int:
    """Parameter bytes of the sample MLP as the caching allocator holds them."""
    model = load_sample("mlp_adam").build_model(size["hidden"], size["layers"])
    return sum(block(p.numel() * p.element_size()) for p in model.parameters())


def edited(folder: Path, tmp: Path, name: str, edit) -> Path:
    """A copy of ``folder``'s report with ``edit`` applied to its JSON."""
    data = report(folder)
    edit(data)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_wider_model_is_caught_and_what_grew_is_named(runs, tmp_path):
    result = check(tmp_path, runs["wider"], "--baseline", runs["base"], "--format", "json")
    assert result.code == 1, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["schema"] == "memprof.report/1" and verdict["command"] == "check"
    device = verdict["check"]["devices"][0]
    assert device["verdict"] == "regression"
    assert device["baseline_bytes"] == report(runs["base"])["devices"][0]["peak"]["allocated_bytes"]
    assert device["current_bytes"] == report(runs["wider"])["devices"][0]["peak"][
        "allocated_bytes"]
    grew = {c["name"]: c["current_bytes"] - c["baseline_bytes"] for c in device["categories"]}
    extra = param_blocks(WIDER) - param_blocks(SMALL)
    # fp32 Adam: the moments grow twice as much as the weights (parameter tensors are not
    # all multiples of 512 bytes, so compare blocks tensor by tensor, as the allocator does)
    assert device["categories"][0]["name"] == "optimizer_state"
    assert grew["parameters"] == extra and grew["gradients"] == extra
    # what the pull request changed in the run comes first: the flag, and the model's size
    params = [sum(p.numel() for p in load_sample("mlp_adam").build_model(
        size["hidden"], size["layers"]).parameters()) for size in (SMALL, WIDER)]
    assert verdict["check"]["run_changes"] == [
        f"the command: --hidden={SMALL['hidden']} → --hidden={WIDER['hidden']}",
        f"parameters: {params[0]:,} in the baseline, {params[1]:,} now"]

    text = check(tmp_path, runs["wider"], "--baseline", runs["base"])
    before, after = (report(runs[n])["devices"][0]["peak"]["allocated_bytes"]
                     for n in ("base", "wider"))
    assert text.code == 1
    first = text.stdout.splitlines()[0]
    assert first.startswith("REGRESSION: peak allocated grew from ")
    assert f"(+{(after - before) / before:.1%}, limit 5%)" in first
    assert text.stdout.splitlines()[1] == (
        f"  the run changed: the command: --hidden={SMALL['hidden']} →"
        f" --hidden={WIDER['hidden']}")
    assert "grew most by category: optimizer_state" in text.stdout
    assert "grew most by site:" in text.stdout and "mlp_adam.py" in text.stdout
    # the hidden-to-hidden Linear (Sequential's child 2) grew most: its weight is hidden²
    modules = {c["name"]: c["current_bytes"] - c["baseline_bytes"] for c in device["modules"]}
    assert device["modules"][0]["name"] == "2", modules
    assert "grew most by module: 2 " in text.stdout


def test_a_rerun_is_not_flagged(runs, tmp_path):
    for metric in ("peak_allocated", "peak_reserved", "category:activations"):
        result = check(tmp_path, runs["again"], "--baseline", runs["base"], "--metric", metric)
        assert result.code == 0, result.stdout + result.stderr
        assert result.stdout.startswith("OK: ")


def test_an_improvement_passes_with_a_hint(runs, tmp_path):
    result = check(tmp_path, runs["base"], "--baseline", runs["wider"] / "report.json")
    assert result.code == 0
    assert result.stdout.startswith("IMPROVED: peak allocated shrank from")
    assert "--update-baseline" in result.stdout


def test_an_absolute_limit(runs, tmp_path):
    before, after = (report(runs[n])["devices"][0]["peak"]["allocated_bytes"]
                     for n in ("base", "wider"))
    assert check(tmp_path, runs["wider"], "-b", runs["base"], "--max-increase",
                 str(after - before)).code == 0
    assert check(tmp_path, runs["wider"], "-b", runs["base"], "--max-increase",
                 str(after - before - 1)).code == 1
    assert check(tmp_path, runs["wider"], "-b", runs["base"], "--max-increase", "200MiB").code == 0


def test_markdown_is_a_table_and_junit_parses(runs, tmp_path):
    md = check(tmp_path, runs["wider"], "-b", runs["base"], "--format", "markdown")
    lines = md.stdout.splitlines()
    assert lines[0].startswith("| device | metric | baseline | current |")
    assert set(lines[1].replace("|", "").replace("-", "").replace(":", "")) == set()
    assert "**regression**" in lines[2]
    out = tmp_path / "ci" / "memprof.xml"
    out.parent.mkdir()
    junit = check(tmp_path, runs["wider"], "-b", runs["base"], "--format", "junit", "-o", out)
    assert junit.code == 1 and junit.stdout.startswith("REGRESSION")
    suite = ElementTree.parse(out).getroot()
    assert suite.tag == "testsuite" and suite.get("failures") == "1"
    assert suite.find("testcase/failure").get("message").startswith("peak allocated grew")
    ok = ElementTree.fromstring(check(tmp_path, runs["again"], "-b", runs["base"], "--format",
                                      "junit").stdout)
    assert ok.get("failures") == "0" and ok.find("testcase/failure") is None


def test_update_baseline_writes_the_current_report(runs, tmp_path):
    baseline = tmp_path / "ci" / "memory.json"
    result = check(tmp_path, runs["wider"], "--baseline", baseline, "--update-baseline")
    assert result.code == 0 and baseline.read_bytes() == (runs["wider"] / "report.json"
                                                          ).read_bytes()
    assert check(tmp_path, runs["wider"], "--baseline", baseline).code == 0
    folder = tmp_path / "base-folder"
    shutil.copytree(runs["base"], folder)
    assert check(tmp_path, runs["wider"], "-b", folder, "--update-baseline").code == 0
    assert json.loads((folder / "report.json").read_text()) == report(runs["wider"])


def ranks(where: Path, *runs: Path) -> Path:
    """A folder of ranks, ``rank-K/report.json`` the report of ``runs[K]`` on cuda:K."""
    for rank, run in enumerate(runs):
        data = report(run)
        for d in data["devices"]:
            d["device"] = rank
        (where / f"rank-{rank}").mkdir(parents=True)
        (where / f"rank-{rank}" / "report.json").write_text(json.dumps(data))
    return where


def test_every_rank_of_a_distributed_run_is_gated(runs, tmp_path):
    """Rank 1 grows, rank 0 does not: the worst rank differs between the runs."""
    base = ranks(tmp_path / "base", runs["base"], runs["base"])
    grown = ranks(tmp_path / "grown", runs["base"], runs["wider"])
    result = check(tmp_path, grown, "--baseline", base)
    assert result.code == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("OK: device 0 rank 0: peak allocated is unchanged")
    assert lines[1].startswith("REGRESSION: device 1 rank 1: peak allocated grew")
    assert check(tmp_path, grown, "--baseline", base, "--device", "0").code == 0
    # every rank's report as one baseline file, which the same run then passes
    baseline = tmp_path / "memory.json"
    assert check(tmp_path, grown, "-b", baseline, "--update-baseline").code == 0
    assert check(tmp_path, grown, "-b", baseline).code == 0
    assert check(tmp_path, base, "-b", baseline).code == 0  # smaller: an improvement
    refused = check(tmp_path, grown, "-b", base, "--update-baseline")
    assert refused.code == 2 and "give --baseline a file" in refused.stderr


def test_suggest_advises_the_rank_that_ran_out_of_memory_and_refuses_a_broken_one(
        runs, tmp_path):
    """Rank 1 ran out of memory with less on its card than rank 0: it is the one to advise,
    and a rank whose report cannot be read stops the answer in one line."""
    from memprof.errors import MemprofError
    from memprof.report.cluster import worst_report

    folder = ranks(tmp_path / "oom", runs["wider"], runs["base"])
    rank_1 = folder / "rank-1" / "report.json"
    data = json.loads(rank_1.read_text())
    data["devices"][0]["oom"] = {"event_index": 3}
    rank_1.write_text(json.dumps(data))
    assert worst_report(folder) == rank_1
    rank_1.write_text(rank_1.read_text()[:400])  # truncated
    with pytest.raises(MemprofError, match=r"rank-1/report\.json: rank 1's report cannot be"):
        worst_report(folder)
    refused = memprof_here(tmp_path, "suggest", folder, "--budget", "1GB")
    assert refused.code == 2 and "rank 1's report cannot be read" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("device", lambda d: d["run"].update(device="cuda (NVIDIA A10)"), "the device differs"),
    ("virtual", lambda d: d["run"].update(virtual_gpu={"spec": "A10"}), "virtual GPU differs"),
    ("conf", lambda d: d["source"].update(allocator_conf="expandable_segments:True"),
     "allocator settings differ"),
    ("crashed", lambda d: d["run"].update(exit={"status": "raised", "code": 1, "error": "x"}),
     "did not complete"),
    ("ranks", lambda d: d["devices"][0].update(rank=3), "devices differ"),
])
def test_reports_that_measure_different_things_fail_closed(runs, tmp_path, name, edit, message):
    current = edited(runs["base"], tmp_path, name, edit)
    result = check(tmp_path, current, "--baseline", runs["base"])
    assert result.code == 2 and result.stdout == ""
    assert result.stderr.startswith("memprof: error: cannot compare") and message in result.stderr
    assert len(result.stderr.splitlines()) == 1
    if name != "ranks":
        forced = check(tmp_path, current, "--baseline", runs["base"], "--allow-different")
        assert forced.code == 0 and "note: compared although" in forced.stdout


def test_an_oom_in_the_current_run_is_a_regression(runs, tmp_path):
    def oom(data):
        data["run"]["exit"] = {"status": "raised", "code": 1, "error": "OutOfMemoryError"}
        data["devices"][0]["oom"] = {"event_index": 3}

    result = check(tmp_path, edited(runs["base"], tmp_path, "oom", oom), "-b", runs["base"])
    assert result.code == 1 and "ran out of memory" in result.stdout


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    (tmp_path / "text.json").write_text("not json {")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "other/9", "devices": []}))
    (tmp_path / "empty").mkdir()
    negative = edited(runs["base"], tmp_path, "negative",
                      lambda d: d["devices"][0]["peak"].update(allocated_bytes=-5))
    base = runs["base"]
    cases = {
        "missing baseline": (base, "-b", tmp_path / "missing"),
        "folder without report": (base, "-b", tmp_path / "empty"),
        "not JSON": (base, "-b", tmp_path / "text.json"),
        "not an object": (base, "-b", tmp_path / "list.json"),
        "another schema": (base, "-b", tmp_path / "other.json"),
        "negative bytes": (negative, "-b", base),
        "missing current": (tmp_path / "nope", "-b", base),
        "bad increase": (base, "-b", base, "--max-increase", "lots"),
        "negative increase": (base, "-b", base, "--max-increase", "-5%"),
        "bad metric": (base, "-b", base, "--metric", "category:weights"),
        "bad format": (base, "-b", base, "--format", "pdf"),
        "absent device": (base, "-b", base, "--device", "7"),
    }
    for what, args in cases.items():
        result = check(tmp_path, *args)
        assert result.code == 2, what
        assert len(result.stderr.strip().splitlines()) == 1, (what, result.stderr)
        assert "Traceback" not in result.stderr and result.stdout == "", what


def test_text_from_a_report_cannot_drive_the_terminal(runs, tmp_path):
    def forge(data):
        data["devices"][0]["top_sites"][0]["site"] = "evil.py:1 f\x1b[2J\nREGRESSION: none"
        data["devices"][0]["top_sites"][0]["bytes"] *= 50
        data["devices"][0]["peak"]["allocated_bytes"] *= 2

    result = check(tmp_path, edited(runs["base"], tmp_path, "forged", forge), "-b", runs["base"])
    assert result.code == 1
    assert "\x1b" not in result.stdout and "\\x1b[2J\\nREGRESSION" in result.stdout


FORGED = ["nul\x00esc\x1b[2Jbel\x07", "a|b\n| forged | row | 1 | 2 |",
          "![x](https://evil.example/x.png)", "<img src=x onerror=alert(1)>", "@everyone",
          "`code` [link](https://evil.example)"]


def _forge_names(data):
    """Module and site names from a report, each a markdown or XML injection."""
    device = data["devices"][0]
    device["peak"]["allocated_bytes"] *= 2
    for entries, key in ((device["top_modules"], "module"), (device["top_sites"], "site")):
        for entry, name in zip(entries, FORGED, strict=False):
            entry[key] = name
            entry["bytes"] *= 40


def _outside_code_spans(line: str) -> str:
    return re.sub(r"(`+) .*? \1", "", line)


def test_names_from_a_report_are_text_in_markdown(runs, tmp_path):
    forged = edited(runs["base"], tmp_path, "forged", _forge_names)
    md = check(tmp_path, forged, "-b", runs["base"], "--format", "markdown")
    assert md.code == 1, md.stderr
    table = [line for line in md.stdout.splitlines() if line.startswith("|")]
    rows = table[2:]
    assert len(rows) >= 1 + len(FORGED) and not any("forged" in r.split("|")[1] for r in rows)
    for line in table:  # every row keeps its columns: a name's pipe is escaped
        assert len(re.findall(r"(?<!\\)\|", line)) == line.count("|") - line.count("\\|")
        bare = _outside_code_spans(line)
        for mark in ("<", "![", "](", "@", "\x00", "\x1b"):
            assert mark not in bare, (mark, line)
    assert all(r.count("|") - r.count("\\|") in (5, 8) for r in table)
    assert "\x00" not in md.stdout and "\x1b" not in md.stdout


def test_names_from_a_report_keep_junit_valid_xml(runs, tmp_path):
    forged = edited(runs["base"], tmp_path, "forged", _forge_names)
    junit = check(tmp_path, forged, "-b", runs["base"], "--format", "junit")
    assert junit.code == 1, junit.stderr
    suite = ElementTree.fromstring(junit.stdout)  # a NUL or ESC would make it invalid XML
    assert not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", junit.stdout)
    assert "nul\\x00esc" in suite.find("testcase/failure").text


@pytest.mark.parametrize("rank", ["\x1b[2J", "0\x00", [1], 1.5, -1])
def test_a_rank_that_is_not_a_rank_is_refused(runs, tmp_path, rank):
    def forge(data):
        data["devices"][0]["rank"] = rank

    result = check(tmp_path, edited(runs["base"], tmp_path, "rank", forge), "-b", runs["base"],
                   "--format", "junit")
    assert result.code == 2 and result.stdout == "", result.stdout
    line, = result.stderr.strip().splitlines()
    assert "devices[0].rank" in line and "\x1b" not in line


def test_run_max_peak_fails_the_run_after_reporting(processes):
    over, peak, under, bad, where = processes["max_peak"].result()
    assert peak > 1 << 20
    assert over.code == 1, over.stderr
    assert "completed, exit code 0" in over.stderr
    assert over.stderr.strip().splitlines()[-1].startswith("memprof: peak reserved")
    assert under.code == 0, under.stderr
    assert bad.code == 2 and bad.stderr.startswith("memprof: error: --max-peak")
    assert not (where / "reports").exists()  # refused before the script ran


def test_help_teaches_the_gate():
    result = run_python(["-m", "memprof", "check", "--help"], ROOT)
    assert result.code == 0
    for option in ("--baseline", "--max-increase", "--metric", "--update-baseline", "--format",
                   "--allow-different"):
        assert option in result.stdout


def test_the_html_format_puts_both_runs_side_by_side(runs, tmp_path):
    from typer.testing import CliRunner

    from memprof.cli.app import app
    from tests.test_html_report import page_data

    page, alone = tmp_path / "check.html", edited(runs["base"], tmp_path, "alone", lambda d: d)
    args = ["check", str(runs["wider"]), "-b", str(runs["base"])]
    assert CliRunner().invoke(app, [*args, "--format", "html", "-o", str(page)]).exit_code == 1
    as_json = CliRunner().invoke(app, [*args, "--format", "json"])
    data = page_data(page)
    assert data["verdict"] == json.loads(as_json.output)["check"]
    assert [r["role"] for r in data["runs"]] == ["baseline", "current"]
    for run, name in zip(data["runs"], ("base", "wider"), strict=True):
        assert run["devices"][0]["report"] == report(runs[name])["devices"][0]
        timeline = page_data(runs[name] / "report.html")["devices"][0]["timeline"]
        assert run["devices"][0]["timeline"] == timeline
    # a baseline kept as a report.json alone has no timeline: the page says so
    args[-1] = str(alone)
    assert CliRunner().invoke(app, [*args, "--format", "html", "-o", str(page)]).exit_code == 1
    assert page_data(page)["runs"][0]["devices"][0]["timeline"] is None


def test_a_change_of_a_few_bytes_is_shown_in_bytes_not_as_zero_percent() -> None:
    from memprof.gate.compare import DeviceVerdict
    from memprof.gate.render import _change

    few = DeviceVerdict(0, None, 16 << 20, (16 << 20) + 512, 0, "ok")
    assert _change(few) == "+512 B"
    some = DeviceVerdict(0, None, 100, 110, 0, "ok")
    assert _change(some) == "+10.0%"
