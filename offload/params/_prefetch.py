"""Prefetcher: starts the fetches the next moments of a step will need, along the orders the step follows.

Forward's order is the model's :class:`~offload._trace.ForwardTrace` (parameter offload notes each fetch in it
while it records: the first forward, and any after one whose order departed); backward's is recorded here, the
same way, over the first backward. Later steps, at each fetch, start the fetches of the next parameters in that
order as long as the live parameters stay within ``stage3_max_live_parameters`` and the fetches in flight within
``stage3_prefetch_bucket_size``; in forward it may evict the oldest evictable parameters for room, in backward
only room that finished gradients freed (every leftover of forward is needed before anything further along the
trace). A step whose order departs from the trace stays correct (fetches wait), drops the trace and records a new
one: backward's at once, forward's from the next forward (under the trace's mode, which fetches what a module reads
outside its own forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._trace import ForwardTrace
from ..memory import BudgetExceeded
from ._record import ParamRecord, ParamState
from ._window import DeviceWindow


@dataclass
class _Backward:
    """The order backward fetched parameters in; ``pos`` is how far this step has followed it."""

    order: list[int] = field(default_factory=list)
    recording: bool = True
    pos: int = 0


class Prefetcher:
    """Follows the forward ``trace`` and its own backward order over ``window`` (see the module docstring); adds
    its departures to ``counters["trace_invalidations"]``."""

    def __init__(self, trace: ForwardTrace, window: DeviceWindow, counters: dict[str, int], *,
                 bucket: int) -> None:
        self.trace, self.window, self.counters = trace, window, counters
        self.bucket = bucket
        self._backward = _Backward()
        self._forward_pos = 0  # how far this forward has followed the trace

    def restart(self) -> None:
        """A forward or backward starts from the top of its order."""
        self._forward_pos = self._backward.pos = 0

    def end_backward(self) -> None:
        """Backward ended: the order it recorded is the one the next backwards follow."""
        if self._backward.order:
            self._backward.recording = False
        self.restart()

    def follow(self, rec: ParamRecord) -> None:
        """``rec`` is fetched now: a step of the order being followed, or recorded; or a departure from it."""
        trace = self.trace
        if self.window.phase == "backward":
            self._follow_backward(rec)
            return
        if trace.recording:
            trace.note(rec.index)
            return
        order = trace.order
        if not order:  # departed in this forward: the next one records
            return
        if self._forward_pos < len(order) and order[self._forward_pos] == rec.index:
            self._forward_pos += 1
            return
        if self._in_use(rec):
            return
        self.counters["trace_invalidations"] += 1
        trace.record_again()

    def _follow_backward(self, rec: ParamRecord) -> None:
        trace = self._backward
        if trace.recording:
            trace.order.append(rec.index)
            return
        if trace.pos < len(trace.order) and trace.order[trace.pos] == rec.index:
            trace.pos += 1
            return
        if self._in_use(rec):
            return
        self.counters["trace_invalidations"] += 1  # the order changed: stay correct, record it again
        trace.order, trace.recording, trace.pos = [rec.index], True, 0

    @staticmethod
    def _in_use(rec: ParamRecord) -> bool:
        """Already in use (a module entered again, a tied weight): not a step of the order."""
        return rec.state is ParamState.AVAILABLE and rec.users > 0

    def prefetch(self) -> None:
        """Starts the fetches of the next parameters in the order being followed, within the window and bucket."""
        window = self.window
        if window.phase == "backward":
            if self._backward.recording:
                return
            order, pos = self._backward.order, self._backward.pos
        else:
            if self.trace.recording:
                return
            order, pos = self.trace.order, self._forward_pos
        homes = window.homes
        in_flight = window.in_flight_numel
        for idx in order[pos:]:
            rec = window.params[idx]
            if rec.state is not ParamState.RELEASED:
                continue
            if in_flight and in_flight + rec.numel > self.bucket:
                break
            if homes.staged(rec) and not homes.arena.fits(rec.numel):  # type: ignore[union-attr]
                break  # no staging room until earlier reads are copied on: evict nothing for it
            # forward may evict (the oldest are needed last, in backward); in backward every evictable parameter
            # is left from forward and needed before anything further along the trace: only freed room is used
            room = window.evict(rec.numel) if window.phase == "forward" else \
                window.live_numel + rec.numel <= window.max_live
            if not room:
                break
            try:
                if not window.start(rec, wait_for_room=False):
                    break
            except BudgetExceeded:
                break
            in_flight += rec.numel
