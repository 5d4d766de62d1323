"""collapse_exception_groups: the plain error out of a trio task group, also mid-cancellation."""

from __future__ import annotations

import sys

import pytest
import trio

from swarmtrain.p2p.errors import RPCCancelledError
from swarmtrain.utils.exception_groups import collapse_exception_groups

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


async def _fail_while_cancelled(error: BaseException, cancel: trio.CancelScope) -> None:
    """A task group in which one task raises ``error`` as its scope is being cancelled (a
    handler whose write failed while its host shuts down), beside a task that is cancelled."""
    async with trio.open_nursery() as nursery:

        async def fail() -> None:
            cancel.cancel()
            raise error

        nursery.start_soon(trio.sleep_forever)
        nursery.start_soon(fail)


@pytest.mark.trio
async def test_a_single_error_comes_out_plain():
    with pytest.raises(ValueError, match="alone"):
        with collapse_exception_groups():
            async with trio.open_nursery() as nursery:

                async def fail() -> None:
                    raise ValueError("alone")

                nursery.start_soon(fail)


@pytest.mark.trio
async def test_one_error_among_cancellations_comes_out_plain():
    # The host-shutdown case: an RPC handler's reply failed (the caller reset the connection)
    # while the host's scope was cancelled. Before, the group [RPCCancelledError, Cancelled]
    # passed `except RPCError` and `except Exception` in the RPC server and crashed the host.
    with trio.CancelScope() as outer:
        with pytest.raises(RPCCancelledError, match="reset"):
            with collapse_exception_groups():
                await _fail_while_cancelled(RPCCancelledError("connection reset"), outer)
    assert outer.cancelled_caught is False  # the error was caught inside, not the cancellation


@pytest.mark.trio
async def test_only_cancellations_come_out_as_one_cancelled():
    with trio.CancelScope() as outer:
        with collapse_exception_groups():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                outer.cancel()
    assert outer.cancelled_caught


@pytest.mark.trio
async def test_several_errors_stay_a_group():
    with pytest.raises(BaseExceptionGroup) as caught:
        with collapse_exception_groups():
            async with trio.open_nursery() as nursery:

                async def fail(error: Exception) -> None:
                    raise error

                nursery.start_soon(fail, ValueError("a"))
                nursery.start_soon(fail, KeyError("b"))
    assert {type(e) for e in caught.value.exceptions} == {ValueError, KeyError}
