"""TieredStore: the one component that places bytes on tiers and moves them between tiers.

It owns the three tier accounts (budgets, current and peak bytes; :meth:`TieredStore.claim_nvme` holds the NVME
budget's rules), the counters of bytes moved per tier pair and of time stalled waiting for I/O, and, for the
optimizer state, the NVMe-homed tensors: their :class:`~._nvme.NvmeSpace` (the swap file, as every NVMe user has
one) and the staging-buffer pool they pass through. Everything else (the optimizer, the engine, parameter offload)
asks it.

An NVMe-homed tensor has one record with an explicit residency:

    NVME --fetch--> FETCHING --acquire--> HOST --evict--> EVICTING --(write done)--> NVME
                                            ^------------------ acquire (waits the write, keeps the bytes)

``fetch`` is a non-blocking prefetch (it starts a read only if a staging buffer is free) and ``evict`` starts the
write-back; both return a :class:`Transfer` to wait on. ``acquire`` blocks until the tensor is in a buffer. An
evicted tensor's buffer is reused once its write is done, which the store notices when it next needs a buffer, at
``drain``, or when the transfer is waited. So errors of a worker thread's write surface at the next wait, and a
failed write keeps the bytes in their buffer (residency HOST): nothing is lost.
"""

from __future__ import annotations

import collections
import errno
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from nvme_swapper import (HUGE_PAGE, PAGE, AioConfig, FileIO, SwapHandle, aligned_tensor, cow_spare, remove_left_behind,
                          swap_file_bytes)

from ..ops import host_stream_buffer

from ._nvme import NvmeSpace
from ._pool import BufferPool
from ._tiers import Tier, TierAccount, fmt_bytes


class Residency(Enum):
    NVME = "nvme"  # only on disk
    FETCHING = "fetching"  # a read into a staging buffer is in flight
    HOST = "host"  # in a staging buffer
    EVICTING = "evicting"  # a write from its staging buffer is in flight


@dataclass
class _Managed:
    key: str
    numel: int
    dtype: torch.dtype
    residency: Residency = Residency.NVME
    claimed: bool = False  # handed out by stage/acquire and not yet given back by evict/release
    slot: int | None = None
    io: SwapHandle | None = None  # the read or write in flight, cleared when waited


