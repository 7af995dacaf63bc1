"""Cheap Python stack capture as recorded events hold stacks (``memprof.trace.events``), with
interning.

Identical frames and identical stacks are returned as the same objects, so a pickled
trace stores each of them once. They are tuples of strings and integers, which the
cyclic garbage collector stops tracking.

    stacks = StackCapture()
    stacks.pin(sys._getframe())  # optional: the frames around the recording
    stack = stacks.capture(sys._getframe())  # ((name, filename, line), ...), innermost first
"""

from __future__ import annotations

import inspect
from types import CodeType, FrameType

from memprof.trace.events import Frame, Stack

# memprof's own wrappers around the script's calls (zero_grad): left out of every stack
HIDDEN_CODES: set[CodeType] = set()
# a generator's or coroutine's frame is called from wherever it is resumed
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class StackCapture:
    """Turns live Python frames into interned stacks of frame tuples, innermost first."""

    def __init__(self) -> None:
        self._frames: dict[tuple[int, int], Frame] = {}
        self._stacks: dict[tuple[int, ...], Stack] = {}
        # Code objects behind cached ids stay alive so that their ids are never reused.
        self._codes: list[CodeType] = []
        # id(frame) -> a token for the stack from that frame outwards, and the frames
        # themselves, held so that their ids are never reused while they are known
        self._tokens: dict[int, int] = {}
        self._held: dict[int, FrameType] = {}
        # id(frame) -> the stack a thread's stacks continue with from that frame outwards
        self._origins: dict[int, Stack] = {}

    def pin(self, frame: FrameType | None) -> None:
        """Note the frames from ``frame`` outwards (those around a recording), or forget
        every known frame (None). While a function's frame runs, the frames outside it stay
        as they are, so a stack that reaches one of these is known from there on without
        walking."""
        self._tokens, self._held, self._origins = {}, {}, {}
        while frame is not None:
            if not frame.f_code.co_flags & _RESUMABLE:
                self._tokens[id(frame)] = id(frame)
                self._held[id(frame)] = frame
            frame = frame.f_back

    def hold(self, frame: FrameType) -> None:
        """Know the stack from ``frame`` outwards while that frame runs a call whose frames
        stay as they are (a module's ``_call_impl`` around its forward), until ``release``:
        captures inside it walk only the frames within. Deep stacks (a trainer, a model's
        nested modules) then cost what their innermost frames cost."""
        token = id(self.capture(frame))  # interned: its id is the outer stack's, for good
        self._tokens[id(frame)] = token
        self._held[id(frame)] = frame

    def continue_with(self, frame: FrameType, origin: Stack) -> None:
        """Stacks captured inside ``frame`` (the outermost of a thread's own that matter)
        continue with ``origin`` (where the thread was started) instead of the thread's
        bootstrap frames, until ``release``: a weight loaded on a pool thread is the
        ``from_pretrained`` line's."""
        self._tokens[id(frame)] = id(origin)  # interned: its id is that stack's, for good
        self._held[id(frame)] = frame
        self._origins[id(frame)] = origin

    def release(self, frame: FrameType) -> None:
        """Forget a frame ``hold`` or ``continue_with`` noted (its call is returning)."""
        self._tokens.pop(id(frame), None)
        self._held.pop(id(frame), None)
        self._origins.pop(id(frame), None)

    def capture(self, frame: FrameType | None) -> Stack:
        """Return the stack from `frame` outwards (shared with every capture of it)."""
        # Keyed by instruction offset: O(1), where a line number needs a table scan. A key
        # that stops at a known frame has odd length: its token stands for it and the rest.
        key: list[int] = []
        tokens = self._tokens
        f = frame
        while f is not None:
            token = tokens.get(id(f))
            if token is not None:
                key.append(token)
                break
            key.append(id(f.f_code))
            key.append(f.f_lasti)
            f = f.f_back
        stack_key = tuple(key)
        stack = self._stacks.get(stack_key)
        if stack is None:
            stack = self._stacks[stack_key] = self._build(frame)
        return stack

    def _build(self, frame: FrameType | None) -> Stack:
        stack: list[Frame] = []
        origins = self._origins
        while frame is not None:
            origin = origins.get(id(frame)) if origins else None
            if origin is not None:
                stack += origin
                break
            code = frame.f_code
            if code in HIDDEN_CODES:
                frame = frame.f_back
                continue
            line = frame.f_lineno or 0  # None on rare synthetic instructions
            key = (id(code), line)
            entry = self._frames.get(key)
            if entry is None:
                entry = self._frames[key] = (code.co_name, code.co_filename, line)
                self._codes.append(code)
            stack.append(entry)
            frame = frame.f_back
        return tuple(stack)
