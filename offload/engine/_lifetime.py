"""An engine's lifetime once built: Ctrl-C held over its calls and forwards, ``close()`` and the teardown that
stops and frees the parts in reverse build order, an engine collected unclosed, and the process's exit and SIGTERM
closing the engines still open.

Ctrl-C: every engine call that changes state runs under :func:`held` (see ``_interrupts.py``), and a plain
``model(x)`` is held over the root's forward (its ``Slot.HOLD``: first of its pre-hooks, last of its hooks). A
second Ctrl-C cuts the call short, and from then on every call but ``close`` is refused, naming it (the phase's
records are the step controller's, ``_step.py``). A teardown cut short keeps its remaining steps, and the engine
among the open ones, to be finished by the next ``close()``, the next ``initialize`` of its model, or the exit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import _state
from .._cleanup import note_on, run_all
from ..dist._group import release_store
from ._interrupts import HeldInterrupts
from ._step import Phase

if TYPE_CHECKING:
    from ._engine import Engine

log = logging.getLogger("offload")


def held(call: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Runs an engine method with Ctrl-C held off until it returns (see ``_interrupts``); a second Ctrl-C cuts it
    short, and from then on every such method but ``close`` is refused, naming the call cut short."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: "Engine", *args: Any, **kwargs: Any) -> Any:
            if self._steps.cut_short is not None and call != "engine.close":
                raise self._steps.cut_short_error(call)
            with self._life.hold(call):
                return method(self, *args, **kwargs)
        return run
    return wrap


class Lifetime:
    """What ``close()`` undoes besides the parts, and how: owns the hooks put on the model, the per-rank swap
    folders made, the teardown steps an interrupt cut short, the holds over the forwards running and why
    ``initialize`` failed (the other ranks' errors quote it). Reads the parts and the phase through ``engine``."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine
        self._hooks: list[Any] = []
        self._rank_dirs: list[Path] = []
        self._teardown_left: list[Callable[[], object]] | None = None  # close's steps an interrupt cut short
        self._forward_holds: list[HeldInterrupts] = []  # Ctrl-C held over the root forwards running
        self.stop_reason: str | None = None  # why initialize failed: the other ranks' errors quote it

    def remove_at_close(self, *handles: Any) -> None:
        """Hooks and slots on the model, removed first of all at close."""
        self._hooks.extend(handles)

    def rmdir_at_close(self, folder: Path) -> None:
        """A per-rank swap folder this engine made, removed at close if left empty."""
        self._rank_dirs.append(folder)

    # Ctrl-C -----------------------------------------------------------------------------------------------------

    def hold(self, call: str) -> HeldInterrupts:
        """Ctrl-C held off for ``call`` (see :func:`held`), for code that runs an engine call's work itself."""
        return HeldInterrupts(lambda: self._engine._steps.interrupted(call))

    def hold_forward(self, *_: Any) -> None:
        """``Slot.HOLD`` on the root's forward: Ctrl-C held until the forward ends (:meth:`release_forward`), so
        that a plain ``model(x)`` fetches and places parameters as whole as ``engine(x)`` does."""
        steps = self._engine._steps
        if steps.cut_short is not None:
            raise steps.cut_short_error("the forward")
        hold = self.hold("the forward")
        hold.__enter__()
        self._forward_holds.append(hold)
        if steps.phase is Phase.FAILED:  # (after the hold: the always-called last hook releases it)
            raise steps.failed_error("the forward")

    def release_forward(self, *_: Any) -> None:
        """``Slot.HOLD``'s last part, run when the forward raised too: a Ctrl-C held over it lands now. (A second
        Ctrl-C leaves the forward without it: that hold's recorder has already given SIGINT back.)"""
        if self._forward_holds:
            self._forward_holds.pop().__exit__(None, None, None)

    # closing ----------------------------------------------------------------------------------------------------

    def start_failed(self, reason: str | None) -> None:
        """``initialize`` raised (``reason``: why, unless another rank's failure caused it): nothing may run on."""
        self._engine._steps.mark_closed()
        self.stop_reason = reason

    def close(self) -> None:
        """``engine.close()``: the updates in flight finished and handed to the model, then the teardown."""
        e, steps = self._engine, self._engine._steps
        if steps.phase is Phase.CLOSED:
            if self._teardown_left is None or self._teardown_left:  # cut short before its steps, or in them
                self.teardown()
            return
        try:
            if steps.cut_short is None:  # (else the records the updates would go by may be half changed)
                failed = steps.phase is Phase.FAILED
                try:
                    steps.settle()
                    e.optimizer.finish()
                    if e._norm.pending:  # readable after close
                        e._norm.take()
                except Exception:  # noqa: BLE001 - a failed step's error, raised already
                    if not failed:
                        raise
                for copy in e.weights.apply_update(e._zero):  # the model keeps every update it was given
                    copy.wait()
        finally:
            steps.mark_closed()
            try:
                self.teardown()
            except Exception as exc:
                if steps.cut_short is not None:
                    note_on(exc, f"(a second Ctrl-C had cut {steps.cut_short} short, so the model's parameters may "
                                 "not all be handed back: load them from a checkpoint)")
                raise

    def teardown(self) -> None:
        """Stops and frees whatever was built, in reverse order; safe on a half-built engine. Steps an interrupt
        cut short are kept in ``_teardown_left`` (and the engine among those closed at exit) to run again."""
        e = self._engine
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        sync = e.copies.synchronize if e.copies is not None else None
        steps = self._teardown_left if self._teardown_left is not None else [
            e._gate.close if e._gate is not None else None,
            sync,  # no copy may still touch the buffers freed below
            e.grads.close if e.grads is not None else None,
            e.optimizer.wait if e.optimizer is not None else None,
            e.weights.close if e.weights is not None else None,  # the model gets its parameters back
            e.optimizer.close if e.optimizer is not None else None,
            e._reduce.close if e._reduce is not None else None,
            sync,
            e.store.close if e.store is not None else None,
            self._close_comm,
        ]
        self._teardown_left = []
        try:  # every step runs even after one fails (a GPU in a sticky error state fails each synchronize)
            run_all(steps, cut_short=self._teardown_left)
        finally:
            if not self._teardown_left:
                _state.closed(e)
                _unfinished.discard(e)
            else:  # kept alive (a failed initialize returned no engine) to be finished at exit
                _state.opened(e)
                _unfinished.add(e)

    def _close_comm(self) -> None:
        """Stops the heartbeat, destroys the process group if the engine created it, and removes the per-rank
        NVMe folders it made (when empty: the swap engines have removed their files)."""
        try:
            self._engine.comm.close(self.stop_reason)
        finally:
            for d in self._rank_dirs:
                try:
                    d.rmdir()
                except OSError:
                    pass
            self._rank_dirs = []

    def close_alone(self) -> None:
        """Closes without the other ranks (at exit): the process group first, so that no collective of the close
        waits on ranks that may be gone (they fail at once instead, and are passed over); the rest is local
        (threads, buffers, swap files). The updates of a step still running are dropped: nothing trains on."""
        with contextlib.suppress(Exception):
            self._engine.comm.close(self.stop_reason)
        self._engine._steps.mark_closed()
        try:
            self.teardown()
        except Exception as exc:  # noqa: BLE001 - a collective of the teardown, refused once the group is gone
            log.debug("offload: closing an engine alone at exit: %s", exc)

    def collected(self) -> None:
        """The engine's ``__del__``: one dropped without ``close()`` (its model dropped too, or handed to a new one)
        is closed when it is collected, with a ResourceWarning: its threads, buffers and swap files would otherwise
        stay until exit."""
        e = self._engine
        if e._steps.phase is Phase.CLOSED:  # (closed, or its construction failed)
            return
        warnings.warn(f"offload: an engine (world rank {e.rank} of {e.world_size}) was garbage collected "
                      "without close(): closing it now. Call engine.close(), or use `with offload.initialize(...) "
                      "as engine:`", ResourceWarning, stacklevel=3)
        try:
            e.close() if e.world_size == 1 else self.close_alone()
        except Exception as exc:  # noqa: BLE001 - nobody to raise to in a finalizer
            log.warning("offload: closing a collected engine failed: %s", exc)


_unfinished: set["Engine"] = set()  # engines whose teardown a second Ctrl-C cut short, held until it is finished


@atexit.register
def _close_at_exit() -> None:
    """Engines still open when the interpreter exits (a script that did not close its engine, an uncaught
    exception, SIGTERM: see :func:`_on_sigterm`) are closed while their threads still run, so their swap files are
    removed and no thread is killed inside a torch op. With several ranks each closes alone
    (:meth:`Lifetime.close_alone`), its process group first, before the interpreter's shutdown, where its gloo
    threads could abort the process (SIGABRT, "terminate called without an active exception": 3 of 12 runs of a
    2-rank script that did not close its engine, 2 of 52 since)."""
    for engine in _state.open_engines():
        try:
            if engine.world_size == 1:
                engine.close()
            else:
                engine._life.close_alone()
        except Exception as exc:  # noqa: BLE001 - exiting anyway: say so, close the others
            log.warning("offload: closing an engine at exit failed: %s", exc)
    release_store()  # (the rendezvous store's threads too)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (torchrun ending the other ranks when one failed, a scheduler preempting the job) ends the process
    as an uncaught exception would: ``SystemExit`` unwinds the program and the exit hook closes the open engines,
    removing their swap files, which the default action (killed on the spot) left on every rank. Installed by
    the first engine when SIGTERM had its default action; with no engine open it takes that action itself. A
    second SIGTERM during the unwinding kills at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not _state.open_engines():
        os.kill(os.getpid(), signal.SIGTERM)
        return
    log.warning("offload: SIGTERM: closing the open engines (their swap files are removed) and exiting")
    raise SystemExit(128 + signum)


def take_sigterm() -> None:
    """Installs :func:`_on_sigterm` where SIGTERM still has its default action (a handler of the program's own is
    left alone) and this is the main thread (the only one that may)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
