"""Landings: the protocol by which the optimizer thread writes a step's new values straight into device buffers.

With NVMe homes, the first parameters of the forward trace (as many as the first prefetch would start:
:meth:`Landings.head`) are the last whose gradients backward finishes, and the optimizer updates them last. Instead
of writing them to NVMe and reading them straight back for the next forward, a parameter among them keeps its device
buffer when its gradient is done (LANDING, still counted in the window) and the optimizer thread, as it writes each
updated part home, also copies it into that buffer (:meth:`Landings.land_part`; a host-to-device copy with CUDA).
Once the update is done, those whose every part landed become AVAILABLE (:meth:`Landings.take`); any other leaves
the window, as does a landing that a fetch needs the room of, or that no update completed (a skipped step):
:meth:`Landings.drop`. The next forward then starts without waiting for the disk.

This object owns what the training thread and the optimizer thread share: the parts each landing parameter still
waits for and the copies made into it, under one lock. The device window moves the records' states.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..memory import DONE, CopyStreams
from ._record import ParamRecord


@dataclass(eq=False)
class _Landing:
    """The parts of a LANDING parameter the optimizer has yet to copy in, and the copies it made (CUDA)."""

    left: set[int]  # starts of the parts not landed yet
    copies: list[Any] = field(default_factory=list)


class Landings:
    """Which parameters land in the coming update (``chosen``, see the module docstring), and the landings open.
    ``enabled``: updates are written by the optimizer thread during the step that follows each backward (not
    delayed), so the next forward's first parameters may land."""

    def __init__(self, copies: CopyStreams, *, enabled: bool) -> None:
        self.copies, self.enabled = copies, enabled
        self.chosen: set[int] = set()  # chosen at the start of a backward an update follows
        self._open: dict[int, _Landing] = {}  # shared with the optimizer thread, under _lock
        self._lock = threading.Lock()

    @staticmethod
    def head(order: list[int], params: list[ParamRecord], limit: int) -> set[int]:
        """The parameters the first prefetch after an update would start (the head of the forward ``order``,
        within ``limit`` elements) whose homes are NVMe keys of parameter offload's own."""
        total, chosen = 0, set()
        for idx in dict.fromkeys(order):
            rec = params[idx]
            if rec.persistent:
                continue
            if total and total + rec.numel > limit:
                break
            total += rec.numel
            if rec.home is None and not rec.sharded:
                chosen.add(idx)
        return chosen

    def open(self, rec: ParamRecord) -> None:
        """``rec`` is LANDING: the optimizer copies each of its parts in as it writes it home."""
        with self._lock:
            self._open[rec.index] = _Landing({start for start, _ in rec.parts})

    def land_part(self, rec: ParamRecord, start: int, value: torch.Tensor) -> Any:
        """On the optimizer thread: the part at ``start`` of ``rec``'s new value, if ``rec`` waits for it, is
        copied into its device buffer; returns that copy (None: not landing, or nothing to wait for). Held under
        the lock while copying: a drop on the training thread waits for this copy."""
        with self._lock:
            land = self._open.get(rec.index)
            if land is None or start not in land.left:
                return None
            copy = self.copies.to_device(rec.device[start : start + value.numel()], value, after=rec.after)
            land.left.discard(start)
            if copy is DONE:
                return None
            land.copies.append(copy)
            return copy

    def take(self, rec: ParamRecord) -> list[Any] | None:
        """``rec``'s landing, done: the copies its new value came by, if every part landed (else None, and it
        stays open for :meth:`drop`)."""
        with self._lock:
            land = self._open.get(rec.index)
            if land is None or land.left:
                return None
            del self._open[rec.index]
        return land.copies

    def drop(self, rec: ParamRecord) -> None:
        """``rec`` lands no more: the optimizer copies nothing more in, and the copies it made have run."""
        with self._lock:
            land = self._open.pop(rec.index, None)
        for copy in land.copies if land is not None else ():
            copy.wait()
