"""Ctrl-C held off while an engine call changes state, so that the interrupt lands between calls.

Python raises KeyboardInterrupt in the main thread between any two bytecodes, and one engine call's bookkeeping
(which staging buffer a read in flight fills, which phase a step is in, which parameter is resident) spans many:
an interrupt in between leaves it half changed, and a notebook user who interrupts a cell and runs it again
would train on from there. :class:`HeldInterrupts` swaps the SIGINT handler for one that records the signal for
the length of a call, then restores the handler and delivers the signal to it, so the KeyboardInterrupt
surfaces when the call has finished and the engine is consistent (if the call raised an error of its own, the
KeyboardInterrupt replaces it, the error as its context). A second Ctrl-C during the call is delivered at once (a
call that hangs stays interruptible), and SIGINT is no longer held; when the handler's exception leaves the call,
``on_forced`` runs and the engine allows only ``close()`` from then on. A handler of the user's that only sets a
flag gets both signals, and the call goes on.

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
    """The SIGINT handler while a call runs: records the first signal, passes the second on (and, from then on,
    SIGINT goes to the original handler again)."""

    def __init__(self, original: Callable[[int, FrameType | None], Any], on_forced: Callable[[], None]) -> None:
        self.original = original
        self.on_forced = on_forced
        self.pending: tuple[int, FrameType | None] | None = None
        self.forced = False
        self.closing = False  # the call has returned: a signal now is only recorded, for __exit__ to deliver

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None or self.closing:
            self.pending = self.pending or (signum, frame)
            return
        self.forced = True
        signal.signal(signal.SIGINT, self.original)
        pending, self.pending = self.pending, None
        try:
            if self.original is signal.default_int_handler:
                raise KeyboardInterrupt(FORCED)
            self.original(*pending)  # a handler of the user's: both signals, in order
            self.original(signum, frame)
        except BaseException:
            self.on_forced()  # only a call the interrupt leaves is cut short (a handler may just set a flag)
            raise


class HeldInterrupts:
    """``with HeldInterrupts(on_forced):`` around a call that must not be cut short by one Ctrl-C."""

    __slots__ = ("_on_forced", "_recorder")

    def __init__(self, on_forced: Callable[[], None]) -> None:
        self._on_forced = on_forced
        self._recorder: _Recorder | None = None

    def __enter__(self) -> "HeldInterrupts":
        if threading.current_thread() is not threading.main_thread():
            return self
        original = signal.getsignal(signal.SIGINT)
        if isinstance(original, _Recorder) or not callable(original):
            return self
        self._recorder = _Recorder(original, self._on_forced)
        signal.signal(signal.SIGINT, self._recorder)
        return self

    def raise_if_pressed(self) -> None:
        """Raises the KeyboardInterrupt of a Ctrl-C held so far here, where the caller can stop cleanly (a long
        build between its parts), instead of when the call returns; a press after it is held again. A handler of
        the user's gets its signal when the call returns, as it would without this (it may only set a flag)."""
        recorder = self._recorder
        if recorder is not None and recorder.pending is not None and not recorder.forced \
                and recorder.original is signal.default_int_handler:
            recorder.pending = None
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        recorder.closing = True
        signal.signal(signal.SIGINT, recorder.original)
        if recorder.pending is not None:
            pending, recorder.pending = recorder.pending, None
            recorder.original(*pending)  # the default handler raises KeyboardInterrupt here
