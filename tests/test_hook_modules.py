"""Attributing an allocator trace's allocs to modules from the moments they ran, on
hand-made traces (the samples compare it with the exact CPU recorder: test_hook_labels)."""

from __future__ import annotations

from typing import Any

from memprof.collect.hooks.trace_modules import module_trace


def _alloc(addr: int, t: int, size: int = 512) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "time_us": t}


def _free(addr: int, t: int) -> list[dict[str, Any]]:
    return [{"action": a, "addr": addr, "size": 512, "time_us": t}
            for a in ("free_requested", "free_completed")]


# "a" runs from 10 to 40 and "a.b" inside it from 20 to 30, on a microsecond clock
NESTED = [(10, "a", True), (20, "a.b", True), (30, "a", False),
          (40, None, False)]


def test_an_alloc_belongs_to_the_innermost_module_running() -> None:
    trace = [_alloc(0x1000 * k, t) for k, t in enumerate([5, 15, 25, 35, 45], start=1)]
    assert module_trace(trace, NESTED, []) == [[1, "a"], [2, "a.b"], [3, "a"]]


def test_at_the_same_microsecond_as_a_mark_the_innermost_module_wins() -> None:
    # a start claims an alloc of its own microsecond; an end does not
    trace = [_alloc(0x1000 * k, t) for k, t in enumerate([10, 20, 30, 40], start=1)]
    assert module_trace(trace, NESTED, []) == [[0, "a"], [1, "a.b"], [2, "a.b"], [3, "a"]]
    # one module ends and the next starts in the same microsecond as an alloc: the next
    marks = [(10, "a", True), (20, None, False), (20, "c", True)]
    assert module_trace([_alloc(0x1000, 20)], marks, []) == [[0, "c"]]


def test_marks_from_two_threads_are_put_in_time_order() -> None:
    marks = [(10, "a", True), (30, None, False), (20, "b", True)]
    trace = [_alloc(0x1000, 15), _alloc(0x2000, 25), _alloc(0x3000, 35)]
    assert module_trace(trace, marks, []) == [[0, "a"], [1, "b"]]


def test_a_parameter_goes_to_the_first_module_that_ran_with_it() -> None:
    # made before any module ran, freed, and its address reused by a second one
    trace = [_alloc(0x1000, 1), *_free(0x1000, 3), _alloc(0x1000, 4), _alloc(0x2000, 25)]
    owners = [(12, 0x1000, 512, "a"), (13, 0x1000, 512, "c"),
              (26, 0x2000, 512, "a")]
    # the first alloc was freed before "a" ran; the last was made inside "a.b": it stays
    assert module_trace(trace, NESTED, owners) == [[3, "a"], [4, "a.b"]]
    # a block too small for the storage is not its block
    assert module_trace(trace, [], [(12, 0x1000, 513, "a")]) == []
