"""Worker: one thread that runs submitted jobs in order (or, when asked, the lowest key first), each with a
:class:`Job` handle to wait on.

Used for the optimizer's stepper (all access to optimizer state during a step) and for the gradient stream's
accumulation adds. A job that raises marks its handle failed (``Job.wait()`` re-raises its own error) and the
worker skips later jobs until someone calls ``wait_idle()``, which re-raises the first error: an error in the
thread surfaces at the next wait, never silently.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch


def bind_thread(device: torch.device | None) -> None:
    """Makes ``device`` the calling thread's current CUDA device (nothing for the CPU or None)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


class Job:
    """One job of a :class:`Worker`; ``wait()`` returns once it has run, or raises the error it raised (a job
    skipped after an earlier failure raises that failure)."""

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class Worker:
    """One named thread running jobs in submission order; ``close()`` finishes what is queued and joins it.
    ``device``: the engine's device, made the thread's current CUDA device (a thread starts on cuda:0, where any
    implicit CUDA call would otherwise create a context for a rank training on another GPU).

    ``lowest_first``: while set, the next job run is the queued one with the lowest ``key`` (jobs without one
    after those with one, in order). The optimizer sets it once backward has ended, so the sub-groups the next
    forward needs first are updated first."""

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        self._device = device
        self._queued: list[tuple[int, Any, tuple[Any, ...], Job]] = []  # (key, fn, args, job), submission order
        self._idle = threading.Condition()
        self._pending = 0  # queued or running
        self._closing = False
        self._error: BaseException | None = None
        self.lowest_first = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Any, *args: Any, key: int | None = None) -> Job:
        job = Job()
        with self._idle:
            self._pending += 1
            self._queued.append((sys.maxsize if key is None else key, fn, args, job))
            self._idle.notify_all()
        return job

    def wait_idle(self) -> None:
        """Waits for every job submitted so far; re-raises the first error since the last wait."""
        with self._idle:
            while self._pending:
                self._idle.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        if self._thread.is_alive():
            with self._idle:
                self._closing = True
                self._idle.notify_all()
            self._thread.join()

    def _next(self) -> tuple[Any, tuple[Any, ...], Job] | None:
        """The next job to run, waiting for one; None once closing with nothing queued."""
        with self._idle:
            while not self._queued and not self._closing:
                self._idle.wait()
            if not self._queued:
                return None
            i = 0
            if self.lowest_first:  # a few hundred sub-groups at most: a scan is cheaper than keeping a heap
                i = min(range(len(self._queued)), key=lambda j: self._queued[j][0])
            _, fn, args, job = self._queued.pop(i)
            return fn, args, job

    def _run(self) -> None:
        try:
            bind_thread(self._device)
        except BaseException as exc:  # every job then fails with it: it surfaces at the next wait
            self._error = exc
        while (item := self._next()) is not None:
            fn, args, job = item
            try:
                if self._error is not None:  # after a failure, later jobs are skipped until someone waits
                    job.error = self._error
                else:
                    fn(*args)
            except BaseException as exc:
                self._error = job.error = exc
            finally:
                job._done.set()
                # the job's function and arguments go now, not when the next job comes: an idle thread must not
                # keep the last step's optimizer, and through it an engine dropped unclosed, alive
                item = fn = args = None
                with self._idle:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.notify_all()
