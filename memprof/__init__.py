"""memprof: a GPU memory profiler and out-of-memory diagnoser for PyTorch training."""

__version__ = "0.1.0"
