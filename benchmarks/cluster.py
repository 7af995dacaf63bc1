"""memprof's virtual cluster against PyTorch's own estimator, `FSDPMemTracker`, on one FSDP2
script: each category at each tool's peak, for rank 0.

Usage: python benchmarks/cluster.py
The script is `workloads/llama_fsdp.py` (a Llama-shaped model, each decoder block an FSDP2
unit, bf16 compute and fp32 reductions, foreach AdamW, 1,024 tokens, 2 steps) at its
`small` preset. memprof runs it unmodified: `memprof run --nproc-per-node W --ranks 0
--virtual-gpu H100`. `FSDPMemTracker` runs the same model, policy and loop as its
documentation says: under `FakeTensorMode`, over a fake process group, with the tracker
around the loop. This machine's PyTorch has no CUDA, and FSDP2 asks
`torch.cuda.current_device()` for a CUDA mesh, so the tracker's tensors are on the CPU; it
rounds each storage to 512 bytes as it does for CUDA tensors (its `_calculate_mem_consumed`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from measure import machine, run, write_table

from memprof.report.run_folder import rank_folder

ROOT = Path(__file__).resolve().parent
WORKLOAD = ROOT / "workloads" / "llama_fsdp.py"
PRESET, SEQ, STEPS = "small", 1024, 2
CASES = [(1, False), (2, False), (8, False), (8, True)]  # world size, checkpointing
# memprof's categories, and the tracker's reference types that hold the same tensors
CATEGORIES = {
    "parameters": ["SHARDED_PARAM"],
    "buffers": ["BUFFER"],
    "gradients": ["SHARDED_GRAD", "UNSHARDED_GRAD"],
    "optimizer_state": ["OPT"],
    "communication": ["UNSHARDED_PARAM", "ALL_GATHER", "REDUCE_SCATTER"],
    "activations": ["ACT", "INP"],
    "temporaries": ["TEMP"],
    "workspace": [],
}
MIB = 1 << 20


def tracker_peaks(world: int, checkpointed: bool, fake: bool = True) -> dict[str, dict]:
    """FSDPMemTracker's snapshots of rank 0 by reference type: at its peak, and at the
    model's peak in the last step's backward. ``fake`` False: real CPU tensors over gloo,
    a process per rank under torchrun."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(ROOT / "workloads"))
    import llama_fsdp

    def as_on_cuda(info: mem_tracker._WeakRefInfo) -> int:
        return math.ceil(info.size * info.element_size / 512) * 512

    mem_tracker._WeakRefInfo._calculate_mem_consumed = as_on_cuda
    if fake:
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    else:
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    shape = llama_fsdp.PRESETS[PRESET]
    with FakeTensorMode() if fake else contextlib.nullcontext():
        with torch.device("meta"):
            model = llama_fsdp.Llama(**shape, seq=SEQ, checkpointed=checkpointed)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            for step in range(STEPS):
                if step:  # as its documentation says, before each iteration but the first
                    tracker.reset_mod_stats()
                llama_fsdp.train_step(model, optimizer,
                                      torch.randint(0, shape["vocab"], (1, SEQ + 1)))
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        stats = tracker.memory_tracking[model].snapshots
        (backward,) = stats[fsdp2_mem_tracker._FSDPModState.PEAK_BW][-1].values()

    def named(snapshot: dict) -> dict[str, int]:
        return {str(getattr(kind, "name", kind)): int(size) for kind, size in snapshot.items()}

    return {"peak": named(peak), "backward": named(backward)}


def memprof_peak(world: int, checkpointed: bool, folder: Path) -> tuple[dict, float]:
    """rank 0's report.json device entry from `memprof run`, and the command's seconds."""
    argv = [sys.executable, "-m", "memprof", "run", "--nproc-per-node", str(world),
            "--ranks", "0", "--virtual-gpu", "H100", "--no-timeline", "-o", str(folder),
            str(WORKLOAD), "--preset", PRESET, "--seq", str(SEQ), "--steps", str(STEPS),
            "--adamw", "foreach"] + (["--checkpoint"] if checkpointed else [])
    measured = run(argv)
    report = json.loads((rank_folder(folder, 0, world) / "report.json").read_text())
    return report["devices"][0], measured.seconds


def tracker_run(world: int, checkpointed: bool, fake: bool) -> tuple[dict, float]:
    """``tracker_peaks`` in a process of its own (a process group each), and its seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        printed = Path(tmp) / "tracker.json"
        launch = [] if fake else ["-m", "torch.distributed.run", "--nproc-per-node",
                                  str(world)]
        measured = run([sys.executable, *launch, __file__, "--tracker", str(world),
                        str(int(checkpointed)), str(int(fake))], stdout=printed)
        return json.loads(printed.read_text().splitlines()[-1]), measured.seconds


def main() -> None:
    if sys.argv[1:2] == ["--tracker"]:  # a process of its own: one process group each
        world, checkpointed, fake = int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
        peaks = tracker_peaks(world, checkpointed, fake)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(peaks))
        return
    rows = []
    for world, checkpointed in CASES:
        tracked, traced = tracker_run(world, checkpointed, fake=True)
        # on real tensors, where two CPU processes train it in reasonable time
        real = tracker_run(world, checkpointed, fake=False)[0] if world <= 2 else None
        with tempfile.TemporaryDirectory() as tmp:
            device, seconds = memprof_peak(world, checkpointed, Path(tmp) / "run")
        name = f"W={world}" + (", checkpointing" if checkpointed else "")
        theirs = [tracked["peak"], tracked["backward"], real["peak"] if real else None]
        for category, kinds in CATEGORIES.items():
            rows.append([name, category, *(f"{sum(t.get(k, 0) for k in kinds):,}" if t else ""
                                           for t in theirs),
                         f"{device['categories_requested'][category]:,}",
                         f"{device['categories'][category]:,}"])
        rows.append([name, "**allocated**", *(f"{t['Total']:,}" if t else "" for t in theirs),
                     f"{sum(device['categories_requested'].values()):,}",
                     f"{device['peak']['allocated_bytes']:,}"])
        rows.append([name, "reserved", "", "", "", "", f"{device['peak']['reserved_bytes']:,}"])
        rows.append([name, "seconds", f"{traced:.1f}", "", "", "", f"{seconds:.1f}"])
    write_table("cluster",
                ["run (rank 0)", "category", "FSDPMemTracker (fake): its peak",
                 "FSDPMemTracker (fake): backward's peak",
                 "FSDPMemTracker (real CPU tensors): its peak", "memprof: peak (tensors)",
                 "memprof: peak (blocks)"], rows,
                f"`{WORKLOAD.name} --preset {PRESET} --seq {SEQ} --steps {STEPS} --adamw"
                " foreach`, rank 0, bytes. FSDPMemTracker (FakeTensorMode, fake process"
                " group): its peak snapshot, and the root module's backward peak in the last"
                " step. memprof (`--virtual-gpu H100`): at its peak, each tensor's own bytes"
                " (report.json's categories_requested) and the allocator's blocks"
                " (categories), whose sum is the peak allocated. Seconds:"
                " the whole command (memprof: launcher and rank 0's process on a virtual"
                " H100; tracker: its own process). FSDPMemTracker (real CPU tensors): the"
                " same tracker without FakeTensorMode, over gloo, a process per rank under"
                f" torchrun (W=1 and 2). {machine()}. See docs/accuracy.md for every"
                " difference.")


if __name__ == "__main__":
    main()
