"""Allocator settings: reading a ``PYTORCH_CUDA_ALLOC_CONF`` string and knowing what is modelled."""

from __future__ import annotations

from memprof.trace.model import AllocatorSettings

MODELLED = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
            "garbage_collection_threshold", "backend")
# options of the host (pinned memory) allocator or of graph capture: no effect on the replay
HOST_ONLY = ("pinned_use_cuda_host_register", "pinned_num_register_threads",
             "release_lock_on_cudamalloc", "pinned_use_background_threads",
             "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse")


def parse_alloc_conf(conf: str) -> AllocatorSettings:
    """Read ``PYTORCH_CUDA_ALLOC_CONF`` as PyTorch does (MiB sizes); raise ValueError."""
    fields: dict[str, object] = {"conf": conf}
    for item in filter(None, (p.strip() for p in conf.split(","))):
        key, _, value = (s.strip() for s in item.partition(":"))
        if key == "expandable_segments":
            fields["expandable_segments"] = value.lower() == "true"
        elif key == "max_split_size_mb":
            fields["max_split_size"] = int(value) << 20
        elif key == "roundup_power2_divisions":
            if not value.isdigit():
                raise ValueError("only the single-number form of roundup_power2_divisions is read")
            fields["roundup_power2_divisions"] = (int(value),) * 16
        elif key == "garbage_collection_threshold":
            fields["garbage_collection_threshold"] = float(value)
        elif key == "backend":
            fields["backend"] = value
        elif key not in HOST_ONLY:
            raise ValueError(f"allocator setting {key!r} is not modelled"
                             f" (modelled: {', '.join(MODELLED)})")
    return AllocatorSettings(**fields)  # type: ignore[arg-type]


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
