"""CopyStreams: the one component that copies between the device and host memory, and owns what that takes.

With CUDA it owns two side streams (device-to-host and host-to-device) and hands out a :class:`Copy` per transfer:
the event recorded after the copy on its stream, and the host tensors that must stay alive until it has run. A
copy to the host is issued behind an event of the calling thread's stream (which produced the source), a copy to
the device behind the event its caller names (the point after which the compute stream no longer reads the
destination). So copies overlap compute, the compute stream waits for a copy only where it uses the result
(:meth:`CopyStreams.use`, a wait on the GPU, not on the CPU), and a thread that reuses a host buffer waits for the
copy that read it (:meth:`Copy.wait`). Device tensors are marked with ``record_stream`` so the caching allocator
never hands their memory out while a copy on a side stream still touches it. Host memory is pinned by the tiered
store (HOST allocations are page-locked with CUDA), so the copies are asynchronous for real.

On the CPU the device tier is host memory: the same calls copy at once on the calling thread and every Copy is
complete, so one code path serves both. :class:`StagingRing` is the pinned host buffers copies go through, reused
in turn once the copy that last used each is done; :class:`StagingArena` is one pinned buffer lent in pieces of any
size that come back in the order they were taken (reads from NVMe on their way to the device). Every copy is
counted in the store's bytes moved per tier pair.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch

from nvme_swapper import PAGE

from ._tiers import Tier


class Waitable(Protocol):
    def wait(self) -> Any: ...


class Copy:
    """One device<->host copy; complete when made on the CPU. ``wait()`` blocks the calling thread until the copy
    has run (its destination may be read, its host source reused), then drops the event and the tensors."""

    __slots__ = ("event", "_keep")

    def __init__(self, event: Any = None, keep: tuple[torch.Tensor, ...] = ()) -> None:
        self.event, self._keep = event, keep

    def done(self) -> bool:
        event = self.event  # read once: another thread's wait() may clear it
        return event is None or bool(event.query())

    def wait(self) -> None:
        event = self.event
        if event is not None:
            event.synchronize()
        self.event, self._keep = None, ()


DONE = Copy()


class CopyStreams:
    """Streams and events of one engine's device<->host copies (see the module docstring). ``count(src, dst,
    nbytes)`` records bytes moved (the store's counter)."""

    def __init__(self, device: torch.device, count: Any) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._count = count
        self._d2h = torch.cuda.Stream(device) if self.cuda else None
        self._h2d = torch.cuda.Stream(device) if self.cuda else None

    def current_stream(self) -> Any:
        """The calling thread's current stream (the compute stream on the training thread); None on the CPU."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def mark(self) -> Any:
        """An event at this point of the calling thread's current stream (the compute stream when the training
        thread calls): what a later copy into memory that stream reads must wait for. None on the CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, src_tier: Tier = Tier.DEVICE,
                dst_tier: Tier = Tier.HOST) -> Copy:
        """Copies device tensor ``src`` into host tensor ``dst`` after everything the calling thread's stream has
        issued so far (which produced ``src``); ``src`` may be freed at once."""
        self._count(src_tier, dst_tier, src.numel() * src.element_size())
        if not self.cuda:
            dst.copy_(src)
            return DONE
        after = self.mark()
        with torch.cuda.device(self.device), torch.cuda.stream(self._d2h):
            self._d2h.wait_event(after)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # threads that wait for it sleep instead of spinning a core
            event.record(self._d2h)
        src.record_stream(self._d2h)
        return Copy(event, (dst,))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any,
                  src_tier: Tier = Tier.HOST) -> Copy:
        """Copies host tensor ``src`` into device tensor ``dst`` once ``after`` (an event from :meth:`mark`, or
        None when nothing on the device may still read ``dst``) has passed. The compute stream sees the result
        after :meth:`use`; ``src`` may be reused after ``Copy.wait``."""
        self._count(src_tier, Tier.DEVICE, src.numel() * src.element_size())
        if not self.cuda:
            dst.copy_(src)
            return DONE
        with torch.cuda.device(self.device), torch.cuda.stream(self._h2d):
            if after is not None:
                self._h2d.wait_event(after)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(self._h2d)
        dst.record_stream(self._h2d)
        return Copy(event, (src,))

    def use(self, copy: Copy | None, tensor: torch.Tensor | None = None) -> None:
        """The calling thread's stream waits (on the GPU) for ``copy`` before it runs anything issued later. Pass
        the copy's destination as ``tensor`` when it was allocated under :meth:`copy_stream` (see :meth:`hold`)."""
        event = copy.event if copy is not None else None  # read once: another thread's wait() may clear it
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        if tensor is not None:
            self.hold(tensor)

    def hold(self, tensor: torch.Tensor) -> None:
        """Marks device memory allocated under :meth:`copy_stream` as used by the calling thread's stream, so the
        allocator does not hand it out again until that stream is done with it."""
        if self.cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def copy_stream(self) -> Iterator[None]:
        """Device memory allocated inside comes from the host-to-device stream's pool: a copy into it needs to
        wait for nothing on the compute stream (memory the compute stream freed but may still be reading is never
        handed out there). The compute stream must then ``use(copy, tensor)``."""
        if not self.cuda:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._h2d):
            yield

    def use_uploads(self) -> None:
        """The calling thread's stream waits for every host-to-device copy issued so far, by any thread."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self._h2d)
            torch.cuda.current_stream(self.device).wait_event(event)

    def download(self, src: torch.Tensor) -> torch.Tensor:
        """A new plain CPU tensor with ``src``'s values (blocking; for checkpoints and reads, not the hot path)."""
        if src.device.type == "cpu":
            return src.detach().clone()
        out = torch.empty(src.shape, dtype=src.dtype, device="cpu")  # whatever default device the caller set
        self.to_host(out, src.detach().contiguous()).wait()
        return out

    def upload(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new device tensor with ``src``'s values, ready for the calling thread's stream."""
        src = src.detach().to(dtype or src.dtype).contiguous()
        with self.copy_stream():
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        self.use(self.to_device(out, src, after=None), out)
        return out

    def synchronize(self) -> None:
        """Waits on the CPU for every copy in flight."""
        if self.cuda:
            self._d2h.synchronize()
            self._h2d.synchronize()


class StagingRing:
    """``count`` pinned host buffers (HOST tier) that copies pass through in turn. :meth:`take` hands out the next
    one after waiting for whatever last used it (a :class:`Copy`, or a job of the optimizer thread); the taker
    records its own use with :meth:`used`. One thread owns a ring."""

    def __init__(self, store: Any, count: int, numel: int, dtype: torch.dtype, what: str, fix: str) -> None:
        self._store = store
        self.buffers: list[torch.Tensor] = []
        self._busy: list[Waitable | None] = []
        self._next = 0
        self._lock = threading.Lock()
        try:
            for _ in range(count):
                self.buffers.append(store.allocate(Tier.HOST, numel, dtype, what, fix))
                self._busy.append(None)
        except BaseException:
            self.close()
            raise

    def take(self) -> tuple[int, torch.Tensor]:
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self.buffers)
            busy, self._busy[i] = self._busy[i], None
        if busy is not None:
            busy.wait()
        return i, self.buffers[i]

    def used(self, i: int, by: Waitable) -> None:
        self._busy[i] = by

    def wait_all(self) -> None:
        """Waits for every use, each forgotten before it is waited for, so a failed one raises once: the first
        error, once all have settled (a failed step's errors are not raised again by the next wait, or close)."""
        busy, self._busy = [b for b in self._busy if b is not None], [None] * len(self._busy)
        wait_all(busy)

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            for b in self.buffers:
                self._store.free(Tier.HOST, b)
            self.buffers = []


def arena_span(numel: int, element_size: int) -> int:
    """Elements a piece of ``numel`` takes in a :class:`StagingArena`: rounded up to whole pages, so every piece
    starts on one. The swap engine reads into a page-aligned buffer with O_DIRECT straight from the disk, and
    bounces any other through a block-sized copy (2.4x slower, measured on this machine's disk)."""
    per_page = max(1, PAGE // element_size)
    return -(-numel // per_page) * per_page


class StagingArena:
    """One HOST buffer of ``numel`` elements (pinned where the store pins), lent in contiguous pieces of any size,
    each starting on a page, that come back in the order they were taken, as a ring; the newest may also come
    back at once, when what it was taken for could not start. A piece may come back ``busy``: a copy still reading
    it, waited for only when its room is needed again (so the thread that gave it back never waits for the
    device). Its size is fixed at construction, so a fetch never asks the host budget for memory mid-step (with
    several ranks, an allocation refused on one rank alone would make the ranks issue different collectives) and
    the pages are registered with CUDA once. Thread-safe: a piece may come back on another thread, and
    ``take(block=True)`` waits for that."""

    def __init__(self, store: Any, numel: int, dtype: torch.dtype, what: str, fix: str) -> None:
        self._store = store
        self.buffer = store.allocate(Tier.HOST, numel, dtype, what, fix)
        # [start, end, busy] of each piece, oldest first; busy: None while lent, then what must finish before the
        # room is reused (DONE when nothing)
        self._out: collections.deque[list[Any]] = collections.deque()
        self._cond = threading.Condition()

    def _room(self, span: int) -> int | None:
        """Where ``span`` elements fit now: after the newest piece, else (wrapping) at the start."""
        cap = self.buffer.numel()
        if not self._out:
            return 0
        oldest, end = self._out[0][0], self._out[-1][1]
        if end > oldest:  # not wrapped: free after the newest piece and before the oldest
            return end if cap - end >= span else (0 if span <= oldest else None)
        return end if oldest - end >= span else None

    def _reclaim(self) -> None:
        """Drops the pieces at either end that are back and no longer busy."""
        while self._out and self._out[0][2] is not None and self._out[0][2].done():
            self._out.popleft()
        while self._out and self._out[-1][2] is not None and self._out[-1][2].done():
            self._out.pop()

    def _span(self, numel: int) -> int:
        span = arena_span(numel, self.buffer.element_size())
        if span > self.buffer.numel():
            raise RuntimeError(f"a staging piece of {numel} elements ({span} in whole pages) exceeds its arena of "
                               f"{self.buffer.numel()}: the arena is sized by Plan.read_staging")
        return span

    def fits(self, numel: int) -> bool:
        """Whether a piece of ``numel`` elements could be taken now without waiting."""
        span = self._span(numel)
        with self._cond:
            self._reclaim()
            return self._room(span) is not None

    def take(self, numel: int, *, block: bool = False) -> torch.Tensor | None:
        """A piece of ``numel`` elements; None when it does not fit until older pieces come back or their copies
        finish (``block``: wait for them instead; the caller must have pieces out that another thread gives
        back)."""
        if numel == 0:
            return self.buffer[:0]
        span = self._span(numel)
        while True:
            with self._cond:
                self._reclaim()
                start = self._room(span)
                if start is not None:
                    self._out.append([start, start + span, None])
                    return self.buffer[start : start + numel]
                if not block:
                    return None
                busy = self._out[0][2]
                if busy is None:  # still lent: wait for another thread to give it back
                    self._cond.wait()
                    continue
            busy.wait()  # back, its copy still reading it: wait for the copy (without the lock)

    def give(self, piece: torch.Tensor, busy: Copy | None = None) -> None:
        """Takes back a piece: the oldest one still lent, or the newest; ``busy``: a copy still reading it."""
        if piece.numel() == 0:
            return
        start = (piece.data_ptr() - self.buffer.data_ptr()) // piece.element_size()
        with self._cond:
            lent = [entry for entry in self._out if entry[2] is None]
            if not lent or start not in (lent[0][0], lent[-1][0]):
                raise RuntimeError(f"a staging piece at element {start} came back out of order (pieces lent: "
                                   f"{[entry[:2] for entry in lent]})")
            (lent[0] if lent[0][0] == start else lent[-1])[2] = busy if busy is not None else DONE
            self._reclaim()
            self._cond.notify_all()

    def close(self) -> None:
        """Waits for the copies still reading pieces that came back, then frees the buffer (every piece must be
        back, or its user done with it)."""
        if self.buffer is None:
            return
        try:
            wait_all([entry[2] for entry in self._out if entry[2] is not None])
        finally:
            self._out.clear()
            self._store.free(Tier.HOST, self.buffer)
            self.buffer = None


class AllOf:
    """Several transfers in flight as one handle; ``wait()`` completes them all (the first error raised after all
    have settled, so no transfer is left on memory about to be reused)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self) -> None:
        handles, self.handles = self.handles, []
        wait_all(handles)


def start_all(starts: Iterable[Callable[[], Waitable]]) -> AllOf:
    """Starts every transfer (``starts``: calls that each start one and return its handle) as one handle. If one
    cannot start, those already started are waited for before the error is raised: the caller may hand their
    memory out again at once."""
    handles: list[Waitable] = []
    try:
        for start in starts:
            handles.append(start())
    except BaseException:
        with contextlib.suppress(Exception):
            wait_all(handles)
        raise
    return AllOf(handles)


def wait_all(handles: Sequence[Waitable]) -> None:
    """Waits for every handle, even after one fails (so no copy or I/O is left on memory about to be reused); the
    first error is raised."""
    error: BaseException | None = None
    for h in handles:
        try:
            h.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others settled
            error = error or exc
    if error is not None:
        raise error
