"""ReduceBuckets: stages 1-2 on several ranks sum each gradient into its owner's share while backward still runs.

The buckets are fixed when the engine is built: each param group's flat buffer (see
:class:`~offload.optim._layout.FlatLayout`) is cut, from its end, into runs of consecutive parameters spanning at
most ``bucket`` elements (the alignment gaps between them included, the buffer's trailing padding not), so the
first bucket holds the parameters backward usually finishes first. A parameter larger than a bucket is a bucket of
its own and is reduced from its own gradient tensor, with no copy. When the last
gradient of a bucket has arrived, its range is summed onto the ranks owning parts of it: one ``reduce`` per owner,
of that owner's slice (usually one or two per bucket), so every element crosses the wire once per micro-batch, the
reduce-scatter volume of the ZeRO paper (Psi), and no rank ever holds a full-size gradient.

Ranks must issue collectives in the same order, and gradients need not arrive in the same order everywhere (a
parameter unused on one rank has none there). So buckets are issued strictly in their fixed order: one completed
early waits, in its buffer, for those before it; when backward ends, a bucket still missing gradients is completed
with zeros for them (such parameters update with a zero gradient, as on one rank) and everything left is issued.

Buffers (:class:`BucketState` says where each bucket is): a bucket takes a device buffer from a pool when its first
gradient arrives; a buffer goes back to the pool with the copies still reading it (``deliver`` returns them), which
the compute stream waits for before it writes there again. Two buffers serve the usual order (one filling while the
previous one's reduce runs; one when the model is a single bucket): they are allocated when the engine is built
(:func:`pool_buffers`, which the estimate counts too), so a device budget they do not fit fails at initialize. A
bucket needing one when none is free first completes the oldest reduce in flight, and only when none is in flight
(the gradients came far out of order) is another allocated, on the DEVICE tier (``peak_buffers`` counts them).

Completing a bucket waits for its reduces and hands this rank's part of each parameter in it to ``deliver(i,
values, base)`` (the engine's :class:`~offload.engine._grads.GradientStream`, which copies it to the host share, or
adds it there when micro-batches accumulate, and starts the optimizer's update of a sub-group once it is complete).
With ``overlap_comm`` the reduces run on the backend's own thread or stream beside backward, and a bucket is
completed when its buffer is needed again or backward ends; without it each bucket is completed as soon as it is
issued.

With ``sparse_gradients``, an ``nn.Embedding`` weight is a bucket of its own whose touched rows are sent to their
owners instead of the dense range, whenever that is cheaper on every rank (:mod:`._sparse`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch

from ..memory import Copy, CopyStreams, Tier, TieredStore
from ..optim._layout import FlatLayout
from ._comm import Comm
from ._sparse import exchange_rows, sparse_pays, touched_rows

_FIX = "lower zero_optimization.reduce_bucket_size or raise offload.device_memory_budget"


class BucketState(Enum):
    EMPTY = "empty"  # no gradient of this micro-batch yet
    FILLING = "filling"  # some gradients copied into its buffer
    READY = "ready"  # every gradient in: waits for the buckets before it to be issued
    IN_FLIGHT = "in flight"  # its reduces run
    DONE = "done"  # reduced and delivered in this micro-batch


@dataclass(eq=False)
class _Bucket:
    group: int
    start: int  # flat range [start, end) of the group's buffer
    end: int
    params: list[int]  # in flat order
    own: bool  # one parameter larger than a bucket: reduced from its own gradient
    sparse: bool = False  # an embedding whose touched rows are sent instead, where that is cheaper (_sparse.py)
    sends: list[tuple[int, int, int]] = field(default_factory=list)  # (owner, lo, hi): one reduce each
    state: BucketState = BucketState.EMPTY
    pending: int = 0  # gradients still to come in this micro-batch
    arrived: set[int] = field(default_factory=set)
    buf: torch.Tensor | None = None  # covers [start, end)
    pooled: bool = False  # ``buf`` came from the pool (not a parameter's own gradient)
    works: list[Any] = field(default_factory=list)  # the reduces in flight


def cut_buckets(layout: FlatLayout, bucket: int, sparse: frozenset[int] = frozenset()) -> list[_Bucket]:
    """Each param group's flat buffer cut, from its end, into runs of consecutive parameters spanning at most
    ``bucket`` elements; a parameter larger than that, or one in ``sparse``, is a bucket of its own."""
    bucket = max(bucket, 1)
    buckets: list[_Bucket] = []

    def add(g: int, start: int, end: int, params: list[int], share: int, sparse: bool = False) -> None:
        b = _Bucket(g, start, end, params, own=sparse or end - start > bucket, sparse=sparse)
        for owner in range(start // share, (end - 1) // share + 1):
            b.sends.append((owner, max(start, owner * share), min(end, (owner + 1) * share)))
        buckets.append(b)

    for g, total in enumerate(layout.group_numel):
        share = total // layout.world_size
        run: list[int] = []
        end = 0  # where the data of the run's last parameter ends
        for i in reversed([i for i in range(len(layout.params)) if layout.param_group[i] == g]):
            off = layout.param_offset[i]
            if i in sparse:  # a bucket of its own, in its place in the order
                if run:
                    add(g, layout.param_offset[run[0]], end, run, share)
                    run = []
                add(g, off, off + layout.params[i].numel(), [i], share, sparse=True)
                continue
            if run and end - off > bucket:
                add(g, layout.param_offset[run[0]], end, run, share)
                run = []
            if not run:
                end = off + layout.params[i].numel()
            run.insert(0, i)
        if run:
            add(g, layout.param_offset[run[0]], end, run, share)
    return buckets


def pool_buffers(total: int, largest_group: int, bucket: int, pooled: int | None = None) -> tuple[int, int]:
    """The pool the engine starts with, for ``total`` flat elements whose largest param group has
    ``largest_group``, cut in buckets of ``bucket``: how many device buffers (two, or as many as the ``pooled``
    buckets that copy their gradients if fewer) and their elements each (no bucket that copies is larger). The
    estimate, which sees one param group and no sparse embeddings, calls it without ``pooled``: one bucket when
    the whole model is one bucket's worth."""
    count = 2 if pooled is not None or total > bucket else 1
    return (count if pooled is None else min(count, pooled)), min(bucket, largest_group)


