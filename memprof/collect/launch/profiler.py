"""``--profile``: torch.profiler over a short window of optimizer steps, as a Chrome trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class StepWindowProfiler:
    """Profile optimizer steps ``first`` to ``first + count - 1`` (1-based) of the run.

    The window opens after step ``first - 1`` so the first steps' one-time costs
    (optimizer state, caches) stay out of it. If the run ends inside the window, the
    trace covers what ran.
    """

    def __init__(self, path: Path, first: int = 2, count: int = 2) -> None:
        self.path = path
        self.first, self.count = first, count
        self._steps = 0
        self._profile: torch.profiler.profile | None = None
        self._handle: Any = None
        self.written = False

    def start(self) -> None:
        self._handle = register_optimizer_step_post_hook(self._on_step)
        if self.first <= 1:
            self._open()

    def stop(self) -> None:
        """Remove the hook; close and write the trace if the window is still open."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._close()

    def _on_step(self, optimizer: object, args: object, kwargs: object) -> None:
        self._steps += 1
        if self._steps == self.first - 1:
            self._open()
        elif self._steps == self.first + self.count - 1:
            self._close()

    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, profile_memory=True,
                                               record_shapes=True)
        self._profile.__enter__()

    def _close(self) -> None:
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        profile.export_chrome_trace(str(self.path))
        self.written = True
