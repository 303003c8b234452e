"""GradientStream: each gradient leaves the device as soon as autograd has finished it, without stalling backward.

The engine's post-accumulate-grad hook hands each trainable parameter's gradient (flattened; on several ranks, this
rank's part of it once summed over ranks: stage 3's piece after its reduce-scatter, or stages 1-2's owned range
out of a reduce bucket) to :meth:`GradientStream.receive`. This rank's range of each
flat buffer is cut into buckets of at most ``plan.grad_bucket`` elements that never cross an optimizer sub-group,
and each gradient into its pieces per bucket. Where a bucket's bytes go:

* staged (CUDA): the bucket gathers its pieces in a device buffer (copies on the compute stream, at device memory
  speed); the piece that completes it sends the whole bucket to the host in one asynchronous copy on the
  device-to-host stream (:class:`offload.memory.CopyStreams`), into the pinned host gradient buffer, or, when
  micro-batches accumulate, into a pinned landing buffer whose contents the optimizer thread then adds into the
  fp32 accumulator. The device buffer is reused once that copy has run (a wait on the GPU); the parameter's own
  ``.grad`` is freed at once. When every device buffer is taken by an open bucket, pieces go one by one instead;
* direct (CPU, where the device tier is host memory, and an optimizer that stays on the device): pieces are written
  straight into the gradient buffer, copied or added.

Each bucket keeps the handles of this micro-batch's copies; the optimizer's update of a sub-group waits on those of
the buckets inside it (:meth:`handles`), so it reads only landed gradients and the compute stream never waits for a
copy. When the last bucket of a sub-group is sent, ``on_ready(sub_group)`` fires (the engine starts the update
during backward where the plan allows). A bucket still incomplete when backward ends (a parameter without a
gradient in this micro-batch) is sent with zeros for the missing pieces, so such parameters update with a zero
gradient (as DeepSpeed's do); later micro-batches of an accumulation window add into what the first wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._worker import Worker
from ..memory import BudgetExceeded, Copy, CopyStreams, StagingRing, Tier, TieredStore, wait_all
from ..optim._layout import FlatLayout
from ..plan import Plan

_FIX = "lower zero_optimization.reduce_bucket_size or raise offload.device_memory_budget"


@dataclass(frozen=True)
class _Piece:
    """``numel`` elements of a parameter's (flattened) gradient from ``param_start``, at ``flat_start``."""

    index: int  # position in its bucket's pieces
    param_start: int
    flat_start: int
    numel: int


@dataclass(eq=False)
class _Bucket:
    sub_group: int
    start: int  # flat range [start, end) of its group's buffer, inside this rank's range and one sub-group
    end: int
    pieces: list[_Piece] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)  # alignment padding, [lo, hi) from start: zeros
    arrived: list[bool] = field(default_factory=list)  # per piece, in this micro-batch
    pending: int = 0  # pieces still to come in this micro-batch
    written: bool = False  # sent in this accumulation window: later micro-batches add
    staging: torch.Tensor | None = None  # the device buffer while the bucket is open (staged mode)
    single: bool = False  # staged mode, no device buffer was free: this micro-batch's pieces go one by one
    handles: list[Any] = field(default_factory=list)  # this micro-batch's copies (or accumulate jobs)

    @property
    def numel(self) -> int:
        return self.end - self.start


