"""DeviceWindow: the bounded set of parameters on the device, and every move of a parameter's state.

At most ``max_live`` elements of non-persistent parameters are on the device (AVAILABLE, FETCHING or LANDING) or
cached there: a released parameter's buffer is kept, by size, for the next fetch of a parameter of that size (no
allocation, no page faults), and is written again only after the compute stream has passed the point where it was
released. A parameter no module uses is evictable, least recently used first: it stays until a fetch needs the
room. Parameters with at most ``stage3_param_persistence_threshold`` elements stay AVAILABLE (persistent).

Copies to the device go through the engine's :class:`~offload.memory.CopyStreams`: with CUDA, a host home is copied
on the host-to-device stream and the compute stream waits for that copy on the GPU only when it uses the parameter;
an NVMe home is read into a piece of a fixed pinned staging arena and copied on by the fetch thread, which does not
wait for that copy (the arena does, before it lends the piece's room again). On the CPU the same calls copy on the
fetch thread (:class:`~._homes.Homes` starts the reads).

This object owns the buffers, their accounting on the DEVICE tier, the LRU and the state moves of
:class:`~._record.ParamRecord` (``_record.py``); :func:`check_window` says beforehand whether a config fits.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Any

import torch

from ..memory import BudgetExceeded, Copy, CopyStreams, Tier, TieredStore
from ._homes import Homes
from ._landing import Landings
from ._record import ParamRecord, ParamState


def check_window(sizes: list[int], persistence_threshold: int, max_live: int, dtype: torch.dtype,
                 budget: int | None) -> None:
    """The window (``max_live`` elements) plus the persistent parameters must fit the device ``budget``, and the
    largest parameter the window: checked before anything moves (the engine calls it before the parameters go to
    their homes, so a config that cannot fit leaves the model as it was), not mid-step."""
    size = torch.empty((), dtype=dtype).element_size()
    persistent = sum(n for n in sizes if n <= persistence_threshold) * size
    largest = max((n for n in sizes if n > persistence_threshold), default=0)
    if largest > max_live:
        raise ValueError(f"zero_optimization.stage3_max_live_parameters ({max_live}) is smaller than the "
                         f"largest parameter ({largest} elements); raise it to at least {largest}")
    if budget is not None and max_live * size + persistent > budget:
        least = largest * size + persistent  # the smallest window (the largest parameter) beside the persistent
        if budget >= least:
            fix = (f"lower zero_optimization.stage3_max_live_parameters to at most {(budget - persistent) // size} "
                   f"or raise offload.device_memory_budget to at least {max_live * size + persistent} B")
        elif largest * size <= budget:  # only fewer persistent parameters make room for the largest one
            fix = (f"lower zero_optimization.stage3_param_persistence_threshold (fewer of the {persistent} B of "
                   f"persistent parameters kept on the device) or raise offload.device_memory_budget to at least "
                   f"{least} B")
        else:  # the largest parameter alone does not fit: only a larger budget helps
            fix = (f"raise offload.device_memory_budget to at least {least} B: the largest parameter ({largest} "
                   "elements) is on the device whole while its module runs"
                   + (f", beside {persistent} B of persistent parameters" if persistent else ""))
        raise BudgetExceeded(Tier.DEVICE, f"the parameter window (stage3_max_live_parameters {max_live} "
                             f"x {size} B) plus {persistent} B of persistent parameters",
                             max_live * size + persistent, 0, budget, fix)


class DeviceWindow:
    """The device side of ``params`` (see the module docstring). ``counters``: parameter offload's, which the
    window adds its releases, landings and refetches to. ``close()`` frees the cached buffers."""

    def __init__(self, params: list[ParamRecord], store: TieredStore, copies: CopyStreams, dtype: torch.dtype,
                 homes: Homes, landings: Landings, counters: dict[str, int], *, max_live: int) -> None:
        self.params, self.store, self.copies, self.dtype = params, store, copies, dtype
        self.homes, self.landings, self.counters = homes, landings, counters
        self.device = store.device
        self.max_live = max_live
        self.phase = "forward"  # which pass uses the window: backward's evictions free buffers autograd may hold
        self.live_numel = 0  # non-persistent parameters AVAILABLE or FETCHING
        self.in_flight_numel = 0
        self.cached_numel = 0  # live + cached stays within max_live: the window's bound
        # released device buffers by size, reused by fetches, each with the compute-stream point it was released at
        self._cache: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.evictable: collections.OrderedDict[int, ParamRecord] = collections.OrderedDict()  # unused, oldest first
        self.by_storage: dict[int, ParamRecord] = {}  # a device buffer's storage -> its parameter
        # frozen parameters unpacked in this backward: autograd may still read their buffers (never reused)
        self.frozen_in_backward: set[int] = set()

    def placeholder(self, rec: ParamRecord) -> torch.Tensor:
        # one element of no dimension: it expands to any shape, a 0-d parameter's (CLIP's logit_scale) included
        return torch.full((), float("nan"), dtype=self.dtype, device=self.device).expand(rec.shape)

    def unused(self, rec: ParamRecord) -> None:
        """``rec`` (AVAILABLE) has no user left: evictable, the most recently used."""
        self.evictable[rec.index] = rec
        self.evictable.move_to_end(rec.index)

    # to the device ----------------------------------------------------------------------------------------------

    def ready(self, rec: ParamRecord) -> str:
        """Makes ``rec`` AVAILABLE, waiting if needed; says how it was found: resident, in_flight or waited."""
        self.evictable.pop(rec.index, None)  # in use again
        if rec.state is ParamState.LANDING:  # needed before the update it waits for: read the home instead
            self.cancel_landing(rec)
        if rec.state is ParamState.AVAILABLE:
            if rec.stale:
                self.refresh(rec)
            return "resident"
        if rec.state is ParamState.FETCHING:
            try:
                self.finish(rec)
            except OSError:  # a prefetch started while the disk was failing (a step that failed before this
                if rec.sharded:  # one, retried): read the home once more, and raise if that fails. Not a piece:
                    raise  # its gather is a collective, and this rank alone would issue it again
                self.counters["refetched"] += 1
                self._demand(rec)
            return "in_flight"
        self._demand(rec)
        return "waited"

    def _demand(self, rec: ParamRecord) -> None:
        """RELEASED -> AVAILABLE, waiting."""
        self._make_room(rec.numel, keep=rec)
        self.start(rec)
        self.finish(rec)

    def materialize(self, rec: ParamRecord) -> None:
        """A device buffer for ``rec``: a cached one of its size (no allocation, no page faults), else a new one
        after dropping cached buffers until the window has room."""
        cached = self._cache.get(rec.numel)
        if cached and not rec.persistent:
            rec.device, rec.after = cached.pop(0)  # the oldest: the compute stream is likeliest past its mark
            self.cached_numel -= rec.numel
        else:
            rec.after = None
            if not rec.persistent:
                self.trim(self.max_live - self.live_numel - rec.numel)
            with self.copies.copy_stream():  # filled by a copy on that stream, used on the compute stream
                rec.device = self.store.allocate(Tier.DEVICE, rec.numel, self.dtype, f"parameter {rec.index} on the "
                                                 "device", "raise offload.device_memory_budget or lower "
                                                 "zero_optimization.stage3_max_live_parameters",
                                                 prefault=False)  # the fetch writes it whole
        self.by_storage[rec.device.untyped_storage().data_ptr()] = rec

    def trim(self, keep: int) -> None:
        """Frees cached device buffers until at most ``keep`` elements stay cached."""
        for numel in sorted(self._cache, reverse=True):
            bufs = self._cache[numel]
            while bufs and self.cached_numel > max(keep, 0):
                self.store.free(Tier.DEVICE, bufs.pop()[0])
                self.cached_numel -= numel

    def start(self, rec: ParamRecord, *, wait_for_room: bool = True) -> bool:
        """RELEASED -> FETCHING: a device buffer, and the copy or read that fills it started. False, with nothing
        changed, when NVMe staging has no room and ``wait_for_room`` is off (a prefetch stops there); a demand
        waits for the fetch thread to give staging back. A failure to start leaves the parameter RELEASED."""
        arena, staging = self.homes.arena, None
        if self.homes.staged(rec):
            staging = arena.take(rec.numel, block=wait_for_room)  # type: ignore[union-attr]
            if staging is None:
                return False
        try:
            self.materialize(rec)
        except BaseException:
            if staging is not None:
                arena.give(staging)  # type: ignore[union-attr]
            raise
        self.in_flight_numel += rec.numel
        if not rec.persistent:
            self.live_numel += rec.numel
        try:
            rec.pending = self.homes.start_read(rec, staging)
        except BaseException:
            if staging is not None:
                arena.give(staging)  # type: ignore[union-attr]
            self.in_flight_numel -= rec.numel
            self._fetch_failed(rec)
            raise
        rec.after = None
        rec.state = ParamState.FETCHING
        return True

    def finish(self, rec: ParamRecord) -> None:
        """FETCHING -> AVAILABLE, waiting for the fetch (on the GPU the compute stream waits for its copy)."""
        pending, rec.pending = rec.pending, None
        self.in_flight_numel -= rec.numel
        t = time.perf_counter()
        try:
            if isinstance(pending, concurrent.futures.Future):
                pending = pending.result()
            if isinstance(pending, Copy):
                self.copies.use(pending)  # on the GPU: the compute stream waits for the copy, the CPU does not
            else:
                pending.wait()
            self.copies.hold(rec.device)  # allocated on the copy stream, read on the compute stream
        except Exception:
            self._fetch_failed(rec)
            raise
        except BaseException:  # the wait was cut short (a second Ctrl-C), not the fetch: it stays in flight
            rec.pending = pending
            self.in_flight_numel += rec.numel
            raise
        finally:
            self.store.stall_seconds += time.perf_counter() - t
        self.available(rec)

    def _fetch_failed(self, rec: ParamRecord) -> None:
        """FETCHING -> RELEASED after a read or copy that failed (every part of it settled: ``AllOf``, the copy
        thread's future). The home is untouched, so the next fetch starts over; the half-filled buffer is freed,
        never cached for another parameter."""
        self.by_storage.pop(rec.device.untyped_storage().data_ptr(), None)
        self.copies.synchronize()  # a copy stream's work on the buffer ends before the allocator may reuse it
        self.store.free(Tier.DEVICE, rec.device)
        if not rec.persistent:
            self.live_numel -= rec.numel
        rec.device = rec.after = None
        rec.param.data = self.placeholder(rec)
        rec.state = ParamState.RELEASED

    def upload_now(self, rec: ParamRecord, value: torch.Tensor) -> None:
        """Writes ``value`` (host, or already on the device) into ``rec``'s device buffer, ready for the calling
        thread's stream."""
        if value.device.type != "cpu" or not self.copies.cuda:
            rec.device.copy_(value.reshape(-1))
            self.copies.hold(rec.device)  # allocated on the copy stream, written here on the calling one
        else:
            copy = self.copies.to_device(rec.device, value.reshape(-1), after=self.copies.mark())
            self.copies.use(copy, rec.device)
            copy.wait()  # value may be a staging buffer, reused when this returns

    def refresh(self, rec: ParamRecord) -> None:
        """A persistent parameter after an optimizer step: copy its new value from the home."""
        self.homes.refresh(rec)
        rec.stale = False

    def available(self, rec: ParamRecord) -> None:
        """The end of every way to AVAILABLE (a fetch waited for, a landing completed)."""
        rec.state, rec.stale = ParamState.AVAILABLE, False
        rec.param.data = rec.device.view(rec.shape)

    # off the device ---------------------------------------------------------------------------------------------

    def release(self, rec: ParamRecord, reuse: bool = True) -> None:
        """Back to RELEASED. ``reuse=False`` when autograd may still hold the device tensor (unpacked for a
        backward node that has not run yet): its buffer is dropped, not handed to the next fetch. A LANDING
        parameter gives up its landing."""
        self.evictable.pop(rec.index, None)
        if rec.state is ParamState.LANDING:
            self.cancel_landing(rec)
            return
        if rec.persistent or rec.users > 0 or rec.held or rec.state is ParamState.RELEASED:
            return
        if rec.state is ParamState.FETCHING:
            self.finish(rec)
        self.by_storage.pop(rec.device.untyped_storage().data_ptr(), None)
        if reuse:  # fetches of same-shaped parameters reuse it, once the compute stream is past this point
            self._cache.setdefault(rec.numel, []).append((rec.device, self.copies.mark()))
            self.cached_numel += rec.numel
        else:
            self.store.free(Tier.DEVICE, rec.device)
        self._released(rec)

    def _released(self, rec: ParamRecord) -> None:
        """The end of every way back to RELEASED, once the buffer is cached or freed."""
        placeholder = self.placeholder(rec)  # first: the record changes in the few steps after it
        self.live_numel -= rec.numel
        rec.device = rec.after = None
        rec.param.data = placeholder
        rec.state = ParamState.RELEASED
        self.counters["released"] += 1

    def evict(self, numel: int) -> bool:
        """Releases evictable parameters, least recently used first, until ``numel`` more fit the window."""
        while self.live_numel + numel > self.max_live and self.evictable:
            rec = next(iter(self.evictable.values()))
            self.release(rec, reuse=rec.index not in self.frozen_in_backward)
        return self.live_numel + numel <= self.max_live

    def _make_room(self, numel: int, keep: ParamRecord) -> None:
        """Before a demand fetch: evict unused parameters, then prefetched (or landing) ones nobody uses yet."""
        if self.evict(numel):
            return
        for rec in self.params:
            if rec is not keep and rec.users == 0 and not rec.held and not rec.persistent \
                    and rec.state is not ParamState.RELEASED and rec.index not in self.frozen_in_backward:
                self.release(rec, reuse=self.phase == "forward")
                if self.live_numel + numel <= self.max_live:
                    return

    # landing (_landing.py) --------------------------------------------------------------------------------------

    def begin_landing(self, rec: ParamRecord) -> None:
        """AVAILABLE -> LANDING: the buffer stays in the window for the optimizer to copy the new values into,
        once the compute stream has passed this point (its last read of the old ones). Not evictable: only a fetch
        that finds no other room takes it back (``_make_room``)."""
        self.evictable.pop(rec.index, None)
        self.by_storage.pop(rec.device.untyped_storage().data_ptr(), None)
        rec.after = self.copies.mark()
        rec.param.data = self.placeholder(rec)
        rec.state = ParamState.LANDING
        self.landings.open(rec)

    def complete_landing(self, rec: ParamRecord) -> bool:
        """LANDING -> AVAILABLE if every part landed (the compute stream waits for the copies), else released."""
        copies = self.landings.take(rec)
        if copies is None:
            self.cancel_landing(rec)
            return False
        for copy in copies:
            self.copies.use(copy)
        rec.after = None
        self.available(rec)
        self.by_storage[rec.device.untyped_storage().data_ptr()] = rec
        self.counters["landed"] += 1
        return True

    def cancel_landing(self, rec: ParamRecord) -> None:
        """LANDING -> RELEASED: the optimizer copies nothing more in; the buffer goes back to the cache once the
        copies it made have run."""
        self.landings.drop(rec)
        self._cache.setdefault(rec.numel, []).append((rec.device, rec.after))
        self.cached_numel += rec.numel
        self._released(rec)

    def close(self) -> None:
        """Frees the cached buffers (the parameters' own are handed back by parameter offload)."""
        self.trim(0)
