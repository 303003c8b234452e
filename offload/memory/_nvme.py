"""NvmeSpace: the one owner of NVMe storage in offload. Every NVMe user is an instance of it.

Three things keep bytes on NVMe: the optimizer state (the :class:`~._store.TieredStore`, which keeps its own
residency records and staging pool on top), stage 3's pieces of the parameters
(:class:`~offload.params._shards.ParamShards`) and the NVMe homes of parameter offload. Each holds one NvmeSpace,
which owns for its lifetime:

* its claim on the store's NVME account (:meth:`TieredStore.claim_nvme` applies the budget's rules), given back
  at close;
* its swap file: the one ``SwapEngine`` construction in offload, always through the store's ``file_io`` (the
  OS-call boundary that tests inject faults at, so a fault reaches every NVMe byte alike), reserved whole at once
  (a disk too small fails at ``initialize``, and rewrites land in the room set aside beside the data they replace);
* optionally, a :class:`~._copies.StagingArena` of host memory that its reads land in on their way to the device
  (:meth:`open_staging`);
* the reads and writes of its keys: one request per part, each counted in the store's ``moved`` counters
  (``stats()["bytes_moved"]``) as it starts, so no user can move a byte the counters miss. Several parts start
  as one handle (:meth:`read_parts`, :meth:`write_parts`); :meth:`write_window` writes parts with at most a given
  number in flight, the room the swap file's claim holds for rewrites.

``close()`` waits for the I/O in flight, removes the swap file, frees the staging and gives the claim back; a
close cut short (an interrupt while it waits) is finished by the next call.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvme_swapper import PAGE, AioConfig, FileIO, SwapEngine, SwapHandle

from ._copies import AllOf, StagingArena, start_all, wait_all
from ._tiers import Tier

if TYPE_CHECKING:
    from ._store import TieredStore


class NvmeSpace:
    """``nbytes`` of NVMe under ``path`` for one owner (see the module docstring); ``what`` and ``fix`` name it in
    the budget's error. ``file_io``: overrides the store's (tests only)."""

    def __init__(self, store: "TieredStore", path: str | os.PathLike[str], nbytes: int, what: str, fix: str, *,
                 aio: AioConfig | None = None, file_io: FileIO | None = None) -> None:
        self._store = store
        self.root = Path(path)
        self.arena: StagingArena | None = None
        self._swap: SwapEngine | None = None
        store.claim_nvme(self.root, nbytes, what, fix)
        self._claimed = nbytes
        try:
            self._swap = SwapEngine(self.root, aio or AioConfig(),
                                    file_io=file_io if file_io is not None else store.file_io)
            self._swap.reserve(nbytes - PAGE)  # written now, but the header: steady writes are overwrites
        except BaseException:
            self.close()
            raise

    def open_staging(self, numel: int, dtype: torch.dtype, what: str, fix: str) -> StagingArena:
        """The host arena this space's reads land in before their copy to the device, freed at close."""
        assert self.arena is None, "open_staging called twice"
        self.arena = StagingArena(self._store, numel, dtype, what, fix)
        return self.arena

    # reads and writes -------------------------------------------------------------------------------------------

    def read(self, key: str, dst: torch.Tensor) -> SwapHandle:
        """Starts reading ``key`` into host tensor ``dst``; ``dst`` is the read's until the handle is waited."""
        assert self._swap is not None
        handle = self._swap.read(key, dst)
        self._store.count(Tier.NVME, Tier.HOST, handle.nbytes)
        return handle

    def write(self, key: str, src: torch.Tensor) -> SwapHandle:
        """Starts writing host tensor ``src`` under ``key``; ``src`` must stay untouched until the handle is
        waited."""
        assert self._swap is not None
        handle = self._swap.write(key, src)
        self._store.count(Tier.HOST, Tier.NVME, handle.nbytes)
        return handle

    def read_parts(self, parts: Iterable[tuple[str, torch.Tensor]]) -> AllOf:
        """Starts reading each (key, destination) as one handle; if one cannot start, those started are waited
        for before the error is raised (the caller may reuse the memory at once)."""
        return start_all(functools.partial(self.read, key, dst) for key, dst in parts)

    def write_parts(self, parts: Iterable[tuple[str, torch.Tensor]]) -> AllOf:
        """Starts writing each (key, source) as one handle (started ones waited for if one cannot start)."""
        return start_all(functools.partial(self.write, key, src) for key, src in parts)

    def write_window(self, parts: Iterable[tuple[str, torch.Tensor]], window: int) -> None:
        """Writes each (key, source), at most ``window`` in flight (the rewrites the swap file's claim has room
        for), and returns once all are done; after a failure the rest still in flight are waited for first."""
        handles: list[SwapHandle] = []
        try:
            for key, src in parts:
                if len(handles) >= window:
                    handles.pop(0).wait()
                handles.append(self.write(key, src))
        except BaseException:
            with contextlib.suppress(Exception):
                wait_all(handles)
            raise
        wait_all(handles)

    # reporting and lifetime -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any] | None:
        """The swap engine's counters and settings (bytes read and written, ...); None once closed."""
        return self._swap.stats() if self._swap is not None else None

    def synchronize(self) -> None:
        """Waits until no read or write is in flight (their errors stay with their handles)."""
        if self._swap is not None:
            self._swap.synchronize()

    def close(self) -> None:
        """Waits for the I/O in flight, removes the swap file, frees the staging and gives the claim back."""
        if self._swap is not None:
            self._swap.close()  # cut short, it stays set: the next close finishes it
            self._swap = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self._claimed:
            self._store.accounts[Tier.NVME].release(self._claimed)
            self._claimed = 0
