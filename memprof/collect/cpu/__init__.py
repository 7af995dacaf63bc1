"""Recorders of the script's host tensors: the exact one (a dispatch mode that sees every
storage, ``recorder.py``) and the light one (the CPU allocator's own events, ``light.py``)."""
