"""Homes: where each offloaded parameter's value lives while it is off the device, and the reads and writes of it.

A parameter's home is one of:

* a HOST view: of the flat host buffer the optimizer writes new parameters into (trainable ones), or of a private
  host copy this object keeps (frozen ones; persistent ones with NVMe homes);
* NVMe keys in one :class:`~offload.memory.NvmeSpace` (the parameters' own swap file, claimed on the store's NVME
  account): one key per part, a part being one of the optimizer's sub-group segments of the parameter (so an update
  rewrites its own keys) or, for a frozen one, a range of at most the scratch buffer's size;
* stage 3 on several ranks: this rank's piece, held by :class:`~._shards.ParamShards` (a read all-gathers).

It owns the NVMe space (and its pinned staging arena, which NVMe reads land in on CUDA before the fetch thread
copies them on), the private host copies, and the fetch thread (a staged read's copy, and on the CPU a host home's
memcpy, run there beside compute). ``close()`` frees them all; :meth:`drain` first lets the fetches in flight end.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nvme_swapper import AioConfig, aligned_tensor, swap_file_bytes

from .._cleanup import close_after_failure, run_all
from .._worker import bind_thread
from ..memory import DONE, AllOf, Copy, CopyStreams, NvmeSpace, StagingArena, Tier, TieredStore
from ._record import ParamRecord


class Homes:
    """The homes of ``params`` (see the module docstring). ``shards``: a :class:`ParamShards` (several ranks),
    the home of the parameters it covers. ``parts``: per parameter, the (start, numel) ranges its NVMe home is kept
    in (the optimizer's sub-group segments); parameters without (frozen ones) are cut in ranges of at most
    ``scratch``'s size. ``staging``: elements of the pinned arena NVMe reads land in (0: none, they are read straight
    into the device buffer). ``written_together``: the (parameter, part start) keys one update writes at once, at
    most ``writes`` updates at a time: the swap file's spare room for their rewrites."""

    def __init__(self, params: list[torch.nn.Parameter], store: TieredStore, copies: CopyStreams,
                 dtype: torch.dtype, device: torch.device, *, persistence_threshold: int, nvme_path: str | None,
                 aio: AioConfig | None, shards: Any, scratch: torch.Tensor | None,
                 parts: list[list[tuple[int, int]]] | None, staging: int,
                 written_together: list[list[tuple[int, int]]] | None, writes: int) -> None:
        self.store, self.copies, self.dtype, self.shards = store, copies, dtype, shards
        self.space: NvmeSpace | None = None
        self._writes: dict[int, int] = {}  # parameter -> its part writes in flight at once (else 1)
        self._private: list[torch.Tensor] = []  # host copies this object allocated (and frees at close)
        self._homed: list[int] = []  # the parameters with NVMe keys of this object's own
        self.parts: list[list[tuple[int, int]]] = []
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-fetch",
                                                             initializer=bind_thread, initargs=(device,))
        try:
            self._claim(params, persistence_threshold=persistence_threshold, nvme_path=nvme_path, aio=aio,
                        scratch=scratch, parts=parts or [], staging=staging, written_together=written_together or [],
                        writes=writes)
        except BaseException as exc:
            close_after_failure(self.close, exc)
            raise

    def _claim(self, params: list[torch.nn.Parameter], *, persistence_threshold: int, nvme_path: str | None,
               aio: AioConfig | None, scratch: torch.Tensor | None, parts: list[list[tuple[int, int]]],
               staging: int, written_together: list[list[tuple[int, int]]], writes: int) -> None:
        """Each parameter's parts, and the NVMe space its homes need (claimed and reserved whole now)."""
        # NVMe keys of this object's own: the pieces of sharded parameters (frozen ones too) are ParamShards'
        self._homed = [i for i, p in enumerate(params) if p.numel() > persistence_threshold and not self.sharded(i)]
        chunk = scratch.numel() if scratch is not None else max((p.numel() for p in params), default=1)
        self.parts = [parts[i] if i < len(parts) and parts[i] else
                      [(s, min(chunk, p.numel() - s)) for s in range(0, p.numel(), max(chunk, 1))]
                      for i, p in enumerate(params)]
        if nvme_path is None or not (self._homed or self.shards is None):
            return
        size = torch.empty((), dtype=self.dtype).element_size()
        # every part's key (its page-rounded extent, and the file's header page), plus the spare extents its
        # rewrites go to beside the bytes they replace: those of the updates in flight at once, and one at a time
        # for the rest (frozen parts: loads)
        parts_of = {(i, s): n * size for i in self._homed for s, n in self.parts[i]}
        groups = [[parts_of.pop(key) for key in group if key in parts_of] for group in written_together]
        self._writes = {i: writes for group in written_together for i, _ in group}
        self.space = NvmeSpace(self.store, nvme_path, swap_file_bytes(groups, writes, parts_of.values()),
                               f"parameters homed on {nvme_path}", f"free disk space at {nvme_path}", aio=aio)
        if staging:
            self.space.open_staging(staging, self.dtype, "the pinned staging of parameters read from NVMe",
                                    "raise offload.host_memory_budget or lower "
                                    "zero_optimization.stage3_prefetch_bucket_size")

    @property
    def arena(self) -> StagingArena | None:
        """The pinned memory NVMe reads land in before their copy to the device (CUDA), if any."""
        return self.space.arena if self.space is not None else None

    def sharded(self, i: int) -> bool:
        return self.shards is not None and self.shards.covers(i)

    def staged(self, rec: ParamRecord) -> bool:
        """Whether a fetch of ``rec`` reads its NVMe home into the staging arena first."""
        return self.space is not None and self.space.arena is not None and rec.home is None and not rec.sharded

    @staticmethod
    def key(rec: ParamRecord, start: int) -> str:
        return f"param/{rec.index}/{start}"

    def build(self, params: list[torch.nn.Parameter], homes: list[torch.Tensor | None], persistence_threshold: int,
              scratch: torch.Tensor | None, before_home: Callable[[int], None] | None) -> Iterator[ParamRecord]:
        """Yields each parameter's record once its home holds its value: NVMe homes are written through one host
        buffer (freed after), frozen and persistent ones without a host home get a private copy (one block, taken
        before anything moves, so a host budget it does not fit fails with the model as it was).
        ``before_home(i)``: called before parameter ``i`` is read for its home."""
        writing = owned = None
        if self.space is not None:
            largest = max((n for i in self._homed for _, n in self.parts[i]), default=0)
            if scratch is not None and scratch.numel() >= largest and scratch.dtype == self.dtype:
                writing = scratch
            else:
                writing = owned = self.store.allocate(Tier.HOST, largest, self.dtype, "the buffer parameters are "
                                                      "written to NVMe through at initialize",
                                                      "raise offload.host_memory_budget")
        private = [i for i, (p, home) in enumerate(zip(params, homes)) if home is None and not self.sharded(i)
                   and (self.space is None or p.numel() <= persistence_threshold)]
        copies: dict[int, torch.Tensor] = {}
        try:
            if private:
                sizes = [params[i].numel() for i in private]
                block = self.store.allocate(Tier.HOST, sum(sizes), self.dtype, f"the host copies of {len(private)} "
                                            "frozen or persistent parameters", "raise offload.host_memory_budget")
                self._private.append(block)
                copies = dict(zip(private, block.split(sizes)))
            for i, (p, home) in enumerate(zip(params, homes)):
                if before_home is not None:
                    before_home(i)
                persistent = p.numel() <= persistence_threshold
                rec = ParamRecord(i, p, p.shape, p.numel(), home, persistent, parts=tuple(self.parts[i]),
                                  trains=p.requires_grad, sharded=self.sharded(i))
                if rec.sharded:
                    pass  # the engine filled this rank's piece; every rank starts from the same full values
                elif self.space is not None and not persistent:
                    flat = p.detach().reshape(-1)
                    for start, n in rec.parts:
                        assert writing is not None
                        writing[:n].copy_(flat[start : start + n])
                        self.space.write(self.key(rec, start), writing[:n]).wait()
                    rec.home = None
                elif home is None:  # frozen, or persistent with NVMe homes: its private host copy
                    rec.home = copies[i]
                    rec.home.copy_(p.detach().reshape(-1))
                yield rec
        finally:
            if owned is not None:
                self.store.free(Tier.HOST, owned)

    # reads ------------------------------------------------------------------------------------------------------

    def read_parts(self, rec: ParamRecord, dst: torch.Tensor) -> AllOf:
        """Starts reading every part of ``rec``'s NVMe home into its range of ``dst`` (flat, the parameter's
        size)."""
        assert self.space is not None
        return self.space.read_parts((self.key(rec, start), dst[start : start + n]) for start, n in rec.parts)

    def start_read(self, rec: ParamRecord, staging: torch.Tensor | None) -> Any:
        """Starts filling ``rec.device`` from the home (after ``rec.after``, a reused buffer's point); returns the
        fetch in flight (a Copy, a handle, a gather or a Future). ``staging``: its piece of the arena, which goes
        back to the arena once read and copied on (the caller gives it back if this raises)."""
        if rec.sharded:
            return self.shards.fetch(rec.index, rec.device)
        if staging is not None:  # read into pinned staging, copied on by the fetch thread
            reads = self.read_parts(rec, staging)
            try:
                return self._copier.submit(self._copy_staged, reads, staging, rec.device, rec.after)
            except BaseException:
                with contextlib.suppress(Exception):  # the staging goes back: no read may be left on it
                    reads.wait()
                raise
        if rec.home is None:  # the device tier is host memory: read straight into the buffer
            return self.read_parts(rec, rec.device)
        if self.copies.cuda:
            return self.copies.to_device(rec.device, rec.home, after=rec.after)
        return self._copier.submit(self.copies.to_device, rec.device, rec.home, after=None)  # beside compute

    def _copy_staged(self, handle: Any, staging: torch.Tensor, dst: torch.Tensor, after: Any) -> Copy:
        """On the fetch thread: once an NVMe read has landed in ``staging``, copy it to the device buffer. Neither
        this thread nor the one that waits for the fetch waits for the copy: the compute stream does (``use``),
        and the arena before it lends the staging again."""
        copy = None
        try:
            handle.wait()
            copy = self.copies.to_device(dst, staging, after=after, src_tier=Tier.HOST)
            return copy
        finally:
            self.arena.give(staging, busy=copy)  # type: ignore[union-attr]

    def refresh(self, rec: ParamRecord) -> None:
        """A persistent parameter after an optimizer step: its device buffer gets the home's new value."""
        if rec.sharded:
            self.shards.fetch(rec.index, rec.device).wait()  # gathered straight into the device buffer
        elif rec.home is not None:
            self.copies.use(self.copies.to_device(rec.device, rec.home, after=self.copies.mark()), rec.device)

    def read(self, rec: ParamRecord) -> torch.Tensor:
        """``rec``'s current value from its home, as a new host tensor in its shape."""
        if rec.sharded:
            return self.shards.read(rec.index)
        if rec.home is not None:
            return rec.home.view(rec.shape).clone()
        staged = aligned_tensor(rec.numel, self.dtype, pin_memory=False)
        self.read_parts(rec, staged).wait()
        return staged.view(rec.shape)

    # writes -----------------------------------------------------------------------------------------------------

    def write(self, rec: ParamRecord, value: torch.Tensor) -> None:
        """Stores ``value`` (a host tensor) as ``rec``'s home holds it, whole, and returns once it is there."""
        if rec.sharded:
            self.shards.write(rec.index, value)
        elif rec.home is not None:
            rec.home.copy_(value.reshape(-1))
        else:
            assert self.space is not None
            flat = value.reshape(-1)
            self.space.write_window(((self.key(rec, start), flat[start : start + n]) for start, n in rec.parts),
                                    self._writes.get(rec.index, 1))  # the rewrites the claim has room for

    def write_part(self, rec: ParamRecord, start: int, value: torch.Tensor) -> Any:
        """Starts storing elements ``start``.. of ``rec``'s new value: one part of an NVMe home, or a range of a host
        copy (then ``rec`` is stale on the device). Returns the write's handle."""
        if rec.home is not None:  # persistent: a host copy, uploaded at the next refresh
            rec.home[start : start + value.numel()].copy_(value)
            rec.stale = True
            return DONE
        assert self.space is not None and (start, value.numel()) in rec.parts
        return self.space.write(self.key(rec, start), value)

    # lifetime ---------------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any] | None:
        """The NVMe homes' swap engine counters (bytes read and written, ...); None when they live on the host."""
        return self.space.stats() if self.space is not None else None

    def drain(self) -> None:
        """Lets the fetch thread's work in flight end (the copies it starts land before homes are freed)."""
        self._copier.shutdown(wait=True)

    def close(self) -> None:
        """The fetch thread, the NVMe space (its swap file, staging and claim) and the private host copies."""
        run_all([self.drain, self._close_space, self._free_private])

    def _close_space(self) -> None:
        if self.space is not None:
            self.space.close()  # cut short, it stays set: the next close finishes it
            self.space = None

    def _free_private(self) -> None:
        for t in self._private:
            self.store.free(Tier.HOST, t)
        self._private = []
