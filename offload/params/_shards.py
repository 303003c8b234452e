"""ParamShards: where stage 3 on several ranks keeps each parameter, this rank's piece of it, and how a fetch gathers
the pieces back.

Each parameter is cut into N equal pieces (the :class:`~offload.optim._layout.FlatLayout` built per parameter);
rank r's home holds piece r of every parameter: a view of its partitioned host buffer that the optimizer updates in
place, or keys in the rank's own :class:`~offload.memory.NvmeSpace` that the optimizer thread rewrites after each
sub-group (through :class:`~._sinks.PieceSink`). A fetch (NVMe: after reading the piece) all-gathers the pieces
asynchronously, so the parameter-offload prefetch overlaps it; gradients are reduce-scattered back to the owners by
:class:`~offload.dist.GradPartition`. It sits with the rest of where a parameter lives (``offload.params``); the
collectives it issues are :class:`~offload.dist.Comm`'s.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from nvme_swapper import AioConfig, SwapHandle

from ..dist import Comm
from ..dist._zero import piece_nvme_bytes
from ..memory import DONE, AllOf, Copy, CopyStreams, NvmeSpace, StagingArena, TieredStore, wait_all
from ..optim._layout import FlatLayout, SubGroup


class GatherRefused(RuntimeError):
    """Raised on every rank when some rank had no device memory to gather a whole parameter for a read (a
    checkpoint's frozen parameters, an export): all raise at the same read, none waits in a gather the others
    never start."""


class _Gathered:
    """An all-gather of a parameter's pieces in flight; ``wait()`` lands it in the parameter's device buffer."""

    def __init__(self, work: object, out: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.out, self.dst = work, out, dst

    def wait(self) -> None:
        self.work.wait()  # type: ignore[attr-defined]
        self.dst.view(-1).copy_(self.out[: self.dst.numel()])


class _PieceRead:
    """Stage 3, NVMe pieces: a fetch whose reads are in flight and whose all-gather is not issued yet."""

    def __init__(self, shards: "ParamShards", index: int, out: torch.Tensor, inp: torch.Tensor, dst: torch.Tensor,
                 staging: torch.Tensor, reads: list[SwapHandle]) -> None:
        self.shards, self.index, self.out, self.inp, self.dst = shards, index, out, inp, dst
        self.staging, self.reads = staging, reads
        self.gathered: _Gathered | None = None
        self.error: BaseException | None = None  # its reads failed: no all-gather was issued

    def wait(self) -> None:
        while self.gathered is None and self.error is None:  # the gathers before it first, in order; later reads
            self.shards.issue_next()  # keep running
        if self.error is not None:
            raise self.error
        self.gathered.wait()


class ParamShards:
    """Stage 3 on several ranks: this rank's piece of every parameter, kept in one of two places. Parameters are
    numbered as the engine's parameter offload numbers them: the trainable ones (``layout``), then the frozen ones
    (``frozen``, a per-parameter layout of their own that no optimizer walks): a frozen base is partitioned like the
    rest, so each rank holds 1/N of it and reads 1/N of it per fetch, instead of all of it.

    * HOST (``flats``, and ``frozen_flat``): one low-precision buffer per group covering only the owned range, which
      the optimizer updates in place (the frozen one never changes).
    * NVMe (``nvme_path``, this rank's own directory, an :class:`~offload.memory.NvmeSpace`): one swap key per
      part of a piece that lies in one optimizer sub-group (frozen: one sub-group of ``frozen``), so a sub-group's
      update writes its parts straight from the optimizer's staging buffer (no read-modify-write of pieces cut by
      sub-group boundaries). Host RAM holds a staging piece per fetch in flight, lent by the space's
      :class:`~offload.memory.StagingArena` of fixed size (so whether a fetch starts never depends on this rank's
      host budget: the ranks' collectives stay the same); the keys are counted on this rank's NVME tier. A fetch
      starts reading the piece and returns; its all-gather is issued once the read is done, in fetch order (the
      same on every rank), at the latest before any other collective (see :meth:`fetch`), so the reads overlap
      compute.
    """

    def __init__(self, comm: Comm, layout: FlatLayout, copies: CopyStreams, *, frozen: FlatLayout | None = None,
                 flats: list[torch.Tensor] | None = None, frozen_flat: torch.Tensor | None = None,
                 store: TieredStore | None = None, dtype: torch.dtype | None = None, nvme_path: str | None = None,
                 aio: AioConfig | None = None, staging_cap: int = 0, writes: int = 1) -> None:
        """``staging_cap``: elements of the staging arena (NVMe), at least the largest piece: the pieces of a
        window of fetches in flight; a fetch that finds it full first issues the oldest queued all-gathers.
        ``writes``: the sub-group updates whose parts are written at once (the swap file's spare room)."""
        assert layout.per_param and (flats is None) != (nvme_path is None)
        assert frozen is None or (frozen.per_param and (flats is None or frozen_flat is not None))
        self.comm, self.layout, self.copies = comm, layout, copies
        self.device = copies.device
        # every parameter, trainable then frozen: its layout and its index there
        self._at = [(lay, j) for lay in (layout, frozen) if lay is not None for j in range(len(lay.params))]
        self.params = [lay.params[j] for lay, j in self._at]
        self.piece = [lay.piece[j] for lay, j in self._at]
        self.pieces: list[torch.Tensor] = []
        self._space: NvmeSpace | None = None  # NVMe: this rank's pieces, and the staging their reads land in
        self._queue: list[_PieceRead] = []  # NVMe fetches whose all-gather waits for their reads, in fetch order
        self._issuing = False  # an all-gather of the queue is being started
        # NVMe fetches, those whose read had finished when their all-gather was due, and the seconds waited for reads
        self.read_stats: dict[str, float] = {"fetches": 0, "read_before_needed": 0, "wait_seconds": 0.0}
        self._arena: StagingArena | None = None  # NVMe: the space's staging pieces
        if flats is not None:
            self.dtype = flats[0].dtype
            for lay, j in self._at:
                flat = flats[lay.param_group[j]] if lay is layout else frozen_flat
                self.pieces.append(flat[lay.param_offset[j] : lay.param_offset[j] + lay.piece[j]])
            return
        assert store is not None and dtype is not None
        self.dtype = dtype
        r = comm.rank
        # (start in this rank's piece, element count) of each key, in piece order: they cover the piece's real
        # elements; the rest of the piece is padding (zeros)
        self._parts: list[list[tuple[int, int]]] = [[] for _ in self._at]
        for lay, first in ((layout, 0), (frozen, len(layout.params))):
            for sg in lay.sub_groups if lay is not None else ():
                for seg in sg.segments:
                    self._parts[first + seg.param].append((seg.param_start - r * lay.piece[seg.param], seg.numel))
        size = torch.empty((), dtype=dtype).element_size()
        root = Path(nvme_path)  # type: ignore[arg-type]
        self._writes = [writes] * len(layout.params) + [1] * (len(self._at) - len(layout.params))
        # each length's rewrites land in the room claimed for them (nvme_swapper)
        self._space = NvmeSpace(store, root, piece_nvme_bytes(layout, frozen, size, writes),
                                f"this rank's pieces of the parameters on {root}",
                                f"free disk space at {root} or raise offload.nvme_memory_budget", aio=aio)
        try:
            self._arena = self._space.open_staging(staging_cap, dtype, "the staging pieces of parameters read from "
                                                   "NVMe", "raise offload.host_memory_budget or lower "
                                                   "zero_optimization.stage3_prefetch_bucket_size")
        except BaseException:
            self.close()
            raise
        comm.before_collective = self.issue_all

    def covers(self, i: int) -> bool:
        return i < len(self.params)

    @staticmethod
    def _key(i: int, start: int) -> str:
        return f"piece/{i}/{start}"

    def write(self, i: int, value: torch.Tensor) -> None:
        """Keeps this rank's piece of a full new value of parameter ``i`` (no communication)."""
        r, piece = self.comm.rank, self.piece[i]
        flat = value.reshape(-1)
        mine = flat[r * piece : (r + 1) * piece]
        if mine.device.type != "cpu":
            mine = self.copies.download(mine)
        if self._space is None:
            self.pieces[i][: mine.numel()].copy_(mine)
            return
        staged = mine.to(self.dtype).contiguous()
        self._space.write_window(((self._key(i, start), staged[start : start + n]) for start, n in self._parts[i]),
                                 self._writes[i])  # no more parts in flight than the claim has room for

    def write_updated(self, sg: SubGroup, values: torch.Tensor) -> AllOf:
        """On the optimizer thread, after sub-group ``sg``'s update (``values``: its new low-precision range): starts
        writing its parts of this rank's pieces to their NVMe keys; the handle completes them (the optimizer reuses
        ``values`` only after)."""
        assert self._space is not None
        r, piece = self.comm.rank, self.layout.piece
        return self._space.write_parts(
            (self._key(seg.param, seg.param_start - r * piece[seg.param]),
             values[seg.flat_start - sg.start : seg.flat_start - sg.start + seg.numel]) for seg in sg.segments)

    def _wait_reads(self, handles: list[SwapHandle]) -> None:
        """Waits for a piece's reads (all of them, even after a failure, so no I/O is left on reused memory)."""
        wait_all(handles)

    def fetch(self, i: int, dst: torch.Tensor) -> Any:
        """Starts gathering parameter ``i`` into ``dst`` (its device buffer); returns a handle to ``wait()`` on.
        Host pieces: the all-gather starts now. NVMe pieces: the reads of this rank's piece start now, into a
        staging piece of their own, and the all-gather is issued once they are done, in fetch order, at the
        latest when this or a later fetch is waited on or any other collective starts (``Comm.before_collective``):
        so the reads overlap the compute before the parameter is needed, and every rank issues the gathers in the
        order it fetched, which is the same everywhere."""
        piece, r = self.piece[i], self.comm.rank
        out = self._out_buffer(i)
        inp = out[r * piece : (r + 1) * piece]  # the all-gather takes this rank's chunk of out in place
        if self._space is None:
            return self._gather(i, out, inp, self.pieces[i], dst)[0]
        self.issue_ready()
        assert self._arena is not None
        staging = self._arena.take(piece)
        while staging is None:  # full: the oldest fetches' all-gathers start (in fetch order), giving pieces back
            if not self._queue:  # every piece is back, some still read by their copies to the device
                staging = self._arena.take(piece, block=True)
                break
            self.issue_next()
            staging = self._arena.take(piece)
        reads = self._start_reads(i, staging)
        pending = _PieceRead(self, i, out, inp, dst, staging, reads)
        self._queue.append(pending)
        return pending

    def _start_reads(self, i: int, staging: torch.Tensor) -> list[SwapHandle]:
        """Starts reading this rank's piece of parameter ``i`` into ``staging`` (a piece lent by the arena, given
        back if a read fails to start) and zeroes its padding; returns the reads' handles."""
        assert self._space is not None and self._arena is not None
        try:
            reads = self._space.read_parts((self._key(i, start), staging[start : start + n])
                                           for start, n in self._parts[i])
        except BaseException:
            self._arena.give(staging)  # no read left on it
            raise
        staging[sum(n for _, n in self._parts[i]) :].zero_()
        return reads.handles

    def _gather(self, i: int, out: torch.Tensor, inp: torch.Tensor, source: torch.Tensor,
                dst: torch.Tensor) -> tuple[_Gathered, Copy]:
        """Starts the all-gather of parameter ``i``'s piece from ``source`` (host); returns it and the copy still
        reading ``source``."""
        copy = DONE
        if self.device.type == "cpu":
            inp.copy_(source)
        else:
            copy = self.copies.to_device(inp, source, after=None)
        try:
            self.copies.use(copy, out)  # the collective, issued behind the current stream, sees it
            return _Gathered(self.comm.all_gather(out, inp, async_op=True, key=i), out, dst), copy
        except BaseException:
            copy.wait()  # ``source`` may be lent again once this raises
            raise

    def _issue(self, pending: "_PieceRead") -> None:
        """The oldest queued fetch: waits for its reads, then starts its all-gather (during which the
        ``before_collective`` hook must not issue the ones queued after it)."""
        assert self._queue and self._queue[0] is pending and not self._issuing
        self._queue.pop(0)
        self._issuing = True
        copy = None
        try:
            self.read_stats["fetches"] += 1
            if all(h.done() for h in pending.reads):
                self.read_stats["read_before_needed"] += 1
            t = time.perf_counter()
            self._wait_reads(pending.reads)
            self.read_stats["wait_seconds"] += time.perf_counter() - t
            pending.gathered, copy = self._gather(pending.index, pending.out, pending.inp,
                                                  pending.staging[: pending.inp.numel()], pending.dst)
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            self._issuing = False
            assert self._arena is not None
            self._arena.give(pending.staging, busy=copy)  # refilled by a later fetch once the copy has read it

    def issue_ready(self) -> None:
        """Starts the all-gathers of the oldest queued fetches whose reads are done (never blocks on a read)."""
        while self._queue and all(h.done() for h in self._queue[0].reads):
            self._issue(self._queue[0])

    def issue_next(self) -> None:
        """Starts the oldest queued all-gather, waiting for its reads."""
        self._issue(self._queue[0])

    def issue_all(self) -> None:
        """Starts every queued all-gather, in fetch order, waiting for reads as needed (before another collective,
        and when a fetch is waited on); nothing while one of them is being issued."""
        while self._queue and not self._issuing:
            self.issue_next()

    def read(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full value as a new host tensor in its shape (a collective). Its device buffers lie
        outside the budget (a read is not a step's), and an NVMe piece is read before its gather starts: the ranks
        first agree that each could allocate the buffers and read its piece, so either failure raises on every
        rank at the same read and none waits in a gather the others never start."""
        p, r, piece = self.params[i], self.comm.rank, self.piece[i]
        self.issue_all()  # fetches queued before this read (prefetches) gather first, on every rank alike
        error: Exception | None = None
        allocated = False  # the error, if any, is the piece's read (else the allocator's)
        staging: torch.Tensor | None = None
        copy: Copy = DONE
        try:
            try:
                dst, out = self._read_buffers(i)
                allocated = True
                if self._space is not None:
                    assert self._arena is not None
                    taken = self._arena.take(piece, block=True)  # no fetch queued: every piece comes back
                    reads = self._start_reads(i, taken)  # (given back if they fail to start)
                    staging = taken
                    self._wait_reads(reads)
            except Exception as exc:  # noqa: BLE001 - before any collective: raised below, once every rank knows
                error = exc  # (a CPU device's allocator raises a plain RuntimeError)
            failed = self.comm.vote(f"read of parameter {i}", error)
            if failed:
                shape = tuple(p.shape)
                if error is None:
                    raise GatherRefused(f"rank {r}: {failed} other rank(s) could not gather parameter {i} of shape "
                                        f"{shape} for a read (out of device memory, or a failed read of their "
                                        "piece: see their errors)")
                if allocated:
                    raise error
                raise GatherRefused(
                    f"rank {r}: out of device memory ({error}) for the "
                    f"{2 * p.numel() * self.dtype.itemsize / 2**20:.1f} MiB that gathering parameter {i} of shape "
                    f"{shape} for a read takes; free device memory (torch.cuda.empty_cache(), a smaller batch "
                    "before the save) and retry") from error
            gathered, copy = self._gather(i, out, out[r * piece : (r + 1) * piece],
                                          self.pieces[i] if staging is None else staging[:piece], dst)
            gathered.wait()
        finally:  # the piece comes back however the read ended (a vote that raised, an interrupt included)
            if staging is not None:
                assert self._arena is not None
                self._arena.give(staging, busy=copy)
        return self.copies.download(dst).view(p.shape)

    def _read_buffers(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A read's device buffers: the parameter whole, and the all-gather's output."""
        return torch.empty(self.params[i].numel(), dtype=self.dtype, device=self.device), self._out_buffer(i)

    def _out_buffer(self, i: int) -> torch.Tensor:
        """The all-gather's output for parameter ``i``: every rank's piece."""
        with self.copies.copy_stream():  # memory no kernel of the compute stream may still be using: the copy
            return torch.empty(self.piece[i] * self.comm.world_size, dtype=self.dtype, device=self.device)

    def swap_stats(self) -> dict[str, Any] | None:
        """The NVMe pieces' swap engine (bytes read and written, ...) and ``read_stats``; None for host pieces."""
        stats = self._space.stats() if self._space is not None else None
        return {**stats, **self.read_stats} if stats is not None else None

    def close(self) -> None:
        """Drops fetches never gathered (their reads waited for, no collective: peers may be gone), removes the
        NVMe pieces' swap file and returns their bytes and the staging pieces to the tiers."""
        if self.comm.before_collective == self.issue_all:
            self.comm.before_collective = None
        for pending in self._queue:
            with contextlib.suppress(Exception):  # closing: a read's error no longer matters
                wait_all(pending.reads)
        self._queue = []
        if self._space is not None:
            self._space.close()  # its swap file, its staging and its claim
            self._space = None
            self._arena = None


