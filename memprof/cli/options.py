"""Parsing of option values shared by several commands."""

from __future__ import annotations

from memprof.errors import MemprofError
from memprof.trace.model import AllocatorSettings

_KEYS = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
         "garbage_collection_threshold", "backend")


def parse_alloc_conf(conf: str) -> AllocatorSettings:
    """Read a ``PYTORCH_CUDA_ALLOC_CONF`` string as PyTorch does (keys it knows; MiB sizes)."""
    fields: dict[str, object] = {"conf": conf}
    try:
        for item in filter(None, (p.strip() for p in conf.split(","))):
            key, _, value = item.partition(":")
            if key == "expandable_segments":
                fields["expandable_segments"] = value.strip().lower() == "true"
            elif key == "max_split_size_mb":
                fields["max_split_size"] = int(value) << 20
            elif key == "roundup_power2_divisions":
                fields["roundup_power2_divisions"] = (int(value),) * 16
            elif key == "garbage_collection_threshold":
                fields["garbage_collection_threshold"] = float(value)
            elif key == "backend":
                fields["backend"] = value.strip()
            else:
                raise MemprofError(f"allocator setting {key!r} is not modelled"
                                   f" (modelled: {', '.join(_KEYS)})")
    except ValueError:
        raise MemprofError(f"cannot read allocator settings {conf!r}"
                           " (expected e.g. 'expandable_segments:True,max_split_size_mb:128')"
                           ) from None
    settings = AllocatorSettings(**fields)  # type: ignore[arg-type]
    if settings.backend != "native":
        raise MemprofError(f"allocator backend {settings.backend} is not modelled"
                           " (only PyTorch's native caching allocator is)")
    return settings
