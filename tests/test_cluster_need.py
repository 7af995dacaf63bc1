"""A distributed run that runs out of memory on its virtual cards is run again with their
memory raised, as one process is: each rank's report says what it needs, its re-run is its
``need/``, and the cluster's summary leads with the rank that needs the most."""

from __future__ import annotations

import json
from pathlib import Path

from test_run_cli import memprof_run, report

from memprof.collect.virtual.cards import parse_spec

D, LAYERS = 4096, 4
OOM = f"""\
import os
import sys
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
layers = [torch.nn.Linear({D}, {D}) for _ in range({LAYERS})]
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers).cuda())
optimizer = torch.optim.AdamW(model.parameters())
try:
    for _ in range(3):
        model(torch.ones(20_000, {D}, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
except torch.cuda.OutOfMemoryError:
    sys.exit(1)  # the script's own handler: PyTorch's message is not shown
"""


def test_a_world_that_ran_out_of_memory_is_told_what_each_rank_needs(tmp_path: Path) -> None:
    (tmp_path / "oom.py").write_text(OOM)
    out = tmp_path / "out"
    result = memprof_run(tmp_path, "--virtual-gpu", "2GiB", "--nproc-per-node", "2",
                         "--no-timeline", "-o", out, "oom.py")
    assert result.code == 1, result.stderr
    card = parse_spec("2GiB")
    cluster = json.loads((out / "cluster.json").read_text())
    # the answer names the request that failed, though the script caught PyTorch's error
    assert cluster["answer"].startswith("out of memory on rank 0 at step 1: CUDA out of"
                                        " memory. Tried to allocate")
    need = cluster["need"]
    for rank in (0, 1):
        data = report(out / f"rank-{rank}")
        told = data["run"]["need"]
        again = report(out / f"rank-{rank}" / "need")  # the re-run, kept for suggest
        assert told["reserved_bytes"] == again["devices"][0]["peak"]["reserved_bytes"]
        assert told["total_bytes"] == told["reserved_bytes"] + card.context_bytes
        assert told["short_bytes"] == told["total_bytes"] - card.total_bytes > 0
        # more than the run held when it ran out: at least every layer's weights, AdamW's
        # two moments and the gradients, 16 bytes a parameter
        assert told["allocated_bytes"] > data["devices"][0]["peak"]["allocated_bytes"]
        assert told["allocated_bytes"] >= 16 * LAYERS * (D * D + D)
        assert again["run"]["optimizer_steps"] == 3
    assert need["rank"] == 0 and need["total_bytes"] == report(out / "rank-0")["run"][
        "need"]["total_bytes"]
    assert "Rank 0: Needs " in result.stderr and " short." in result.stderr
    assert not (out / ".need").exists()
