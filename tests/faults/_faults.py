"""Shared by the fault-injection tests: a FileIO that fails chosen swap-file syscalls, and a hang guard.

``Faults.arm(op, fault, times, after)`` lets ``after`` calls of ``op`` ("write" or "read", on either I/O path:
kernel AIO or pread/pwrite) through, then makes the next ``times`` fail with ``fault``: an errno (the call fails with
it), ``("short", n)`` (the call moves only ``n`` bytes), or an exception instance (raised from the worker thread as a
bug would be). ``times=None`` keeps failing until ``disarm``.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared test models

from nvme_swapper import FileIO  # noqa: E402


class Faults(FileIO):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: dict[str, tuple[object, int | None]] = {}
        self.passes: dict[str, int] = {}  # calls still let through before an armed fault
        self.hits: dict[str, int] = {"write": 0, "read": 0}

    def arm(self, op: str, fault: object, times: int | None = None, after: int = 0) -> None:
        with self.lock:
            self.armed[op] = (fault, times)
            self.passes[op] = after

    def disarm(self) -> None:
        with self.lock:
            self.armed.clear()

    def _take(self, op: str) -> object | None:
        with self.lock:
            if op not in self.armed:
                return None
            if self.passes.get(op, 0) > 0:
                self.passes[op] -= 1
                return None
            fault, times = self.armed[op]
            if times is not None:
                if times <= 1:
                    del self.armed[op]
                else:
                    self.armed[op] = (fault, times - 1)
            self.hits[op] += 1
            return fault

    def _sync(self, op: str, call: Callable[..., int], fd: int, buf: memoryview, offset: int) -> int:
        fault = self._take(op)
        if fault is None:
            return call(fd, buf, offset)
        if isinstance(fault, BaseException):
            raise fault
        if isinstance(fault, tuple):
            return call(fd, buf[: fault[1]], offset) if fault[1] else 0
        raise OSError(fault, os.strerror(fault))

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return self._sync("write", super().pwrite, fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return self._sync("read", super().pread, fd, buf, offset)

    def aio_run(self, ctx, depth, fd, is_write, transfers, single_submit=False, overlap=True):
        fault = self._take("write" if is_write else "read")
        if fault is None:
            return super().aio_run(ctx, depth, fd, is_write, transfers, single_submit, overlap)
        if isinstance(fault, BaseException):
            raise fault
        if isinstance(fault, tuple):  # the first transfer comes up short
            addr, n, off = transfers[0]
            if fault[1]:
                assert super().aio_run(ctx, depth, fd, is_write, [(addr, fault[1], off)]) is None
            return (0, fault[1])
        return (0, -fault)


def bounded(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Runs ``fn`` on a helper thread; a call still running after ``seconds`` fails the test (a hang), instead
    of hanging the suite. Returns its result or raises its exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, name="test-bounded", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {seconds} s: a hang")
    if "error" in out:
        raise out["error"]
    return out.get("value")