class GradientStream:
    """Owns the buckets, the device staging buffers, the pinned landing buffers and the accumulation thread of one
    engine's gradients. ``dest(k)`` is where sub-group ``k``'s gradients go on the host (the optimizer's
    :class:`~offload.optim._grad_buffers.GradientBuffers`); ``on_ready(k)`` is called when they have all been
    sent."""

    def __init__(self, plan: Plan, layout: FlatLayout, store: TieredStore, copies: CopyStreams, *,
                 dest: Callable[[int], torch.Tensor], on_ready: Callable[[int], None]) -> None:
        self.layout, self.store, self.copies = layout, store, copies
        self._dest, self._on_ready = dest, on_ready
        self._adds: Worker | None = None
        self.accumulate = plan.accumulate
        self.staged = plan.grad_staging
        self._dtype = plan.dtype
        self.buckets: list[_Bucket] = []
        self._of_param: list[list[tuple[_Bucket, _Piece]]] = [[] for _ in layout.params]
        self._of_sub_group: list[list[_Bucket]] = [[] for _ in layout.sub_groups]
        self._cut(plan.grad_bucket)
        self._sg_pending = [0] * len(layout.sub_groups)
        self._free: list[tuple[torch.Tensor, Any]] = []  # device staging buffers and the copy that last read each
        self._staging_numel = max((b.numel for b in self.buckets), default=0)
        self._landing: StagingRing | None = None
        self.sends = {"buckets": 0, "pieces": 0}  # copies to the host: whole buckets, single pieces (fallback)
        if self.staged:
            try:
                for _ in range(2):  # one bucket filling while the last one's copy drains; more on demand
                    try:
                        self._free.append((self._new_staging(), None))
                    except BudgetExceeded:
                        break  # no room on the device: pieces go to the host one by one
                if self.accumulate:
                    self._landing = StagingRing(store, 3, self._staging_numel, plan.dtype,
                                                "pinned landing buffers of accumulated gradients", _FIX)
                    self._adds = Worker("offload-grads", copies.device)
            except BaseException:
                self.close()
                raise
        self.begin_micro_batch()

    def _cut(self, bucket: int) -> None:
        """Buckets of at most ``bucket`` elements over each sub-group. A range of padding alone gets none: the host
        buffers hold zeros there already (zeroed when allocated, and a slot when taken), and a bucket no gradient
        can complete would hold its sub-group's update back until the step."""
        for sg in self.layout.sub_groups:
            for start in range(sg.start, sg.end, bucket):
                b = _Bucket(sg.index, start, min(start + bucket, sg.end))
                for seg in sg.segments:
                    lo, hi = max(b.start, seg.flat_start), min(b.end, seg.flat_start + seg.numel)
                    if lo < hi:
                        piece = _Piece(len(b.pieces), seg.param_start + lo - seg.flat_start, lo, hi - lo)
                        b.pieces.append(piece)
                        self._of_param[seg.param].append((b, piece))
                if not b.pieces:
                    continue
                b.gaps = sg.padding(b.start, b.end)
                self.buckets.append(b)
                self._of_sub_group[sg.index].append(b)

    def _new_staging(self) -> torch.Tensor:
        return self.store.allocate(Tier.DEVICE, self._staging_numel, self._dtype, "a gradient bucket on the device",
                                   _FIX)

    # a micro-batch ----------------------------------------------------------------------------------------------

    def begin_micro_batch(self) -> None:
        for b in self.buckets:
            b.arrived = [False] * len(b.pieces)
            b.pending = len(b.pieces)
            b.handles = []
            b.single = False
        self._sg_pending = [len(bs) for bs in self._of_sub_group]

    def new_window(self) -> None:
        """After an optimizer step: the next micro-batch starts a new accumulation window."""
        for b in self.buckets:
            b.written = False

    def receive(self, i: int, grad: torch.Tensor, base: int = 0) -> list[Copy]:
        """Parameter ``i``'s final gradient (flat, on the device; its elements from ``base`` of the flattened
        parameter). May be freed when this returns (the allocator keeps it for the copies in flight); returns
        those copies, which a caller that writes into ``grad``'s memory again must ``use`` first."""
        reads: list[Copy] = []
        # last bucket first, as backward fills them: a parameter spanning several completes the one already open
        # (its later neighbours came first) before it opens the next, so two staging buffers suffice
        for bucket, piece in reversed(self._of_param[i]):
            assert not bucket.arrived[piece.index], "a gradient piece arrived twice (the engine checks this)"
            src = grad[piece.param_start - base : piece.param_start - base + piece.numel]
            if self.staged:
                if bucket.staging is None and not bucket.single and not self._open(bucket):
                    bucket.single = True
                if bucket.single:
                    reads.append(self._send(bucket, piece.flat_start, src, single=True))
                else:
                    lo = piece.flat_start - bucket.start
                    bucket.staging[lo : lo + piece.numel].copy_(src)
            else:
                self._write(bucket, piece.flat_start, src)
            bucket.arrived[piece.index] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self._flush(bucket)
        return reads

    def end_backward(self) -> None:
        """Sends every bucket still open or incomplete, zeros where a parameter got no gradient."""
        for bucket in self.buckets:
            if bucket.pending:
                self._fill_missing(bucket)
                self._flush(bucket)

    def handles(self, sub_group: int) -> list[Any]:
        """What the update of ``sub_group`` must wait for: this micro-batch's copies into its range."""
        return [h for b in self._of_sub_group[sub_group] for h in b.handles]

    def wait(self) -> None:
        """Blocks until every gradient of this micro-batch has landed in the host buffers; raises an error of the
        accumulation thread."""
        wait_all([h for b in self.buckets for h in b.handles])
        if self._adds is not None:
            self._adds.wait_idle()

    # moving bytes -----------------------------------------------------------------------------------------------

    def _open(self, bucket: _Bucket) -> bool:
        """Gives ``bucket`` a device staging buffer; False when none is free and none fits the device budget."""
        if self._free:
            buf, last = self._free.pop(0)  # the oldest: its copy has had the longest to finish
            self.copies.use(last)  # the compute stream writes into it only after its last copy has read it
        else:
            try:
                buf = self._new_staging()
            except BudgetExceeded:
                return False
        bucket.staging = buf
        return True

    def _write(self, bucket: _Bucket, flat_start: int, src: torch.Tensor) -> None:
        """Direct mode: ``src`` straight into the gradient buffer, copied in the first micro-batch of a window."""
        lo = flat_start - self.layout.sub_groups[bucket.sub_group].start
        dst = self._dest(bucket.sub_group)[lo : lo + src.numel()]
        if bucket.written:
            dst.add_(src)
        else:
            dst.copy_(src)

    def _send(self, bucket: _Bucket, flat_start: int, src: torch.Tensor, *, single: bool = False) -> Copy:
        """Staged mode: one asynchronous copy of ``src`` (device) to its place in the host gradient buffer, through
        a landing buffer and an add on the optimizer thread when micro-batches accumulate."""
        lo = flat_start - self.layout.sub_groups[bucket.sub_group].start
        n = src.numel()
        dst = self._dest(bucket.sub_group)[lo : lo + n]
        self.sends["pieces" if single else "buckets"] += 1
        if self._landing is None:
            copy = self.copies.to_host(dst, src)
            bucket.handles.append(copy)
            return copy
        slot, landing = self._landing.take()
        copy = self.copies.to_host(landing[:n], src)
        job = self._adds.submit(_accumulate, dst, landing[:n], copy, not bucket.written)
        self._landing.used(slot, job)
        bucket.handles.append(job)
        return copy

    def _fill_missing(self, bucket: _Bucket) -> None:
        """Zeros for the pieces that got no gradient in this micro-batch (a window's first: later ones add none)."""
        for piece, came in zip(bucket.pieces, bucket.arrived):
            if came:
                continue
            if bucket.staging is not None:
                lo = piece.flat_start - bucket.start
                bucket.staging[lo : lo + piece.numel].zero_()
            elif not bucket.written:
                lo = piece.flat_start - self.layout.sub_groups[bucket.sub_group].start
                self._dest(bucket.sub_group)[lo : lo + piece.numel].zero_()
        bucket.pending = 0

    def _flush(self, bucket: _Bucket) -> None:
        if bucket.staging is not None:
            for lo, hi in bucket.gaps:  # a reused buffer: the padding must reach the host as zeros
                bucket.staging[lo:hi].zero_()
            copy = self._send(bucket, bucket.start, bucket.staging[: bucket.numel])
            self._free.append((bucket.staging, copy))
            bucket.staging = None
        elif self._adds is not None and not bucket.handles:
            # nothing of this micro-batch reached this range, but an earlier one's add may still be running into
            # it: the update waits for a job queued behind those adds (the thread runs jobs in order)
            bucket.handles.append(self._adds.submit(_nothing))
        bucket.written = True
        self._sg_pending[bucket.sub_group] -= 1
        if self._sg_pending[bucket.sub_group] == 0:
            self._on_ready(bucket.sub_group)

    @property
    def staging_bytes(self) -> int:
        """Device bytes held by gradient buckets now (counted on the DEVICE tier)."""
        held = [buf for buf, _ in self._free] + [b.staging for b in self.buckets if b.staging is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def close(self) -> None:
        """Waits for copies and adds in flight, stops the accumulation thread, frees the staging and landing
        buffers."""
        try:
            self.copies.synchronize()
            if self._adds is not None:
                self._adds.close()
                self._adds = None
        finally:
            for b in self.buckets:
                b.handles = []
                if b.staging is not None:
                    self._free.append((b.staging, None))
                    b.staging = None
            for buf, _ in self._free:
                self.store.free(Tier.DEVICE, buf)
            self._free = []
            if self._landing is not None:
                self._landing.close()
                self._landing = None


def _nothing() -> None:
    """A job that marks its place in the accumulation thread's queue."""


def _accumulate(dst: torch.Tensor, landing: torch.Tensor, copy: Any, first: bool) -> None:
    """On the accumulation thread: once ``copy`` has landed a bucket's gradient, it goes into the fp32
    accumulator."""
    copy.wait()
    if first:
        dst.copy_(landing)
    else:
        dst.add_(landing)
