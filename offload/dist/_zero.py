"""ZeRO partitioning of gradients and parameters across ranks, for the engine.

The :class:`~offload.optim._layout.FlatLayout` built with world size N gives each rank an equal contiguous range of
every param group's flat buffer; the rank's optimizer state (and host gradient buffer) covers that range only.
:class:`GradPartition` gets every rank's gradients summed into its owner's host buffer and the updated parameters
back to everyone:

* world size 1: the engine's hooks write gradients straight into the host buffer (the owned range is everything)
  and nothing is communicated. Same code, no copies.
* stages 1-2 (and 0): gradients are summed onto their owners in buckets while backward runs
  (:class:`~._buckets.ReduceBuckets`), and micro-batches accumulate in the owner's host buffer (Psi per
  micro-batch); no rank holds a full-size gradient.
* after the optimizer step, every rank's updated range of the device parameters is all-gathered (Psi).
* stage 3 (the layout's ``per_param``): each parameter is cut into N equal pieces; rank r's home holds piece r of
  every parameter (:class:`ParamShards`: a view of its partitioned host buffer that the optimizer updates in
  place, or keys in the rank's NVMe folder that the optimizer thread rewrites after each sub-group). A fetch
  (NVMe: after reading the piece) all-gathers the pieces (asynchronously, so the parameter-offload prefetch
  overlaps it), and each gradient is reduce-scattered in its hook straight into the owner's host buffer: Psi in
  forward, Psi again in backward for what the window did not keep, Psi of gradients.

Gradients are summed, not averaged: the engine divides by N in the CPU Adam kernel's gradient divisor (with the
loss scale and the clipping coefficient), and all-reduces the squared norm for clipping and fp16 overflow checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nvme_swapper import AioConfig, SwapEngine, SwapHandle

from ..memory import CopyStreams, Tier, TieredStore, wait_all
from ..optim._layout import FlatLayout, SubGroup
from ._comm import Comm


class _Gathered:
    """An all-gather of a parameter's pieces in flight; ``wait()`` lands it in the parameter's device buffer."""

    def __init__(self, work: object, out: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.out, self.dst = work, out, dst

    def wait(self) -> None:
        self.work.wait()  # type: ignore[attr-defined]
        self.dst.view(-1).copy_(self.out[: self.dst.numel()])


class ParamShards:
    """Stage 3 on several ranks: this rank's piece of every trainable parameter, kept in one of two places.

    * HOST (``flats``): one low-precision buffer per group covering only the owned range, which the optimizer
      updates in place.
    * NVMe (``nvme_path``, this rank's own directory): one swap key per part of a piece that lies in one optimizer
      sub-group, so a sub-group's update writes its parts straight from the optimizer's staging buffer (no
      read-modify-write of pieces cut by sub-group boundaries). Host RAM holds one staging piece (the largest),
      counted on the HOST tier; the keys are counted on this rank's NVME tier. A fetch reads the piece
      synchronously on the calling thread, then starts the all-gather, so collectives keep the fetch order that is
      the same on every rank.
    """

    def __init__(self, comm: Comm, layout: FlatLayout, copies: CopyStreams, *,
                 flats: list[torch.Tensor] | None = None, store: TieredStore | None = None,
                 dtype: torch.dtype | None = None, nvme_path: str | None = None,
                 aio: AioConfig | None = None) -> None:
        assert layout.per_param and (flats is None) != (nvme_path is None)
        self.comm, self.layout, self.copies, self.store = comm, layout, copies, store
        self.device = copies.device
        self.pieces: list[torch.Tensor] = []
        self._swap: SwapEngine | None = None
        self._staging: torch.Tensor | None = None
        self._nvme_bytes = 0
        if flats is not None:
            self.dtype = flats[0].dtype
            for i in range(len(layout.params)):
                lo = layout.param_offset[i]
                self.pieces.append(flats[layout.param_group[i]][lo : lo + layout.piece[i]])
            return
        assert store is not None and dtype is not None
        self.dtype = dtype
        r = comm.rank
        # (start in this rank's piece, element count) of each key, in piece order: they cover the piece's real
        # elements; the rest of the piece is padding (zeros)
        self._parts: list[list[tuple[int, int]]] = [[] for _ in layout.params]
        for sg in layout.sub_groups:
            for seg in sg.segments:
                self._parts[seg.param].append((seg.param_start - r * layout.piece[seg.param], seg.numel))
        size = torch.empty((), dtype=dtype).element_size()
        held = [n for parts in self._parts for _, n in parts]
        root = Path(nvme_path)  # type: ignore[arg-type]
        # every key, plus one spare extent: a rewrite goes beside the bytes it replaces
        nvme_bytes = (sum(held) + max(held, default=0)) * size
        store.claim_nvme(root, nvme_bytes, f"this rank's pieces of the parameters on {root}",
                         f"free disk space at {root} or raise offload.nvme_memory_budget")
        self._nvme_bytes = nvme_bytes
        try:
            self._staging = store.allocate(Tier.HOST, max(layout.piece, default=0), dtype,
                                           "the staging piece of parameters read from NVMe",
                                           "raise offload.host_memory_budget")
            self._swap = SwapEngine(root, aio or AioConfig())
        except BaseException:
            self.close()
            raise

    def covers(self, i: int) -> bool:
        return i < len(self.layout.params)

    @staticmethod
    def _key(i: int, start: int) -> str:
        return f"piece/{i}/{start}"

    def write(self, i: int, value: torch.Tensor) -> None:
        """Keeps this rank's piece of a full new value of parameter ``i`` (no communication)."""
        r, piece = self.comm.rank, self.layout.piece[i]
        flat = value.reshape(-1)
        mine = flat[r * piece : (r + 1) * piece]
        if mine.device.type != "cpu":
            mine = self.copies.download(mine)
        if self._swap is None:
            self.pieces[i][: mine.numel()].copy_(mine)
            return
        staged = mine.to(self.dtype).contiguous()
        handles = [self._swap.write(self._key(i, start), staged[start : start + n]) for start, n in self._parts[i]]
        self._wait(handles, Tier.HOST, Tier.NVME)

    def write_updated(self, sg: SubGroup, values: torch.Tensor) -> None:
        """On the optimizer thread, after sub-group ``sg``'s update (``values``: its new low-precision range): its
        parts of this rank's pieces go to their NVMe keys before the optimizer reuses ``values``."""
        assert self._swap is not None
        r, piece = self.comm.rank, self.layout.piece
        handles: list[SwapHandle] = []
        for seg in sg.segments:
            lo = seg.flat_start - sg.start
            key = self._key(seg.param, seg.param_start - r * piece[seg.param])
            handles.append(self._swap.write(key, values[lo : lo + seg.numel]))
        self._wait(handles, Tier.HOST, Tier.NVME)

    def _wait(self, handles: list[SwapHandle], src: Tier, dst: Tier) -> None:
        """Waits for every handle (all of them, even after a failure, so no I/O is left on reused memory)."""
        assert self.store is not None
        wait_all(handles)
        self.store.count(src, dst, sum(h.nbytes for h in handles))

    def fetch(self, i: int, dst: torch.Tensor) -> _Gathered:
        """Starts gathering parameter ``i`` into ``dst`` (its device buffer)."""
        piece, r = self.layout.piece[i], self.comm.rank
        out = torch.empty(piece * self.comm.world_size, dtype=self.dtype, device=self.device)
        inp = out[r * piece : (r + 1) * piece]  # the all-gather takes this rank's chunk of out in place
        if self._swap is None:
            source = self.pieces[i]
        else:
            assert self._staging is not None
            source = self._staging[:piece]
            handles = [self._swap.read(self._key(i, start), source[start : start + n]) for start, n in self._parts[i]]
            filled = sum(n for _, n in self._parts[i])
            source[filled:].zero_()
            self._wait(handles, Tier.NVME, Tier.HOST)
        if self.device.type == "cpu":
            inp.copy_(source)
        else:
            copy = self.copies.to_device(inp, source, after=self.copies.mark())  # out's memory: the compute
            # stream's, which may have freed it moments ago
            self.copies.use(copy)  # the collective, issued behind the current stream, sees it
            if self._swap is not None:
                copy.wait()  # the staging piece is refilled by the next fetch
        return _Gathered(self.comm.all_gather(out, inp, async_op=True), out, dst)

    def read(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full value as a new host tensor in its shape (a collective)."""
        p = self.layout.params[i]
        dst = torch.empty(p.numel(), dtype=self.dtype, device=self.device)
        self.fetch(i, dst).wait()
        return self.copies.download(dst).view(p.shape)

    def swap_stats(self) -> dict[str, Any] | None:
        """The NVMe pieces' swap engine (bytes read and written, ...); None for host pieces."""
        return self._swap.stats() if self._swap is not None else None

    def close(self) -> None:
        """Removes the NVMe pieces' swap file and returns their bytes and the staging piece to the tiers."""
        if self._swap is not None:
            self._swap.close()
            self._swap = None
        if self._staging is not None:
            assert self.store is not None
            self.store.free(Tier.HOST, self._staging)
            self._staging = None
        if self._nvme_bytes:
            assert self.store is not None
            self.store.accounts[Tier.NVME].release(self._nvme_bytes)
            self._nvme_bytes = 0


class GradPartition:
    """The gradient and parameter collectives that are not bucketed: stage 3's reduce-scatter of each parameter's
    gradient, and the all-gather of updated parameters after a step (stages 1-2). Stages 1-2 reduce gradients
    in :class:`~._buckets.ReduceBuckets`."""

    def __init__(self, comm: Comm, layout: FlatLayout) -> None:
        self.comm, self.layout = comm, layout

    def reduce_param(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Stage 3: parameter ``i``'s gradient summed over ranks, this rank's piece of it (a new tensor)."""
        piece = self.layout.piece[i]
        padded = torch.zeros(piece * self.comm.world_size, dtype=grad.dtype, device=grad.device)
        padded[: grad.numel()].copy_(grad)
        out = torch.empty(piece, dtype=grad.dtype, device=grad.device)
        self.comm.reduce_scatter(out, padded)
        return out

    def gather_params(self, flats: list[torch.Tensor]) -> None:
        """Every rank's updated range of the flat parameters, to every rank (in place)."""
        if self.comm.world_size == 1:
            return
        for g, flat in enumerate(flats):
            lo, hi = self.layout.owned[g]
            self.comm.all_gather(flat, flat[lo:hi])
