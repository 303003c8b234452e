"""SwapHandle: one in-flight read or write and its completion signal, in one record.

A request is cut into parts (stripes of whole blocks) that worker threads run in parallel; the handle counts them
down and completes once, with the first error any part raised. Until then it holds the caller's tensor alive (the
workers write into or read from its memory); after completion that reference is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from ._swapfile import Extent


class Op(Enum):
    READ = "read"
    WRITE = "write"


class SwapHandle:
    """Returned by :meth:`SwapEngine.write` and :meth:`SwapEngine.read`. ``wait()`` blocks and raises what the I/O
    raised; ``done()`` polls; ``await handle`` waits from asyncio."""

    __slots__ = ("key", "op", "nbytes", "tensor", "address", "extent", "after", "_future", "_lock", "_parts_left",
                 "_error", "_on_complete", "sums", "expected")

    def __init__(self, key: str, op: Op, tensor: "torch.Tensor", after: "SwapHandle | None",
                 on_complete: Callable[["SwapHandle", BaseException | None], None]) -> None:
        self.key = key
        self.op = op
        self.tensor: torch.Tensor | None = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.address = tensor.data_ptr()
        self.extent: Extent | None = None  # writes: chosen at issue; reads: resolved when the first part runs
        self.after = after  # the previous request on the same key, which must finish first
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()
        # running from the start, so never cancelled: an asyncio waiter that is cancelled (``wait_for``'s timeout)
        # stops waiting, while the transfer, which the workers still run, completes this future as usual
        self._future.set_running_or_notify_cancel()
        self._lock = threading.Lock()
        self._parts_left = 0
        self._error: BaseException | None = None
        self._on_complete = on_complete
        self.sums: list[int] | None = None  # per-block checksums of the bytes moved (None: checksums off)
        self.expected: tuple[int, ...] | None = None  # reads: the checksums recorded when the bytes were written

    # caller side ------------------------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the transfer finished; re-raises its error (OSError, KeyError, ValueError)."""
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self.op.value} of key {self.key!r} not finished after {timeout} s") from None

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Any:
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<SwapHandle {self.op.value} {self.key!r} {self.nbytes} B {state}>"

    # worker side ------------------------------------------------------------------------------------------------

    def start(self, parts: int) -> None:
        self._parts_left = parts
        if parts == 0:
            self._finish()

    def failed(self) -> bool:
        return self._error is not None

    def part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._parts_left -= 1
            last = self._parts_left == 0
        if last:
            self._finish()

    def fail_now(self, error: BaseException) -> None:
        """Completes a request that never reached the workers (its issue failed)."""
        self._error = error
        self._finish()

    def _finish(self) -> None:
        error = self._error
        try:
            self._on_complete(self, error)
        except BaseException as exc:  # bookkeeping failed: report it rather than leave a waiter hanging
            error = error or exc
        self.tensor = None
        self.after = None
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)


@dataclass(frozen=True)
class Part:
    """Bytes [start, end) of a request's tensor; the unit a worker runs."""

    handle: SwapHandle
    start: int
    end: int
