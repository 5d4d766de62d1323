"""Where this process's threads are and what CPU they used: the stacks, await positions and
per-thread CPU clocks the loop-stall detector (``loop_stalls``) samples. Frames of trio,
anyio, contextlib and threading (plumbing) are left out of stacks."""

from __future__ import annotations

import os
import sys
import threading
from types import CodeType
from typing import Any

__all__ = [
    "awaiting_at",
    "awaiting_position",
    "busiest",
    "code_text",
    "other_threads_at",
    "thread_stack",
    "threads_cpu",
]

STACK_DEPTH = 12  # frames of a sampled stack
_LOOP_STALLS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop_stalls.py")


def code_text(code: CodeType, line: int | None) -> str:
    path = "/".join(code.co_filename.rsplit("/", 2)[-2:])
    return f"{path}:{line} {code.co_name}"


_plumbing_codes: dict[CodeType, bool] = {}


def is_plumbing(code: CodeType) -> bool:
    plumbing = _plumbing_codes.get(code)
    if plumbing is None:
        path = code.co_filename
        plumbing = (
            "/trio/" in path
            or "/anyio/" in path
            or path.endswith(("contextlib.py", "threading.py"))
            or path == _LOOP_STALLS_FILE  # its GC callback, where a collection's stack is sampled
        )
        if len(_plumbing_codes) < 65536:  # bounded: code objects are few, but not fixed
            _plumbing_codes[code] = plumbing
    return plumbing


def awaiting_position(coro: Any) -> tuple[CodeType, int | None] | None:
    """A suspended coroutine chain's innermost frame outside trio, anyio and contextlib
    (the outermost frame when all are plumbing); None when it has finished."""
    found = None
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None and (found is None or not is_plumbing(frame.f_code)):
            found = (frame.f_code, frame.f_lineno)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return found


def awaiting_at(coro: Any) -> str:
    """Where a suspended coroutine waits (``path:line function``), "" when it has finished."""
    position = awaiting_position(coro)
    return "" if position is None else code_text(*position)


def thread_stack(ident: int, depth: int = STACK_DEPTH) -> tuple[str, ...]:
    """The innermost ``depth`` frames of a thread's stack, leaving out trio's own frames."""
    frame = sys._current_frames().get(ident)
    stack: list[str] = []
    while frame is not None and len(stack) < depth:
        if not is_plumbing(frame.f_code):
            stack.append(code_text(frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(stack)


def other_threads_at(exclude: set[int | None]) -> dict[str, str]:
    """``{thread name: its innermost frame outside trio}`` of the other Python threads."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    found = {}
    for ident, frame in sys._current_frames().items():
        if ident in exclude or ident not in names:
            continue
        while frame is not None and is_plumbing(frame.f_code) and frame.f_back is not None:
            frame = frame.f_back
        found[names[ident]] = code_text(frame.f_code, frame.f_lineno)
    return found


def thread_cpu(native_id: int) -> float | None:
    """A thread's CPU seconds from ``/proc/self/task/<id>/schedstat`` (None: gone or not
    Linux). Safe for threads that exited, unlike their pthread CPU clocks."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as file:
            return int(file.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def threads_cpu(exclude: set[int | None]) -> dict[int, tuple[str, float]]:
    """``{native id: (name, CPU seconds)}`` of this process's other Python threads."""
    found = {}
    for thread in threading.enumerate():
        if thread.ident in exclude or thread.native_id is None:
            continue
        cpu = thread_cpu(thread.native_id)
        if cpu is not None:
            found[thread.native_id] = (thread.name, cpu)
    return found


def busiest(before: dict[int, tuple[str, float]], top: int = 3) -> tuple[tuple[str, float], ...]:
    """The threads that used the most CPU since ``before`` (over 1 ms), busiest first."""
    used = []
    for native_id, (name, cpu) in before.items():
        now = thread_cpu(native_id)
        if now is not None and now - cpu > 0.001:
            used.append((name, now - cpu))
    return tuple(sorted(used, key=lambda entry: -entry[1])[:top])
