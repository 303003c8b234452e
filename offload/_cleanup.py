"""Cleanup after a failure that must not hide the failure.

``initialize`` builds many owners (the store, swap engines, threads, hooks); when one of them fails, everything
built so far is closed before the error propagates. A second error raised by that cleanup (it often follows from
the first, e.g. a half-built object) must not replace the original: :func:`close_after_failure` attaches it to the
original as a note and lets the caller re-raise the original.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("offload")


def close_after_failure(close: Callable[[], object], error: BaseException) -> None:
    """Runs ``close()`` while ``error`` propagates; an exception from it is noted on ``error``, not raised."""
    try:
        close()
    except BaseException as cleanup:  # noqa: BLE001 - the original error is the one the caller re-raises
        note = f"(while cleaning up after this error, another was raised: {type(cleanup).__name__}: {cleanup})"
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # Python 3.10
            log.warning("offload: %s", note)
