"""Ctrl-C held off while an engine call changes state, so that the interrupt lands between calls.

Python raises KeyboardInterrupt in the main thread between any two bytecodes, and one engine call's bookkeeping
(which staging buffer a read in flight fills, which phase a step is in, which parameter is resident) spans many:
an interrupt in between leaves it half changed, and a notebook user who interrupts a cell and runs it again
would train on from there. :class:`HeldInterrupts` swaps the SIGINT handler for one that records the signal for
the length of a call, then restores the handler and delivers the signal to it, so the KeyboardInterrupt
surfaces when the call has finished and the engine is consistent. A second Ctrl-C during the call is delivered
at once (a call that hangs stays interruptible); ``on_forced`` runs first, and the engine marks itself failed.

Left alone: calls from threads other than the main one (SIGINT interrupts only the main thread), calls nested in
a held one, and a SIGINT disposition that is not a Python callable (SIG_IGN, SIG_DFL).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable


FORCED = "a second Ctrl-C cut it short"


class _Recorder:
    """The SIGINT handler while a call runs: records the first signal, passes the second on."""

    def __init__(self, original: Callable[[int, FrameType | None], Any], on_forced: Callable[[], None]) -> None:
        self.original = original
        self.on_forced = on_forced
        self.pending: tuple[int, FrameType | None] | None = None
        self.forced = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None:
            self.pending = (signum, frame)
            return
        self.forced = True
        self.on_forced()
        if self.original is signal.default_int_handler:
            raise KeyboardInterrupt(FORCED)
        self.original(signum, frame)


class HeldInterrupts:
    """``with HeldInterrupts(on_forced):`` around a call that must not be cut short by one Ctrl-C."""

    __slots__ = ("_on_forced", "_recorder")

    def __init__(self, on_forced: Callable[[], None]) -> None:
        self._on_forced = on_forced
        self._recorder: _Recorder | None = None

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        original = signal.getsignal(signal.SIGINT)
        if isinstance(original, _Recorder) or not callable(original):
            return
        self._recorder = _Recorder(original, self._on_forced)
        signal.signal(signal.SIGINT, self._recorder)

    def __exit__(self, *exc: object) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        signal.signal(signal.SIGINT, recorder.original)
        if recorder.pending is not None and not recorder.forced:
            recorder.original(*recorder.pending)  # the default handler raises KeyboardInterrupt here
