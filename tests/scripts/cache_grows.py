"""The allocator's cache grows after the allocation peak (for ``memprof suggest``'s budget
verdict). The peak: two tensors of 60 MiB, a segment each; both freed. ``--releasable``: a
100 MiB request fits neither segment and gets a third (under a limit, the allocator gives
the two free ones back first, and it fits). Otherwise 20 and 45 MiB tensors pin the two
segments and a 50 MiB request fits neither one's free rest (40 and 15 MiB): a third
segment, where under a limit nothing cached is free whole to give back."""

import sys

import torch

MIB = 2**20


def cuda_bytes(mib: int) -> torch.Tensor:
    return torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")


a, b = cuda_bytes(60), cuda_bytes(60)
del a, b
if "--releasable" in sys.argv:
    c = cuda_bytes(100)
else:
    pins = cuda_bytes(20), cuda_bytes(45)
    c = cuda_bytes(50)
