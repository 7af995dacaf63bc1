"""Ranks a script starts itself, one per card (``torch.multiprocessing.spawn``, imagenet's
``--multiprocessing-distributed``), under ``memprof run --cards N``: each on the card it
picks with ``torch.cuda.set_device``, summarised as a cluster, re-run as a world.

One run of a DDP script spawning 2 ranks (module scope); the expected bytes come from the
model's size and the allocator's 512-byte blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_cli import F32, Result, block, memprof_run, report

D, BATCH = 512, 16
WEIGHTS = block(D * D * F32) + block(D * F32)  # a Linear's weight and bias, one block each

SPAWNING = f"""\
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

def worker(gpu, cards, port):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{{port}}",
                            world_size=cards, rank=gpu)
    model = DistributedDataParallel(torch.nn.Linear({D}, {D}).cuda(gpu), device_ids=[gpu])
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.ones({BATCH}, {D}, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    print(gpu, torch.cuda.device_count(), str(model.module.weight.device), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    cards = torch.cuda.device_count()
    mp.spawn(worker, args=(cards, int(os.environ["PORT"])), nprocs=cards)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    import os

    where = tmp_path_factory.mktemp("spawned")
    (where / "spawning.py").write_text(SPAWNING)
    os.environ["PORT"] = str(free_port())  # the script's rendezvous, as its users pass one
    try:
        result = memprof_run(where, "--virtual-gpu", "A100", "--cards", "2", "--no-timeline",
                             "-o", where / "out", "spawning.py")
    finally:
        del os.environ["PORT"]
    return result, where / "out"


def test_each_spawned_rank_runs_on_the_card_it_picked(spawned: tuple[Result, Path]) -> None:
    result, out = spawned
    assert result.code == 0, result.stderr
    # the script saw 2 cards and spawned 2 ranks, each on its own card
    assert sorted(result.stdout.split("\n")[:2]) == ["0 2 cuda:0", "1 2 cuda:1"]
    for n in (1, 2):
        data = report(out / f"child-{n}")
        rank = data["run"]["rank"]
        assert (data["run"]["world_size"], [d["device"] for d in data["devices"]]) == \
            (2, [rank])
        categories = data["devices"][0]["categories"]
        # a full replica: weights, gradients as views of DDP's bucket, AdamW's 2 moments
        assert categories["parameters"] == WEIGHTS
        assert categories["optimizer_state"] == 2 * WEIGHTS
    assert sorted(report(out / f"child-{n}")["run"]["rank"] for n in (1, 2)) == [0, 1]
    assert "Traceback" not in result.stderr


def test_the_spawned_ranks_are_summarised_as_a_cluster(spawned: tuple[Result, Path]) -> None:
    result, out = spawned
    cluster = json.loads((out / "cluster.json").read_text())
    assert (cluster["world_size"], cluster["ranks_run"]) == (2, [0, 1])
    assert cluster["answer"].startswith("fits: worst rank")
    assert {r["report"] for r in cluster["ranks"]} == {"child-1/report.json",
                                                       "child-2/report.json"}
    assert cluster["answer"] in result.stderr
    assert result.stderr.rstrip().endswith(f"Next: memprof explain {out}")


def test_explain_and_check_read_the_spawned_ranks(spawned: tuple[Result, Path]) -> None:
    from test_run_cli import memprof_here, run_python

    _, out = spawned
    explained = run_python(["-m", "memprof", "explain", out], out.parent)
    assert explained.code == 0, explained.stderr
    assert "rank 0, device 0" in explained.stdout and "rank 1, device 1" in explained.stdout
    checked = memprof_here(out.parent, "check", out, "--baseline", out)  # rank by rank
    assert checked.code == 0 and "unchanged" in checked.stdout
    # one card of the node: the rank that ran on it
    one = run_python(["-m", "memprof", "explain", out, "--device", "1"], out.parent)
    assert "rank 1, device 1" in one.stdout and "rank 0" not in one.stdout
    none = run_python(["-m", "memprof", "explain", out, "--device", "5"], out.parent)
    assert none.code == 2 and none.stderr.strip() == f"memprof: error: {out}: no rank ran on" \
        " device [5]"


def test_a_spawned_rank_is_re_run_as_its_world_on_as_many_cards(
        spawned: tuple[Result, Path]) -> None:
    from memprof.advise.rerun import Rerun
    from memprof.advise.source import load_run

    _, out = spawned
    rerun = Rerun.of(load_run(out / "child-2"))
    assert rerun.target == ["spawning.py"]
    assert rerun.rank is not None
    assert rerun.rank.options(rerun.where) == ["--cards", "2"]
    assert rerun.rank.options(rerun.where, world=4) == ["--cards", "4"]  # suggest --gpus 4


def test_a_card_past_the_virtual_node_s_raises_as_cuda_does(tmp_path: Path) -> None:
    result = memprof_run(tmp_path, "--virtual-gpu", "A100", "--no-timeline", "-o",
                         tmp_path / "out", "-c", "import torch; torch.cuda.set_device(1)")
    assert result.code == 1
    assert "AcceleratorError: CUDA error: invalid device ordinal" in result.stderr
    assert "the virtual node has 1 card; memprof run --cards N gives it N" in result.stderr


def test_cards_are_refused_where_a_launcher_or_a_gpu_gives_them(tmp_path: Path) -> None:
    for options in (["--nproc-per-node", "2"], ["--device", "cpu"]):
        result = memprof_run(tmp_path, "--cards", "2", *options, "-c", "pass")
        assert result.code == 2
        assert result.stderr.startswith("memprof: error: --cards 2: the cards of a virtual")
        assert len(result.stderr.strip().splitlines()) == 1
    many = memprof_run(tmp_path, "--cards", "100", "-c", "pass")  # not 100 processes
    assert many.code == 2 and "less than or equal to 64" in many.stderr
    nodes = memprof_run(tmp_path, "--nnodes", "2", "-c", "pass")  # not silently one node
    assert nodes.code == 2 and nodes.stderr.strip() == "memprof: error: --nnodes counts nodes" \
        " of the ranks of --nproc-per-node; give --nproc-per-node N too"


STOPPED = """\
import os
import signal
import time
import torch
import torch.multiprocessing as mp

def worker(gpu, folder):
    torch.cuda.set_device(gpu)
    model = torch.nn.Linear(256, 256).cuda()
    open(os.path.join(folder, f"ready-{gpu}"), "w").close()
    while True:
        model(torch.ones(8, 256, device="cuda")).sum().backward()
        time.sleep(0.01)

if __name__ == "__main__":
    context = mp.spawn(worker, args=(os.getcwd(),), nprocs=2, join=False)
    while not all(os.path.exists(f"ready-{gpu}") for gpu in range(2)):
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler ending the job would
    context.join()
"""


def test_a_signalled_run_ends_its_spawned_ranks_with_their_reports(tmp_path: Path) -> None:
    (tmp_path / "stopped.py").write_text(STOPPED)
    out = tmp_path / "out"
    result = memprof_run(tmp_path, "--virtual-gpu", "A100", "--cards", "2", "--no-timeline",
                         "-o", out, "stopped.py")
    assert result.code == 143, result.stderr
    for n in (1, 2):  # each child signalled in turn, and its report written
        child = report(out / f"child-{n}")
        assert child["run"]["exit"]["code"] == 143
        assert child["devices"][0]["categories"]["parameters"] == \
            block(256 * 256 * F32) + block(256 * F32)
    assert "2 child processes made CUDA tensors" in result.stderr
    assert "made no CUDA tensor, so" not in result.stderr


def test_a_torchrun_script_run_alone_is_told_to_launch_its_ranks(tmp_path: Path) -> None:
    result = memprof_run(tmp_path, "--no-timeline", "-o", tmp_path / "out", "-c",
                         "import os; rank = int(os.environ['LOCAL_RANK'])")
    assert result.code == 1
    assert "memprof: the script reads torchrun's LOCAL_RANK, which only a launcher sets: run" \
        " it as torchrun would with memprof run --nproc-per-node N" in result.stderr
    assert "--device cpu" not in result.stderr  # not "made no CUDA tensor"


CRASHING = """\
import os
import sys
import time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(gpu):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=gpu,
                            world_size=2)
    torch.ones(1024, device="cuda")
    if gpu == 0:
        with open("rank-0.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace("rank-0.tmp", "rank-0.pid")  # whole when rank 1 reads it
        return
    while not os.path.exists("rank-0.pid"):
        time.sleep(0.05)
    with open("rank-0.pid") as f:
        pid = int(f.read())
    while os.path.exists(f"/proc/{pid}"):  # rank 0 has ended, with its report
        time.sleep(0.05)
    os._exit(3)  # no report: not even Python's exit

if __name__ == "__main__":
    mp.spawn(worker, nprocs=torch.cuda.device_count())
"""


def test_a_spawned_process_that_ends_without_its_report_is_named(tmp_path: Path) -> None:
    (tmp_path / "crashing.py").write_text(CRASHING)
    result = memprof_run(tmp_path, "--virtual-gpu", "A100", "--cards", "2", "--no-timeline",
                         "-o", tmp_path / "out", "crashing.py", str(free_port()))
    assert result.code == 1
    assert "1 of the world's 2 ranks were not run (a spawned process ended with exit code 3" \
        " before writing its report)" in result.stderr
