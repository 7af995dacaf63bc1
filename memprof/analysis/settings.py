"""Allocator settings: reading a ``PYTORCH_CUDA_ALLOC_CONF`` string and knowing what is modelled."""

from __future__ import annotations

import math

from memprof.trace.model import AllocatorSettings

MODELLED = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
            "garbage_collection_threshold", "backend")
# options of the host (pinned memory) allocator or of graph capture: no effect on the replay
HOST_ONLY = ("pinned_use_cuda_host_register", "pinned_num_register_threads",
             "release_lock_on_cudamalloc", "pinned_use_background_threads",
             "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse")


MAX_DIVISIONS = 1 << 16  # far above any useful rounding; what a snapshot's reader accepts
MAX_SPLIT_MB = 1 << 24  # 16 TiB


def parse_alloc_conf(conf: str) -> AllocatorSettings:
    """Read ``PYTORCH_CUDA_ALLOC_CONF`` as PyTorch does (MiB sizes), refusing what PyTorch
    refuses (a threshold outside (0, 1), divisions not a power of two); raise ValueError."""
    fields: dict[str, object] = {"conf": conf}
    for item in filter(None, (p.strip() for p in conf.split(","))):
        key, _, value = (s.strip() for s in item.partition(":"))
        if key == "expandable_segments":
            if value.lower() not in ("true", "false"):
                raise ValueError("expandable_segments must be True or False")
            fields["expandable_segments"] = value.lower() == "true"
        elif key == "max_split_size_mb":
            fields["max_split_size"] = _whole(key, value, MAX_SPLIT_MB) << 20
        elif key == "roundup_power2_divisions":
            if value.startswith("["):
                raise ValueError("only the single-number form of roundup_power2_divisions is read")
            divisions = _whole(key, value, MAX_DIVISIONS)
            if divisions & (divisions - 1):
                raise ValueError("roundup_power2_divisions must be a power of two, as"
                                 " PyTorch requires")
            fields["roundup_power2_divisions"] = (divisions,) * 16
        elif key == "garbage_collection_threshold":
            try:
                threshold = float(value)
            except ValueError:
                threshold = math.nan
            if not 0 < threshold < 1:  # also NaN
                raise ValueError("garbage_collection_threshold must be between 0 and 1,"
                                 " as PyTorch requires (0.6, say)")
            fields["garbage_collection_threshold"] = threshold
        elif key == "backend":
            fields["backend"] = value
        elif key not in HOST_ONLY:
            raise ValueError(f"allocator setting {key!r} is not modelled"
                             f" (modelled: {', '.join(MODELLED)})")
    return AllocatorSettings(**fields)  # type: ignore[arg-type]


def _whole(key: str, value: str, limit: int) -> int:
    """``value`` as a whole number up to ``limit``."""
    if not value.isdigit() or len(value) > 12 or int(value) > limit:
        raise ValueError(f"{key} must be a whole number up to {limit:,}")
    return int(value)


def unmodelled(settings: AllocatorSettings, capped: bool = True) -> list[str]:
    """Why a replay under ``settings`` would not follow PyTorch's rules (empty: it would).

    ``capped``: the replay has a device limit (or follows a recording, whose releases
    it applies as recorded), without which the garbage collector never runs in PyTorch.
    """
    reasons = []
    if settings.backend != "native":
        reasons.append(f"backend {settings.backend} is not modelled")
    for item in filter(None, (p.strip() for p in settings.conf.split(","))):
        key = item.partition(":")[0].strip()
        if key not in MODELLED and key not in HOST_ONLY:
            reasons.append(f"setting {key} is not modelled")
    if settings.garbage_collection_threshold > 0 and not capped:
        reasons.append("garbage_collection_threshold acts only under a memory limit: give one"
                       " (explain --device-memory)")
    return reasons
