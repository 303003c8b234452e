"""Cleanup after a failure that must not hide the failure.

``initialize`` builds many owners (the store, swap engines, threads, hooks); when one of them fails, everything
built so far is closed before the error propagates. A second error raised by that cleanup (it often follows from
the first, e.g. a half-built object) must not replace the original: :func:`close_after_failure` attaches it to the
original as a note and lets the caller re-raise the original. :func:`run_all` is the same rule for a ``close()``
made of steps: each runs even after an earlier one failed (a GPU left in a sticky error state fails every later
synchronize, and the swap files, threads and hooks must still go), and the first error is raised; an interrupt
stops it, and the steps left can be kept to run again.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

log = logging.getLogger("offload")


def close_after_failure(close: Callable[[], object], error: BaseException) -> None:
    """Runs ``close()`` while ``error`` propagates; an exception from it is noted on ``error``, not raised."""
    try:
        close()
    except BaseException as cleanup:  # noqa: BLE001 - the original error is the one the caller re-raises
        _note(error, cleanup)


def _note(error: BaseException, cleanup: BaseException) -> None:
    note_on(error, f"(while cleaning up after this error, another was raised: {type(cleanup).__name__}: {cleanup})")


def note_on(error: BaseException, note: str) -> None:
    """Adds ``note`` to ``error``'s message (Python 3.10, which has no notes: logs it as a warning)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        log.warning("offload: %s", note)


def run_all(steps: Iterable[Callable[[], object] | None], *, cut_short: list[Callable[[], object]] | None = None
            ) -> None:
    """Calls every step (None: skipped) in order, even after one failed; then raises the first error, with any
    later ones noted on it. A step interrupted (KeyboardInterrupt, SystemExit: not an ``Exception``, so no failure
    of its own) stops the run, since the steps after it may free what it still needs: it and the rest go to
    ``cut_short`` (when given), for a later call to run again."""
    first: BaseException | None = None
    steps = list(steps)
    for i, step in enumerate(steps):
        if step is None:
            continue
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - raised below, once every step has run
            if not isinstance(exc, Exception):
                if cut_short is not None:
                    cut_short.extend(s for s in steps[i:] if s is not None)
                if first is not None:
                    _note(exc, first)
                raise
            if first is None:
                first = exc
            else:
                _note(first, exc)
    if first is not None:
        raise first
