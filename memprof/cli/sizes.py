"""Sizes typed by people: the parser lives in :mod:`memprof.sizes`."""

from memprof.sizes import parse_size

__all__ = ["parse_size"]
