"""CUDA graphs on the virtual GPU: captures allocate from a private pool, replays allocate
nothing.

What PyTorch's caching allocator does for a graph (``CUDACachingAllocator.cpp``,
``beginAllocateToPool``): while a capture runs, the capturing stream's allocations come
from the graph's private memory pool (its own, ``{n, 0}``, or one shared through
``graph_pool_handle()``, ``{0, n}``); blocks freed during the capture go back to that
pool, where the rest of the capture reuses them; after it, the pool's segments stay
reserved for replays, which allocate nothing, and ``empty_cache()`` leaves them alone
until no graph uses the pool any more (``reset()``, or the graph is deleted). Its static
outputs are ordinary tensors in the pool's blocks.

    graphs = CudaGraphs(recorder.placer)
    patches.update(graphs.patches())  # torch.cuda.CUDAGraph, graph_pool_handle, ...
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
import torch.cuda.graphs

from memprof.analysis.blocks import DEFAULT_POOL
from memprof.analysis.layout import Placer

Pool = tuple[int, int]


class CudaGraphs:
    """The graph API of one virtual card, placing captured allocations with ``placer``."""

    def __init__(self, placer: Placer) -> None:
        self._placer = placer
        self._graph_ids = itertools.count(1)  # a graph's own pool: (n, 0)
        self._user_ids = itertools.count(1)  # graph_pool_handle(): (0, n)
        self.capturing: VirtualCudaGraph | None = None

    def patches(self) -> dict[tuple[Any, str], Any]:
        """The ``torch.cuda`` replacements, by (module, attribute)."""
        graphs = self

        class CUDAGraph(VirtualCudaGraph):
            def __init__(self, keep_graph: bool = False) -> None:
                super().__init__(graphs)

        CUDAGraph.__qualname__ = CUDAGraph.__name__
        CUDAGraph.__module__ = "torch.cuda.graphs"
        patches: dict[tuple[Any, str], Any] = {}
        for module in (torch.cuda, torch.cuda.graphs):
            patches[(module, "CUDAGraph")] = CUDAGraph
            patches[(module, "graph_pool_handle")] = self.pool_handle
            patches[(module, "is_current_stream_capturing")] = self.is_capturing
        # torch.cuda.graph empties the host allocator's cache too: a CPU build has none
        patches[(torch._C, "_host_emptyCache")] = lambda: None
        return patches

    def pool_handle(self) -> Pool:
        """``torch.cuda.graph_pool_handle()``: a new pool that graphs may share."""
        return (0, next(self._user_ids))

    def is_capturing(self) -> bool:
        return self.capturing is not None

    def begin(self, graph: VirtualCudaGraph, pool: Pool | None) -> Pool:
        if self.capturing is not None:
            raise RuntimeError("Cannot capture a CUDA graph while another capture is underway"
                               " (the virtual GPU, as CUDA, captures one graph at a time)")
        pool = tuple(pool) if pool and tuple(pool) != DEFAULT_POOL else (next(self._graph_ids), 0)
        self._use(pool, 1)
        self.capturing = graph
        self._placer.pool = pool
        return pool

    def end(self) -> None:
        self.capturing = None
        self._placer.pool = DEFAULT_POOL

    def release(self, pool: Pool) -> None:
        """A graph no longer uses ``pool``: once no graph does, ``empty_cache`` frees it."""
        self._use(pool, -1)

    def _use(self, pool: Pool, change: int) -> None:
        users = self._placer.alloc.pools_in_use
        count = users.get(pool, 0) + change
        if count > 0:
            users[pool] = count
        else:
            users.pop(pool, None)


class VirtualCudaGraph:
    """``torch.cuda.CUDAGraph`` on the virtual card (``CudaGraphs.patches`` binds it)."""

    def __init__(self, graphs: CudaGraphs) -> None:
        self._graphs = graphs
        self._pool: Pool | None = None
        self._captured = False

    def capture_begin(self, pool: Pool | None = None, capture_error_mode: str = "global",
                      check_input_liveness: bool = False) -> None:
        if self._pool is not None:
            self.reset()
        self._pool = self._graphs.begin(self, pool)

    def capture_end(self) -> None:
        if self._graphs.capturing is not self:
            raise RuntimeError("CUDAGraph::capture_end called without a capture underway")
        self._graphs.end()
        self._captured = True

    def instantiate(self) -> None:
        self._check_captured("instantiate")

    def replay(self) -> None:
        self._check_captured("replay")  # the captured kernels allocate nothing

    def reset(self) -> None:
        if self._graphs.capturing is self:
            self._graphs.end()
        if self._pool is not None:
            self._graphs.release(self._pool)
        self._pool = None
        self._captured = False

    def pool(self) -> Pool:
        if self._pool is None:
            raise RuntimeError("Called CUDAGraph::pool without a preceding successful capture.")
        return self._pool

    def enable_debug_mode(self) -> None: ...

    def debug_dump(self, debug_path: str) -> None: ...

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise under the garbage collector
            self.reset()

    def _check_captured(self, what: str) -> None:
        if not self._captured:
            raise RuntimeError(f"Called CUDAGraph::{what} without a preceding successful"
                               " capture.")