def default_host_budget() -> int:
    """90% of the memory available now (MemAvailable), the default HOST budget."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 * 9 // 10
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 9 // 10


def prepare_nvme_path(path: str | os.PathLike[str], key: str) -> Path:
    """Checks an ``nvme_path`` from the configuration (``key`` is its dotted config key) so that a bad one fails at
    ``initialize`` with the path named, never mid-training. Creates it (0700) when missing. Refuses a symlink (the
    swap files would land wherever it points, outside the place configured), something that is not a directory, and
    a directory where a file cannot be created (read-only filesystem, permissions: probed by creating one, which
    also holds for root). Room for the swap files is checked when the store reserves them (``open_nvme``)."""
    root = Path(path)
    if root.is_symlink():
        raise ValueError(f"{key} {str(root)!r} is a symlink (to {os.readlink(root)!r}); swap files are not written "
                         "through symlinks: give the real directory")
    if root.exists() and not root.is_dir():
        raise ValueError(f"{key} {str(root)!r} exists and is not a directory; give a directory")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"{key}: cannot create {root}: {os.strerror(exc.errno or errno.EIO)}; give a "
                      "writable directory", str(root)) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
    except OSError as exc:
        raise OSError(exc.errno, f"{key}: cannot write in {root}: {os.strerror(exc.errno or errno.EIO)}; give a "
                      "writable directory", str(root)) from None
    try:
        os.close(fd)
    finally:  # (an interrupt too: no probe is left in the user's folder)
        os.unlink(probe)
    remove_left_behind(root)  # a killed run's swap folders: their space is counted free for this run
    return root


class Transfer:
    """A fetch or an evict in flight. ``wait()`` completes it: a fetch returns the staged tensor, an evict frees
    its buffer; either raises the I/O error."""

    def __init__(self, store: "TieredStore", key: str, evict: bool) -> None:
        self._store, self.key, self.evict = store, key, evict

    def done(self) -> bool:
        io = self._store._managed[self.key].io
        return io is None or io.done()

    def wait(self) -> torch.Tensor | None:
        if self.evict:
            self._store._wait_evicted(self.key)
            return None
        return self._store.acquire(self.key)


class TieredStore:
    """Budgets, allocations and transfers across DEVICE, HOST and NVME for one engine. ``close()`` frees all."""

    def __init__(self, device: torch.device, budgets: dict[Tier, int | None], *, pin_memory: bool,
                 file_io: FileIO | None = None) -> None:
        """``file_io``: the OS-call boundary handed to the swap engine (tests inject faults through it)."""
        self.device = device
        self.file_io = file_io  # every NvmeSpace of this store's owner uses it (parameters' homes and pieces too)
        self.pin_memory = pin_memory and device.type == "cuda"
        self.accounts = {tier: TierAccount(tier, budgets.get(tier)) for tier in Tier}
        self.moved: collections.Counter[str] = collections.Counter()
        self._moved_lock = threading.Lock()  # counted by the training, optimizer and fetch threads
        self.stall_seconds = 0.0
        self._managed: dict[str, _Managed] = {}
        self._charged: dict[int, int] = {}  # bytes charged per allocation, by address
        self._evicting: collections.deque[_Managed] = collections.deque()
        self._unwritten: list[_Managed] = []  # kept in their buffers by a failed write-back, held by no one
        self._nvme: NvmeSpace | None = None  # the optimizer state's swap file (open_nvme)
        self._pool: BufferPool | None = None
        self._max_writes = 1  # write-backs in flight at once (open_nvme sets it)
        # disk bytes per filesystem (st_dev) that initialize frees as it goes: the model's construction arena
        self.reclaimable: collections.Counter[int] = collections.Counter()

    # plain allocations -----------------------------------------------------------------------------------------

    def allocate(self, tier: Tier, numel: int, dtype: torch.dtype, what: str, fix: str = "", *,
                 stagger: int = 0, prefault: bool = True, pin: bool = True) -> torch.Tensor:
        """A zeroed flat tensor on DEVICE or HOST, counted against the tier's budget until ``free``. HOST buffers
        are pinned where the store pins (CUDA, ``pin_memory``) unless ``pin=False``: a buffer no device copy
        touches (the optimizer state) need not lock its pages nor pay the registration.

        ``stagger=k`` (CPU memory, large buffers) starts the buffer k stream-offsets into its huge page, for buffers
        streamed in lockstep with others by the Adam kernel: streams at equal huge-page offsets hit the same DRAM
        banks together and run up to twice as slow (docs/cpu_adam.md). ``prefault=False``: the buffer is about to be
        filled by a swap read, whose I/O thread faults its pages in (see ``aligned_tensor``)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        cpu = tier is Tier.HOST or self.device.type == "cpu"
        stagger = stagger if cpu and nbytes >= (64 << 20) else 0  # padding <= 3%
        charged = nbytes + (HUGE_PAGE if stagger else 0)
        self.accounts[tier].reserve(charged, what, fix)
        try:
            if stagger:
                t = host_stream_buffer(numel, dtype, slot=stagger,
                                       pin_memory=tier is Tier.HOST and self.pin_memory and pin)
            elif tier is Tier.DEVICE and self.device.type == "cpu":
                t = aligned_tensor(numel, dtype, pin_memory=False, prefault=prefault)
            elif tier is Tier.DEVICE:  # prefault=False: the caller overwrites it whole, zeros would be wasted
                t = torch.zeros(numel, dtype=dtype, device=self.device) if prefault else \
                    torch.empty(numel, dtype=dtype, device=self.device)
            elif tier is Tier.HOST:
                t = aligned_tensor(numel, dtype, pin_memory=self.pin_memory and pin)
            else:
                raise ValueError(f"allocate: {tier} holds files, not tensors; use register()")
        except BaseException:
            self.accounts[tier].release(charged)
            raise
        if numel:
            self._charged[t.data_ptr()] = charged
        return t

    def free(self, tier: Tier, tensor: torch.Tensor) -> None:
        """Returns the bytes ``allocate`` charged for ``tensor`` (the caller drops its references)."""
        if tensor.numel():
            self.accounts[tier].release(self._charged.pop(tensor.data_ptr()))

    def count(self, src: Tier, dst: Tier, nbytes: int) -> None:
        """Records bytes moved between tiers (the copies' and every NvmeSpace's reads and writes)."""
        with self._moved_lock:
            self.moved[f"{src.value}->{dst.value}"] += nbytes

    # NVMe-homed tensors ----------------------------------------------------------------------------------------

    def claim_nvme(self, root: Path, nbytes: int, what: str, fix: str) -> None:
        """Creates the swap directory ``root`` (0700) and charges ``nbytes`` of it to the NVME tier, whose budget
        defaults to 95% of the free space of the first filesystem claimed on, plus what ``reclaimable`` says will
        be freed there; give the bytes back with ``accounts[Tier.NVME].release`` (an :class:`NvmeSpace` claims
        and gives back its own)."""
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        account = self.accounts[Tier.NVME]
        if account.budget is None:
            account.budget = shutil.disk_usage(root).free * 95 // 100 + self.reclaimable[root.stat().st_dev]
        account.reserve(nbytes, what, fix)

    def open_nvme(self, path: str | os.PathLike[str], aio: AioConfig, *, slot_bytes: int, buffer_count: int,
                  total_bytes: int, what: str, spare_writes: int | None = None, key_bytes: list[int] | None = None,
                  file_io: FileIO | None = None) -> None:
        """Opens the NVMe space and the staging pool: NVME space for ``total_bytes`` of tensors plus a spare extent
        per write allowed in flight (``spare_writes``, default one per buffer: a copy-on-write write needs room
        beside the data it replaces; ``evict`` waits for the oldest write rather than exceed them), of each length
        among ``key_bytes`` (the keys' sizes; default: all of ``slot_bytes``)."""
        assert self._nvme is None, "open_nvme called twice"
        root = Path(path)
        self._max_writes = spare_writes = spare_writes or buffer_count
        claim = swap_file_bytes([[n] for n in key_bytes], spare_writes) if key_bytes is not None else \
            total_bytes + PAGE + cow_spare([[slot_bytes]] * spare_writes, spare_writes)  # (keys of slot_bytes)
        self._nvme = NvmeSpace(self, root, claim, f"{what} on {root}",
                               f"free disk space at {root}, point zero_optimization.offload_optimizer.nvme_path at a "
                               "larger filesystem, lower the state offloaded there, or raise "
                               "offload.nvme_memory_budget if it is below the free space", aio=aio, file_io=file_io)
        # the optimizer state's staging: the disk and CPU Adam read and write it, no device copy does (unpinned)
        self._pool = BufferPool(buffer_count, slot_bytes, self.accounts[Tier.HOST], pin_memory=False,
                                what=f"{buffer_count} NVMe staging buffers of {fmt_bytes(slot_bytes)}",
                                fix="lower zero_optimization.sub_group_size or offload_optimizer.buffer_count, or "
                                    "raise offload.host_memory_budget")

    def register(self, key: str, numel: int, dtype: torch.dtype) -> None:
        assert self._nvme is not None, "register before open_nvme"
        assert key not in self._managed, f"{key} registered twice"
        self._managed[key] = _Managed(key, numel, dtype)

    def residency(self, key: str) -> Residency:
        return self._managed[key].residency

    def stage(self, key: str) -> torch.Tensor:
        """A staging buffer for a tensor whose stored bytes the caller replaces as a whole (its first write, a
        checkpoint load): no read. A tensor kept in its buffer by a failed write-back keeps that buffer."""
        m = self._managed[key]
        if m.residency is Residency.HOST:
            self._claim(m)
            return self._view(m)
        if m.residency in (Residency.FETCHING, Residency.EVICTING):  # in a buffer already: settle it, keep it
            return self.acquire(key)
        assert m.residency is Residency.NVME and m.io is None
        m.slot = self._take_slot(block=True)
        m.residency = Residency.HOST
        m.claimed = True
        return self._view(m)

    def fetch(self, key: str) -> Transfer | None:
        """Starts reading ``key`` into a free staging buffer; None when no buffer is free (nothing started)."""
        m = self._managed[key]
        if m.residency is Residency.NVME:
            slot = self._take_slot(block=False)
            if slot is None:
                return None
            self._start_read(m, slot)
        return Transfer(self, key, evict=False)

    def acquire(self, key: str) -> torch.Tensor:
        """Blocks until ``key`` is in a staging buffer and returns it (flat, its dtype)."""
        m = self._managed[key]
        self._claim(m)
        if m.residency is Residency.NVME:
            self._start_read(m, self._take_slot(block=True))
        if m.residency in (Residency.FETCHING, Residency.EVICTING):
            self._wait_or_settle(m)
            if m.residency is Residency.EVICTING:
                self._evicting.remove(m)
            m.residency = Residency.HOST
        return self._view(m)

    def evict(self, key: str) -> Transfer:
        """Starts writing ``key``'s buffer back; the buffer is reused once the write is done."""
        m = self._managed[key]
        assert m.residency is Residency.HOST and self._nvme is not None
        while len(self._evicting) >= self._max_writes:  # the swap file holds spare room for this many
            self._reclaim(block=True)
        m.io = self._nvme.write(key, self._view(m))
        m.residency = Residency.EVICTING
        m.claimed = False
        self._evicting.append(m)
        return Transfer(self, key, evict=True)

    def _wait_evicted(self, key: str) -> None:
        m = self._managed[key]
        while m.residency is Residency.EVICTING:
            self._reclaim(block=True)

    def drain(self) -> None:
        """Waits for every write-back and every prefetch in flight. Write-backs that failed (now or before) are
        retried once after all others finished, so a fault that has cleared by then costs nothing; the first error
        of the retry (or of a prefetch) is raised, after everything in flight has settled."""
        error: BaseException | None = None
        for _ in range(2):
            self._retry_unwritten()
            error = None
            while self._evicting:
                head = self._evicting[0]
                try:
                    self._reclaim(block=True)
                except Exception as exc:
                    error = error or exc
                    if self._evicting and self._evicting[0] is head and head.io is None:  # no wait can settle it
                        self._evicting.popleft()  # (a record a second Ctrl-C left half changed): never spin on it
            if error is None:
                break
        for m in self._managed.values():
            if m.residency is Residency.FETCHING:
                try:
                    self._wait_or_settle(m)
                except Exception as exc:
                    error = error or exc
                    continue
                m.residency = Residency.HOST
        if error is not None:
            raise error

    def release(self, key: str) -> None:
        """Drops a clean staged copy (its bytes are already on NVMe) without writing it."""
        m = self._managed[key]
        if m.residency is Residency.FETCHING:
            try:
                self._wait_or_settle(m)
            except OSError:
                pass  # dropped unread: the stored bytes are untouched, and the next acquire reads (and reports) again
        if m.residency in (Residency.FETCHING, Residency.HOST):
            assert m.slot is not None and self._pool is not None
            self._pool.give(m.slot)
            m.slot, m.residency = None, Residency.NVME
        m.claimed = False

    def _view(self, m: _Managed) -> torch.Tensor:
        assert m.slot is not None and self._pool is not None
        return self._pool.slot(m.slot, m.numel, m.dtype)

    def _start_read(self, m: _Managed, slot: int) -> None:
        assert self._nvme is not None
        m.slot = slot
        m.io = self._nvme.read(m.key, self._view(m))
        m.residency = Residency.FETCHING

    def _wait(self, m: _Managed) -> None:
        """Waits for ``m``'s transfer. Once it has finished (well or not) it is cleared; a wait cut short (an
        interrupt) leaves it in flight, in ``m.io`` for the next wait, its buffer still its own."""
        io = m.io
        assert io is not None
        t = time.perf_counter()
        try:
            io.wait()
        finally:
            if io.done():
                m.io = None
            self.stall_seconds += time.perf_counter() - t

    def _claim(self, m: _Managed) -> None:
        """A caller takes ``m``'s buffer: a write-back that failed earlier is now the caller's to redo."""
        m.claimed = True
        if m in self._unwritten:
            self._unwritten.remove(m)

    def _retry_unwritten(self) -> None:
        while self._unwritten:
            self.evict(self._unwritten.pop(0).key)

    def _wait_or_settle(self, m: _Managed) -> None:
        """Waits for ``m``'s transfer; when it failed, leaves ``m`` in a state the next call can use and raises.
        A failed read gives its buffer back (the stored bytes are untouched: a later acquire reads them again); a
        failed write-back keeps the bytes in their buffer (residency HOST: nothing lost, the caller decides)."""
        try:
            self._wait(m)
        except BaseException:
            if m.io is not None:  # the wait was cut short, not the transfer: the buffer stays with the transfer
                raise
            if m.residency is Residency.FETCHING:
                assert m.slot is not None and self._pool is not None
                self._pool.give(m.slot)
                m.slot, m.residency = None, Residency.NVME
            elif m.residency is Residency.EVICTING:
                self._evicting.remove(m)
                m.residency = Residency.HOST
                self._unwritten.append(m)
            raise

    def _take_slot(self, *, block: bool) -> int | None:
        assert self._pool is not None
        while True:
            slot = self._pool.take()
            if slot is None and not self._evicting:
                self._retry_unwritten()  # buffers kept by failed write-backs: write them again (or fail again)
            if slot is None and not self._evicting and block and self._drop_prefetched():
                continue
            if slot is not None or not self._evicting:
                if slot is None and block:
                    raise RuntimeError("all NVMe staging buffers are held by tensors in use; raise "
                                       "offload_optimizer.buffer_count")
                return slot
            if not self._reclaim(block=block) and not block:
                return None

    def _drop_prefetched(self) -> bool:
        """Gives back the buffer of one prefetched tensor no one has claimed (clean: its bytes are on NVMe), e.g.
        one a failed step fetched and never used. True if one was dropped."""
        unwritten = {id(m) for m in self._unwritten}
        for m in self._managed.values():
            if not m.claimed and m.residency in (Residency.FETCHING, Residency.HOST) and id(m) not in unwritten:
                self.release(m.key)
                return True
        return False

    def _reclaim(self, *, block: bool) -> bool:
        """Frees the buffers of finished write-backs (waiting for the oldest if ``block``). True if any freed."""
        freed = False
        while self._evicting and (block and not freed or self._evicting[0].io.done()):
            m = self._evicting[0]
            self._wait_or_settle(m)
            assert m.slot is not None and self._pool is not None
            slot, m.slot, m.residency = m.slot, None, Residency.NVME  # the record, its queue and pool together
            self._evicting.popleft()
            self._pool.give(slot)
            freed = True
        return freed

    # reporting and lifetime ------------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, dict[str, int | None]]:
        return {tier.value: account.report() for tier, account in self.accounts.items()}

    def swap_stats(self) -> dict | None:
        return self._nvme.stats() if self._nvme is not None else None

    def close(self) -> None:
        """Waits for I/O in flight, closes the NVMe space (removing its files, giving its claim back) and frees the
        staging pool."""
        try:
            if self._nvme is not None:
                self._nvme.synchronize()
        finally:
            self._evicting.clear()
            if self._nvme is not None:
                self._nvme.close()
                self._nvme = None
            if self._pool is not None:
                self._pool.close()
                self._pool = None
