"""Trio task groups wrap every error in an ExceptionGroup; our public API raises plain errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


@contextmanager
def collapse_exception_groups() -> Iterator[None]:
    """Re-raise a group that holds a single error (however deeply nested) as that error.

    A group of only ``trio.Cancelled`` becomes one ``Cancelled``. Groups of several real
    errors are re-raised unchanged, so nothing is hidden.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        if all(isinstance(leaf, trio.Cancelled) for leaf in leaves):
            raise leaves[0] from None  # several tasks cancelled by the same scope
        raise
