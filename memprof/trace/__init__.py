"""Traces in PyTorch's memory-snapshot format: safe loading and the typed model."""

from memprof.trace.load import load_snapshot
from memprof.trace.model import Block, DeviceTrace, Frame, Segment, Snapshot

__all__ = ["Block", "DeviceTrace", "Frame", "Segment", "Snapshot", "load_snapshot"]
