"""SwapEngine: store host tensors under string keys in a swap file, asynchronously.

Owns, from construction to ``close()``: a private directory (0700) inside the one it is given, one swap file (0600)
in it, the worker threads and their kernel-AIO contexts and bounce buffers. ``close()`` waits for everything in
flight, joins the threads and removes the directory unless ``keep=True``.

Semantics callers rely on:

* ``write``/``read`` return a :class:`SwapHandle` at once; the tensor must stay untouched until the handle is done.
* Requests on one key run in issue order (a read issued after a write sees that write); requests on different keys
  run concurrently.
* A write never overwrites the key's current bytes: it fills a free extent and the key moves there when it has
  completed. A failed write (ENOSPC, EIO, short transfer) leaves the previous content readable.
* Tensors: contiguous CPU tensors of any dtype and size. Page-aligned ones (see :func:`aligned_tensor`) move by
  O_DIRECT straight from/to their memory; others go through a block-size bounce buffer (correct, one extra copy,
  counted in ``stats()["bytes_bounced"]``). A non-contiguous or non-CPU tensor is refused with ValueError, as is a
  read-only destination (a read-only memory map) of a read that goes through the bounce buffer.
* With ``AioConfig(checksum=True)`` (the default) every block written gets a checksum kept in memory with the key's
  extent, and every read verifies it: bytes changed or truncated in the file by anyone else fail the read's
  ``wait()`` with OSError(EBADMSG) naming the key and the file, rather than reaching the caller.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._buffers import PAGE, round_up
from ._config import AioConfig
from ._handle import Op, Part, SwapHandle
from ._native import FileIO, checksum_kind, kernel_aio, kernel_aio_error, writable
from ._owner import remove_left_behind, write_owner
from ._swapfile import Extent, SwapFile
from ._workers import AiofilesWorkers, ThreadWorkers, _settle

log = logging.getLogger(__name__)
_warned_fallback: set[str] = set()


@dataclass(frozen=True)
class _Entry:
    extent: Extent
    nbytes: int
    sums: tuple[int, ...] | None  # per-block checksums of the bytes written (None: checksums off)


class SwapEngine:
    """Asynchronous tensor <-> file store. See the module docstring for the guarantees.

    directory: where the engine makes its private directory (created 0700 if missing).
    config: the I/O settings (:class:`AioConfig`).
    keep: leave the swap file (and a manifest.json of its keys and extents) in place at close.
    file_io: the OS-call boundary; tests pass a subclass of :class:`FileIO` to inject faults.
    """

    def __init__(self, directory: str | os.PathLike[str], config: AioConfig | None = None, *, keep: bool = False,
                 file_io: FileIO | None = None) -> None:
        self.config = config if config is not None else AioConfig()
        if not isinstance(self.config, AioConfig):
            raise ValueError(f"config must be an AioConfig, got {type(self.config).__name__}")
        self._keep = keep
        self._io = file_io if file_io is not None else FileIO()
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._index: dict[str, _Entry] = {}
        self._last: dict[str, SwapHandle] = {}  # the newest request on each key with one in flight
        self._issued: dict[str, int] = {}  # byte size of the newest write issued on a key with one in flight
        self._inflight: set[SwapHandle] = set()
        self._counters = dict.fromkeys(("bytes_written", "bytes_read", "bytes_bounced", "writes", "reads",
                                        "failed"), 0)
        self._closed = True  # no new request (set first: a failed construction is closed)
        self._released = True  # threads joined, file closed and removed: set last, so a close cut short goes on

        parent = Path(directory)
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"swap directory {parent} exists and is not a directory")
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_left_behind(parent)  # a killed run's swap files: their space is this run's
        try:
            self.directory = Path(tempfile.mkdtemp(prefix="swap-", dir=parent))  # 0700, ours alone
            if not keep:  # (a folder asked to outlive its engine is never taken for one left behind)
                write_owner(self.directory)
            self._file = SwapFile(self.directory / "swap.0", self._io, o_direct=self.config.o_direct)
            if self._file.fallback_reason and self.config.o_direct and str(parent) not in _warned_fallback:
                _warned_fallback.add(str(parent))
                log.warning("nvme_swapper: %s", self._file.fallback_reason)
            self.backend = self._choose_backend()
            if self.backend == "aiofiles":
                self._workers: ThreadWorkers | AiofilesWorkers = AiofilesWorkers(
                    self._file, self.config, self._resolve, self._count)
            else:
                self._workers = ThreadWorkers(self._file, self._io, self.config, self._resolve,
                                              self.backend == "aio", self._count)
        except BaseException:  # (a KeyboardInterrupt too, which may land after the threads started)
            if hasattr(self, "_workers"):
                self._workers.close()
            if hasattr(self, "_file"):
                self._file.close(remove=True)
            if hasattr(self, "directory"):
                shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._closed = self._released = False

    def _choose_backend(self) -> str:
        wanted = self.config.backend
        if wanted == "aiofiles":
            return "aiofiles"
        if wanted == "aio" and kernel_aio() is None:
            raise RuntimeError(f"AioConfig(backend='aio') but kernel AIO is unavailable ({kernel_aio_error()}); "
                               "use backend='auto' or 'threads'")
        if wanted in ("aio", "auto") and self._file.direct and kernel_aio() is not None:
            return "aio"
        return "threads"  # buffered files: kernel AIO would block in io_submit, threads overlap properly

    # requests ---------------------------------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Starts storing ``tensor``'s bytes under ``key``. Keep the tensor unchanged until the handle is done."""
        self._check(key, tensor, "write")
        with self._lock:
            handle = SwapHandle(key, Op.WRITE, tensor, self._last.get(key), self._complete)
            self._want_sums(handle)
            try:
                handle.extent = self._file.allocate(handle.nbytes)
            except OSError as exc:
                handle.after = None
                handle.fail_now(OSError(exc.errno, f"write of key {key!r} failed: {exc.strerror}",
                                        str(self._file.path)))
                return handle
            self._issued[key] = handle.nbytes
            self._launch(handle)
        return handle

    def read(self, key: str, out: torch.Tensor) -> SwapHandle:
        """Starts reading ``key``'s bytes into ``out``, whose byte size must equal what was written."""
        self._check(key, out, "read")
        nbytes = out.numel() * out.element_size()
        with self._lock:
            stored = self._issued.get(key, self._index[key].nbytes if key in self._index else None)
            if stored is None:
                raise KeyError(f"no tensor stored under key {key!r}")
            if stored != nbytes:
                raise ValueError(f"read of key {key!r}: {stored} bytes were written, the output tensor has {nbytes} "
                                 f"({out.dtype}, shape {tuple(out.shape)})")
            bounced = self.backend != "aiofiles" and self._file.direct and (out.data_ptr() % PAGE or nbytes % PAGE)
            if bounced and not writable(out.data_ptr(), nbytes):  # the bounce copy into it would crash the process
                raise ValueError(f"read of key {key!r}: the output tensor's memory is read-only (a read-only memory "
                                 "map?); read into a writable tensor, such as torch.empty_like(out)")
            handle = SwapHandle(key, Op.READ, out, self._last.get(key), self._complete)
            self._want_sums(handle)
            self._launch(handle)
        return handle

    async def awrite(self, key: str, tensor: torch.Tensor) -> None:
        """``write`` for asyncio: returns when the bytes are in the file."""
        await self.write(key, tensor)

    async def aread(self, key: str, out: torch.Tensor) -> None:
        """``read`` for asyncio: returns when ``out`` holds the bytes."""
        await self.read(key, out)

    def delete(self, key: str) -> None:
        """Removes a key (after its requests in flight finish) and returns its space to the filesystem."""
        self._check_open()
        with self._lock:
            if key not in self._index and key not in self._last:
                raise KeyError(f"no tensor stored under key {key!r}")
        while True:
            with self._lock:
                last = self._last.get(key)
                if last is None:
                    entry = self._index.pop(key, None)
                    if entry is None:
                        raise KeyError(f"no tensor stored under key {key!r} (its write failed)")
                    self._file.release(entry.extent)
                    return
            _settle(last)

    def keys(self) -> list[str]:
        """Keys stored or being written."""
        self._check_open()
        with self._lock:
            return sorted(set(self._index) | set(self._issued))

    def nbytes(self, key: str) -> int:
        """Byte size stored under ``key`` (the newest write issued, if one is in flight)."""
        self._check_open()
        with self._lock:
            if key in self._issued:
                return self._issued[key]
            if key in self._index:
                return self._index[key].nbytes
        raise KeyError(f"no tensor stored under key {key!r}")

    def reserve(self, nbytes: int) -> None:
        """Preallocates and writes ``nbytes`` of swap space now: first writes then run at overwrite speed, and a disk
        too small for the plan fails here (OSError ENOSPC naming the file) instead of mid-run."""
        self._check_open()
        self._file.reserve(nbytes)

    def synchronize(self) -> None:
        """Waits until no request is in flight (errors stay with their handles)."""
        with self._idle:
            while self._inflight:
                self._idle.wait()

    def stats(self) -> dict[str, Any]:
        """Counters and settings; after ``close()`` the final counters (keys and bytes then describe the file as it
        was at close)."""
        with self._lock:
            live = sum(e.extent.length for e in self._index.values())
            return {
                **self._counters,
                "backend": self.backend,
                "o_direct": self._file.direct,
                "fallback_reason": self._file.fallback_reason,
                "checksum": checksum_kind() if self.config.checksum else None,
                "keys": len(self._index),
                "in_flight": len(self._inflight),
                "live_bytes": live,
                "file_bytes": self._file.size,
                "free_bytes": self._file.free_bytes,
                "block_size": self.config.block_size,
                "queue_depth": self.config.queue_depth,
                "thread_count": self.config.thread_count,
            }

    # lifetime ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for requests in flight, joins the threads, closes the file, removes the directory (unless keep).
        A close cut short (a KeyboardInterrupt while it waits) is finished by the next call."""
        if self._released:
            return
        self._closed = True
        self.synchronize()
        self._workers.close()
        if self._keep:
            manifest = {k: {"offset": e.extent.offset, "nbytes": e.nbytes} for k, e in self._index.items()}
            fd = os.open(self.directory / "manifest.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"file": self._file.path.name, "keys": manifest}, f)
        self._file.close(remove=not self._keep)
        if not self._keep:
            shutil.rmtree(self.directory, ignore_errors=True)
        self._released = True

    def __enter__(self) -> "SwapEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            log.warning("SwapEngine(%s) was not closed; its threads and files leak until exit", self.directory)

    # internals --------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"SwapEngine({self.directory}) is closed: its keys went with its swap file; open a "
                               "new SwapEngine and write them again")

    def _check(self, key: str, tensor: torch.Tensor, what: str) -> None:
        self._check_open()
        if not isinstance(key, str):
            raise ValueError(f"{what}: key must be a str, got {type(key).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{what} of key {key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise ValueError(f"{what} of key {key!r}: the tensor must be a dense CPU tensor, got "
                             f"{tensor.device} {tensor.layout}; copy it to a host tensor (aligned_tensor) first")
        if not tensor.is_contiguous():
            raise ValueError(f"{what} of key {key!r}: the tensor is not contiguous (strides {tensor.stride()}); "
                             "pass tensor.contiguous() or a contiguous buffer")
        if tensor.is_conj() or tensor.is_neg():  # lazy views: their memory holds the values before the flip
            kind = "conjugate" if tensor.is_conj() else "negative"
            raise ValueError(f"{what} of key {key!r}: the tensor is a lazy {kind} view, whose memory does not hold "
                             "its values; pass tensor.resolve_conj().resolve_neg() (a read's destination must be a "
                             "plain tensor)")

    def _want_sums(self, handle: SwapHandle) -> None:
        if self.config.checksum:
            handle.sums = [0] * -(-handle.nbytes // self.config.block_size)

    def _launch(self, handle: SwapHandle) -> None:
        """Registers and queues a request; called with the lock held so queue order is issue order."""
        self._last[handle.key] = handle
        self._inflight.add(handle)
        parts = self._split(handle)
        handle.start(len(parts))
        self._workers.submit(parts)

    def _split(self, handle: SwapHandle) -> list[Part]:
        """Cuts a request into block-aligned stripes, one per thread for large tensors (one block each for the
        aiofiles baseline, whose concurrency is per block)."""
        n, bs = handle.nbytes, self.config.block_size
        if self.backend == "aiofiles":
            stripe = bs
        else:
            stripe = max(bs, round_up(-(-n // self.config.thread_count), bs))
        return [Part(handle, s, min(s + stripe, n)) for s in range(0, n, stripe)] or [Part(handle, 0, 0)]

    def _resolve(self, handle: SwapHandle) -> Extent:
        """The extent a request moves: chosen at issue for writes, looked up when it runs for reads."""
        if handle.extent is not None:
            return handle.extent
        with self._lock:
            if handle.extent is None:
                entry = self._index.get(handle.key)
                if entry is None:
                    raise KeyError(f"no tensor stored under key {handle.key!r} (the write before this read failed)")
                if entry.nbytes != handle.nbytes:
                    raise ValueError(f"read of key {handle.key!r}: {entry.nbytes} bytes were written, the output "
                                     f"tensor has {handle.nbytes}")
                handle.expected = entry.sums
                if entry.sums is None:
                    handle.sums = None
                handle.extent = entry.extent
            return handle.extent

    def _count(self, op: Op, nbytes: int, bounced: int) -> None:
        with self._lock:
            self._counters["bytes_written" if op is Op.WRITE else "bytes_read"] += nbytes
            self._counters["bytes_bounced"] += bounced

    def _complete(self, handle: SwapHandle, error: BaseException | None) -> None:
        with self._lock:
            key = handle.key
            self._inflight.discard(handle)
            if self._last.get(key) is handle:
                del self._last[key]
                self._issued.pop(key, None)
            if error is not None:
                self._counters["failed"] += 1
            if handle.op is Op.WRITE:
                if error is None:
                    old = self._index.get(key)
                    self._index[key] = _Entry(handle.extent, handle.nbytes,
                                              None if handle.sums is None else tuple(handle.sums))
                    if old is not None:
                        self._file.free(old.extent)
                    self._counters["writes"] += 1
                elif handle.extent is not None:
                    self._file.free(handle.extent)
            elif error is None:
                self._counters["reads"] += 1
            if not self._inflight:
                self._idle.notify_all()
