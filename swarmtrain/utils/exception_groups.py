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

    ``trio.Cancelled`` leaves do not count as errors: a group of one error and cancellations
    (a task failed while its scope was being cancelled, e.g. a reply to a reset connection as
    the host shuts down) is that error, which the caller's ``except`` clauses then see (the
    cancellation is raised again at the caller's next checkpoint). A group of only
    ``Cancelled`` becomes one ``Cancelled``. Groups of several real errors are re-raised
    unchanged, so nothing is hidden.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        errors = [leaf for leaf in leaves if not isinstance(leaf, trio.Cancelled)]
        if len(errors) == 1:
            raise errors[0] from None
        if not errors:
            raise leaves[0] from None  # several tasks cancelled by the same scope
        raise
