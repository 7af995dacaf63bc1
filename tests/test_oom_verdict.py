"""Shortage or fragmentation: decided by replaying the failed request, not by a rule.

Two scripts run out of memory on a virtual 2 GiB card (PyTorch may reserve 1.5 GiB of it,
the rest being the CUDA context): one with 850 MiB of tensors in pieces the request
cannot use, one that truly needs more than the card has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memprof.analysis.explain import explain
from memprof.analysis.findings import Oom
from memprof.collect.launch.script import Target
from memprof.collect.recording import RunOptions
from memprof.collect.virtual.cards import parse_spec
from memprof.collect.virtual.session import record
from memprof.trace.model import AllocatorSettings
from memprof.trace.normalize import normalize

MiB = 1 << 20
CARD = parse_spec("2GiB")
USABLE = CARD.usable_bytes  # 1.5 GiB: 2 GiB less the 512 MiB context assumed
PAGE = 2 * MiB

# 150 tensors of 8 MiB, two to a 20 MiB segment (1.5 GiB reserved, nothing left to map);
# every other one freed: 600 MiB allocated in holes of 8-12 MiB, none taking 250 MiB
FRAGMENTED = """\
import torch
held = [torch.empty(2 * 2**20, device="cuda") for _ in range(150)]
del held[::2]
torch.empty(250 * 2**18, device="cuda")
"""
# 6 x 60 MiB, each in the 100 MiB segment a freed tensor left, and 800 MiB: 240 MiB cached
# free, less than the 250 MiB request (a "real shortage" by the old rule of thumb). With
# expandable segments each 60 MiB packs against the last: 1160 MiB mapped, and it fits
REUSED = """\
import torch
held = []
for _ in range(6):
    freed = torch.empty(100 * 2**18, device="cuda")
    del freed
    held.append(torch.empty(60 * 2**18, device="cuda"))
big = torch.empty(800 * 2**18, device="cuda")
torch.empty(250 * 2**18, device="cuda")
"""
# 1.13 GiB held: 1000 MiB and 20 tensors of 8 MiB alone in 20 MiB segments, 240 MiB cached
# free and 136 MiB left on the card. Expandable segments map the large pool in 20 MiB
# pages: the 8 MiB holes between the tensors cannot be unmapped, so it does not fit there
# either: a shortage, of the 250 MiB segment less the 136 MiB left
SCATTERED = """\
import torch
held = [torch.empty(2 * 2**20, device="cuda") for _ in range(40)]
big = torch.empty(1000 * 2**18, device="cuda")
del held[::2]
torch.empty(250 * 2**18, device="cuda")
"""
# 1400 MiB held: a 250 MiB request cannot fit, however the memory is laid out
SHORT = """\
import torch
held = torch.empty(1400 * 2**18, device="cuda")
torch.empty(250 * 2**18, device="cuda")
"""


def _oom(tmp_path: Path, code: str) -> Oom:
    script = tmp_path / "script.py"
    script.write_text(code)
    recording = record(Target(str(script), ()), RunOptions(AllocatorSettings(), 100_000), CARD)
    assert recording.outcome.status == "raised"
    assert (recording.outcome.error or "").startswith("OutOfMemoryError")
    (device,) = explain(normalize(recording.snapshot), str(script)).devices
    (oom,) = device.ooms
    return oom


@pytest.mark.parametrize("code", [FRAGMENTED, REUSED, SCATTERED, SHORT],
                         ids=["fragmented", "reused", "scattered", "short"])
def test_the_failed_request_is_replayed_with_expandable_segments(tmp_path: Path, code: str
                                                                 ) -> None:
    oom = _oom(tmp_path, code)
    assert oom.requested_bytes == 250 * MiB
    assert oom.limit_bytes == USABLE
    if code is FRAGMENTED:
        assert oom.allocated_bytes == 75 * 8 * MiB
        assert oom.reserved_bytes == 75 * 20 * MiB
        assert oom.kind == "fragmentation" and oom.short_bytes == 0
        # one expandable range: the 150 tensors' pages stay mapped, holes and all
        assert oom.expandable_reserved_bytes == 150 * 8 * MiB
    elif code is REUSED:
        assert oom.allocated_bytes == (6 * 60 + 800) * MiB
        assert oom.reserved_bytes == (6 * 100 + 800) * MiB
        assert oom.cached_free_bytes == 6 * 40 * MiB < oom.requested_bytes
        assert oom.kind == "fragmentation" and oom.short_bytes == 0
        assert oom.expandable_reserved_bytes == (6 * 60 + 800) * MiB
    elif code is SCATTERED:
        assert oom.allocated_bytes == (1000 + 20 * 8) * MiB
        assert oom.cached_free_bytes == 20 * 12 * MiB < oom.requested_bytes
        assert oom.kind == "shortage"
        assert oom.short_bytes == (1000 + 20 * 20 + 250) * MiB - USABLE
    else:
        assert oom.kind == "shortage"
        assert oom.short_bytes == (1400 + 250) * MiB - USABLE
