"""Child processes of a virtual-GPU run: spawn and forkserver children get a virtual card of
their own and a report each; DataLoader's workers and idle children leave none.

One `memprof run` of a script that starts every kind of child (a few seconds a child); the
expected bytes come from the model sizes and the allocator's 512-byte blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_run_cli import F32, block, memprof_here, memprof_run, report, run_python

IN, OUT, BATCH, ONES = 256, 128, 32, 1000
LINEAR = block(IN * OUT * F32) + block(OUT * F32)

CHILDREN = f"""\
import json
import multiprocessing
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader

def rank(i, queue):  # imagenet's --multiprocessing-distributed: a model per child, in DP
    model = nn.DataParallel(nn.Linear({IN}, {OUT})).cuda()
    model(torch.ones({BATCH}, {IN}, device="cuda")).sum().backward()
    queue.put(["rank", i, torch.cuda.is_available(), str(model.module.weight.device)])

def pooled(n):
    made = torch.ones(n, device="cuda")
    return ["pooled", torch.cuda.device_count(), torch.cuda.memory_allocated()]

if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    mp.spawn(rank, args=(queue,), nprocs=2)
    print(json.dumps(sorted(queue.get() for _ in range(2))))
    # terminate() on the way out; the parent waits on the worker's answer
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        print(json.dumps(pool.apply_async(pooled, ({ONES},)).get(timeout=100)))
    print(json.dumps([b.tolist() for b in DataLoader(range(4), batch_size=2, num_workers=1,
                                                      multiprocessing_context="spawn")]))
"""


def test_spawn_and_forkserver_children_each_get_a_virtual_card_and_a_report(
        tmp_path: Path) -> None:
    (tmp_path / "children.py").write_text(CHILDREN)
    out = tmp_path / "out"
    result = memprof_run(tmp_path, "--virtual-gpu", "H100", "--no-timeline", "-o", out,
                         "children.py")
    assert result.code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    # the children see the card as the parent does: without memprof they had no CUDA at all
    # (and the parent waited on the Pool worker's answer)
    assert lines == [[["rank", 0, True, "cuda:0"], ["rank", 1, True, "cuda:0"]],
                     ["pooled", 1, block(ONES * F32)], [[0, 1], [2, 3]]]
    # the ranks' models wrapped in DataParallel: their parameters and gradients, once each
    for n in (1, 2):
        categories = report(out / f"child-{n}")["devices"][0]["categories"]
        assert (categories["parameters"], categories["gradients"]) == (LINEAR, LINEAR)
    assert report(out / "child-3")["devices"][0]["peak"]["allocated_bytes"] == \
        block(ONES * F32)
    # the DataLoader's worker is not followed
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["child-1", "child-2",
                                                                   "child-3"]
    assert report(out)["devices"] == []
    where = ", ".join(f"{out}/child-{n}/" for n in (1, 2, 3))
    assert (f"memprof: the script made no CUDA tensor itself; 3 child processes made CUDA"
            f" tensors, each on a virtual H100 80GB of its own: reports in {where}\n"
            ) in result.stderr
    assert result.stderr.rstrip().endswith(f"Next: memprof explain {out}/child-1/snapshot.pickle")
    assert "Traceback" not in result.stderr and "made no CUDA tensor, so" not in result.stderr
    # suggest points at the children's folders, and cannot re-run one alone
    parent = memprof_here(tmp_path, "suggest", out, "--budget", "1GB")
    assert parent.code == 2 and f"processes it spawned did: give one of their run folders, such" \
        f" as {out}/child-1" in parent.stderr
    explained = run_python(["-m", "memprof", "explain", out], tmp_path)  # so does explain
    assert explained.code == 2 and explained.stderr.strip().endswith(
        f"give one of their run folders, such as {out}/child-1")
    child = memprof_here(tmp_path, "suggest", out / "child-1", "--budget", "1KB", "--verify")
    assert child.code == 2 and "the report of a process the script spawned" in child.stderr


STEPPING = """\
import torch
import torch.multiprocessing as mp

def train(i):
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(50):
        model(torch.ones(8, 64, device="cuda")).sum().backward()
        optimizer.step()

if __name__ == "__main__":
    mp.spawn(train, nprocs=1)
"""


def test_a_spawned_child_stops_after_the_steps_the_run_asked_for(tmp_path: Path) -> None:
    (tmp_path / "stepping.py").write_text(STEPPING)
    out = tmp_path / "out"
    result = memprof_run(tmp_path, "--steps", "2", "--no-timeline", "-o", out, "stepping.py")
    assert result.code == 0, result.stderr
    child = report(out / "child-1")["run"]
    assert (child["optimizer_steps"], child["stopped_by"]) == (2, "steps")


def test_ranks_spawned_inside_a_launched_rank_are_refused_in_one_line(tmp_path: Path) -> None:
    """imagenet's ``--multiprocessing-distributed`` under ``--nproc-per-node 2``: each rank
    would spawn a process per card, a world that never meets; said, not hung."""
    import importlib

    import pytest

    from memprof.collect.launch.children import FollowedChildren, NestedRanks

    class Process:
        _target = importlib.import_module("torch.multiprocessing.spawn")._wrap

    with pytest.raises(NestedRanks, match="run it with memprof run --cards 2 alone"):
        FollowedChildren(tmp_path, [], ranks=2)._start(None, None, Process())