class ReduceBuckets:
    """Owns the buckets and their device buffers of one engine (stages 1-2, world size > 1); see the module
    docstring. Call ``begin_micro_batch``, ``add`` from each gradient hook, ``end_backward``, and ``close``."""

    def __init__(self, comm: Comm, layout: FlatLayout, store: TieredStore, copies: CopyStreams, *, bucket: int,
                 dtype: torch.dtype, overlap: bool, deliver: Callable[[int, torch.Tensor, int], list[Copy]],
                 sparse: frozenset[int] = frozenset()) -> None:
        self.comm, self.layout, self.store, self.copies, self.dtype = comm, layout, store, copies, dtype
        self.overlap, self._deliver, self._sparse = overlap, deliver, sparse
        self.sparse_sent = {"rows": 0, "dense": 0}  # sparse buckets: sent as rows, or dense (rows cost more)
        self.bucket = max(bucket, 1)
        self.buckets = cut_buckets(layout, self.bucket, sparse)
        self._of_param: list[_Bucket | None] = [None] * len(layout.params)
        for b in self.buckets:
            for i in b.params:
                self._of_param[i] = b
        self._free: list[tuple[torch.Tensor, list[Copy]]] = []  # pool buffers and the copies still reading them
        self._buffers = 0  # pool buffers allocated
        self.peak_buffers = 0
        self._next = 0  # the next bucket to issue, in ``buckets`` order
        self._in_flight: list[_Bucket] = []
        self.exposed_seconds = 0.0  # waiting for reduces, summed over micro-batches
        count, self._buffer_numel = pool_buffers(sum(layout.group_numel), max(layout.group_numel, default=0),
                                                 self.bucket, sum(1 for b in self.buckets if not b.own))
        try:
            for _ in range(count):
                self._free.append((self._new_buffer(), []))
        except BaseException:
            self.close()
            raise
        self.begin_micro_batch()

    # a micro-batch ----------------------------------------------------------------------------------------------

    def begin_micro_batch(self) -> None:
        assert not self._in_flight, "a micro-batch began with reduces in flight"
        for b in self.buckets:
            b.state, b.pending, b.arrived = BucketState.EMPTY, len(b.params), set()
        self._next = 0

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient (on the device) into its bucket; may issue reduces. A sparse one
        (``nn.Embedding(sparse=True)``) stays sparse in a sparse bucket only: without sparse_gradients it is sent
        dense, as any other."""
        b = self._of_param[i]
        assert b is not None and i not in b.arrived
        if grad.is_sparse and not b.sparse:
            grad = grad.to_dense()
        if not grad.is_sparse:
            grad = grad.reshape(-1)
        if b.own:  # sparse buckets too: ``grad`` may be a sparse COO tensor there
            b.buf = grad  # held until its reduce is done; autograd's reference goes
        else:
            if b.buf is None:
                b.buf = self._take_buffer()
                b.pooled = True
            off = self.layout.param_offset[i] - b.start
            b.buf[off : off + grad.numel()].copy_(grad)
        b.arrived.add(i)
        b.pending -= 1
        b.state = BucketState.READY if b.pending == 0 else BucketState.FILLING
        self._issue_ready()

    def end_backward(self) -> None:
        """Completes every bucket (zeros for gradients that never came), issues the rest in order, waits for all
        and delivers them."""
        for b in self.buckets[self._next :]:
            if b.state is BucketState.READY:
                continue
            if b.buf is None and b.sparse:  # no rows touched here
                b.pending, b.state = 0, BucketState.READY
                continue
            if b.buf is None:
                b.pooled = not b.own
                b.buf = self._take_buffer() if b.pooled else torch.zeros(
                    b.end - b.start, dtype=self.dtype, device=self.layout.params[b.params[0]].device)
            for i in b.params:
                if i not in b.arrived:
                    off = self.layout.param_offset[i] - b.start
                    b.buf[off : off + self.layout.params[i].numel()].zero_()
            b.pending, b.state = 0, BucketState.READY
        self._issue_ready()
        while self._in_flight:
            self._complete(self._in_flight[0])

    # issuing and completing -------------------------------------------------------------------------------------

    def _issue_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].state is BucketState.READY:
            b = self.buckets[self._next]
            self._next += 1
            if b.sparse and self._send_rows(b):
                continue
            buf = b.buf
            assert buf is not None
            b.works = [self.comm.reduce(buf[lo - b.start : hi - b.start], owner) for owner, lo, hi in b.sends]
            b.state = BucketState.IN_FLIGHT
            self._in_flight.append(b)
            if not self.overlap:
                self._complete(b)

    def _send_rows(self, b: _Bucket) -> bool:
        """A sparse bucket: its touched rows go to their owners (synchronously) and this rank's part is delivered;
        False, with the bucket's buffer now its dense gradient, when every rank agreed rows cost more."""
        i = b.params[0]
        p = self.layout.params[i]
        width = p.shape[-1]
        rows = p.numel() // width
        if b.buf is None:
            idx = torch.empty(0, dtype=torch.int64, device=p.device)
            vals = torch.empty((0, width), dtype=self.dtype, device=p.device)
        else:
            idx, vals = touched_rows(b.buf, rows, width)
        if not sparse_pays(self.comm, idx.numel(), rows, width, vals.element_size()):
            self.sparse_sent["dense"] += 1
            b.buf = torch.zeros(p.numel(), dtype=self.dtype, device=p.device) if b.buf is None else \
                (b.buf.to_dense() if b.buf.is_sparse else b.buf).reshape(-1)
            return False
        self.sparse_sent["rows"] += 1
        mine = exchange_rows(self.comm, self.layout, i, idx, vals, width)
        if mine is not None:
            self._deliver(i, mine[0], mine[1])
        b.buf, b.state = None, BucketState.DONE
        return True

    def _complete(self, b: _Bucket) -> None:
        assert b is self._in_flight[0], "reduces complete in the order they were issued"
        t = time.perf_counter()
        try:
            for w in b.works:
                w.wait()
        finally:
            self.exposed_seconds += time.perf_counter() - t
        self._in_flight.pop(0)
        b.works = []
        lo, hi = self.layout.owned[b.group]
        reads: list[Copy] = []
        for i in b.params:
            off, n = self.layout.param_offset[i], self.layout.params[i].numel()
            a, z = max(off, lo), min(off + n, hi)
            if a < z:
                reads += self._deliver(i, b.buf[a - b.start : z - b.start], a - off)
        if b.pooled:
            self._free.append((b.buf, reads))
        b.buf, b.pooled, b.state = None, False, BucketState.DONE

    def _take_buffer(self) -> torch.Tensor:
        while not self._free and any(b.pooled for b in self._in_flight):
            self._complete(self._in_flight[0])
        if self._free:
            buf, reads = self._free.pop()
            for copy in reads:  # the compute stream writes into it only after they have read it
                self.copies.use(copy)
            return buf
        return self._new_buffer()

    def _new_buffer(self) -> torch.Tensor:
        buf = self.store.allocate(Tier.DEVICE, self._buffer_numel, self.dtype, "a gradient reduce bucket", _FIX,
                                  prefault=False)
        self._buffers += 1
        self.peak_buffers = max(self.peak_buffers, self._buffers)
        return buf

    @property
    def buffer_bytes(self) -> int:
        """Device bytes the pool holds (allocated buffers, free or in use)."""
        return self._buffers * self._buffer_numel * torch.empty((), dtype=self.dtype).element_size()

    def stats(self) -> dict[str, Any]:
        """The buckets (count, elements each), the most pool buffers held at once and their bytes, and the
        seconds spent waiting for reduces (what backward did not hide)."""
        return {"buckets": len(self.buckets), "bucket_numel": self.bucket, "peak_buffers": self.peak_buffers,
                "buffer_bytes": self.buffer_bytes, "exposed_seconds": self.exposed_seconds,
                "sparse_sent": dict(self.sparse_sent)}

    def close(self) -> None:
        """Waits for reduces in flight (errors ignored: the engine is closing) and frees the pool."""
        for b in self._in_flight:
            for w in b.works:
                try:
                    w.wait()
                except Exception:  # noqa: BLE001 - closing after a failed collective
                    pass
            b.works = []
        self._in_flight = []
        for b in self.buckets:
            if b.pooled and b.buf is not None:
                self._free.append((b.buf, []))
            b.buf, b.pooled = None, False
        for buf, _ in self._free:
            self.store.free(Tier.DEVICE, buf)
        self._free, self._buffers = [], 0
