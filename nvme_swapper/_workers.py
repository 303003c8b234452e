"""The executors that move request parts between tensors and the swap file.

``ThreadWorkers`` (backends "aio" and "threads"): ``thread_count`` threads take parts from one FIFO queue. Each
owns, for its whole life, a kernel-AIO context of ``queue_depth // thread_count`` slots (backend "aio") and one
block-size bounce buffer (for tensors that are not page-aligned, and for sub-page tails under O_DIRECT). The
syscalls release the GIL, so the threads' I/O overlaps Python work and each other.

``AiofilesWorkers`` (backend "aiofiles"): the portable baseline. One event-loop thread runs each block as an
aiofiles coroutine (buffered I/O through aiofiles' thread pool), at most ``queue_depth`` at once; writes use O_DSYNC
and drop the written pages from the page cache, so a write has reached the disk when it completes, as with O_DIRECT.

Checksums (``AioConfig.checksum``): each block of ``block_size`` bytes of a tensor gets a checksum, computed by the
worker that moved it: by the kernel-AIO runner while the block's write is in flight, or as the block's read
completes (so hashing overlaps the requests still in flight), otherwise right after the block's pread/pwrite.
Writes record them in ``handle.sums``; reads compare them with ``handle.expected`` (what the write recorded) and
fail with EBADMSG on a mismatch.

Ordering: a part of a request waits for the previous request on its key (``handle.after``). Parts are queued in
issue order, so the request waited on has always been taken by a worker already: the wait always ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import os
import queue
import threading
from typing import Callable

from ._buffers import PAGE, aligned_tensor, round_up
from ._config import AioConfig
from ._handle import Op, Part, SwapHandle
from ._native import FileIO, ShortTransfer, Transfers, checksum, memory_at
from ._swapfile import Extent, SwapFile

Resolver = Callable[[SwapHandle], Extent]


def _settle(handle: SwapHandle | None) -> None:
    """Waits for a request to finish, ignoring its outcome (that belongs to its own waiter)."""
    if handle is not None:
        concurrent.futures.wait([handle._future])


def _io_error(handle: SwapHandle, path: str, exc: OSError | None = None, *, code: int = errno.EIO,
              detail: str = "") -> OSError:
    code = exc.errno if exc is not None and exc.errno else code
    what = detail or os.strerror(code)
    err = OSError(code, f"{handle.op.value} of key {handle.key!r} failed: {what}", path)
    return err


def _checksum_part(handle: SwapHandle, start: int, end: int, block_size: int, path: str,
                   known: dict[int, int] | None = None) -> None:
    """Records (writes) or verifies (reads) the checksums of the blocks in bytes [start, end) of a request, whose
    I/O has completed. ``known``: checksums already computed by the AIO runner, by block index."""
    sums = handle.sums
    if sums is None:
        return
    for lo in range(start, end, block_size):
        block = lo // block_size
        hi = min(lo + block_size, handle.nbytes)
        value = known.get(block) if known else None
        sums[block] = value if value is not None else checksum(handle.address + lo, hi - lo)
        if handle.op is Op.READ:
            assert handle.expected is not None and handle.extent is not None
            if sums[block] != handle.expected[block]:
                raise OSError(errno.EBADMSG, f"read of key {handle.key!r} failed: checksum mismatch in block {block} "
                              f"(bytes {lo}..{hi} of the tensor, file offset {handle.extent.offset + lo}): the swap "
                              "file was truncated or changed outside the engine", path)


class ThreadWorkers:
    """Runs parts on worker threads with kernel AIO (``use_aio``) or pread/pwrite."""

    def __init__(self, file: SwapFile, io: FileIO, config: AioConfig, resolve: Resolver, use_aio: bool,
                 on_bytes: Callable[[Op, int, int], None]) -> None:
        self._file, self._io, self._config, self._resolve = file, io, config, resolve
        self._use_aio = use_aio
        self._on_bytes = on_bytes
        self._queue: queue.SimpleQueue[Part | None] = queue.SimpleQueue()
        bs = config.block_size
        self._bounce = aligned_tensor(bs * config.thread_count, pin_memory=False)  # one pool, carved per thread
        self._threads: list[threading.Thread] = []
        started = threading.Barrier(config.thread_count + 1)
        self._start_errors: list[BaseException] = []
        try:
            for i in range(config.thread_count):
                self._threads.append(threading.Thread(target=self._run, name=f"nvme_swapper-io-{i}", daemon=True,
                                                      args=(self._bounce.data_ptr() + i * bs, started)))
                self._threads[-1].start()
            started.wait()
        except BaseException:  # (an interrupt): the threads started leave the barrier, or their queue, and are joined
            started.abort()
            self._threads = [t for t in self._threads if t.ident is not None]
            self.close()  # (those past a barrier that had tripped wait on the queue)
            raise
        if self._start_errors:
            self.close()
            raise self._start_errors[0]

    def submit(self, parts: list[Part]) -> None:
        for part in parts:
            self._queue.put(part)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads.clear()

    # worker -----------------------------------------------------------------------------------------------------

    def _run(self, bounce_address: int, started: threading.Barrier) -> None:
        bounce = memory_at(bounce_address, self._config.block_size)
        ctx = None
        try:
            if self._use_aio:
                ctx = self._io.aio_setup(self._config.depth_per_thread)
        except BaseException as exc:
            self._start_errors.append(exc)
        try:
            started.wait()
        except threading.BrokenBarrierError:  # the constructor was interrupted: no engine will use this thread
            pass
        try:
            if self._start_errors or started.broken:
                return
            while (part := self._queue.get()) is not None:
                handle = part.handle
                _settle(handle.after)
                error = None
                if not handle.failed():
                    try:
                        self._transfer(part, self._resolve(handle), bounce, bounce_address, ctx)
                    except BaseException as exc:
                        error = exc
                handle.part_done(error)
        finally:
            if ctx is not None:
                self._io.aio_destroy(ctx)

    def _transfer(self, part: Part, extent: Extent, bounce: memoryview, bounce_address: int,
                  ctx: int | None) -> None:
        handle, fd, bs = part.handle, self._file.fd, self._config.block_size
        is_write = handle.op is Op.WRITE
        start, end = part.start, part.end
        known: dict[int, int] | None = None
        bounced = 0  # bytes through the bounce buffer (O_DIRECT only): an unaligned tensor's, an aligned one's tail
        if not self._file.direct:
            self._sync(handle, memory_at(handle.address + start, end - start), extent.offset + start, is_write)
        elif handle.address % PAGE:
            self._bounced(handle, extent, start, end, bounce, bounce_address, is_write)
            bounced = end - start
        else:
            body_end = end - end % PAGE
            if body_end > start:
                transfers = Transfers((handle.address + o, min(bs, body_end - o), extent.offset + o)
                                      for o in range(start, body_end, bs))
                if ctx is not None:
                    known = self._aio(handle, ctx, fd, is_write, transfers)
                else:
                    for addr, n, off in transfers:
                        self._sync(handle, memory_at(addr, n), off, is_write)
            if end > body_end:
                self._bounced(handle, extent, body_end, end, bounce, bounce_address, is_write)
                bounced = end - body_end
        _checksum_part(handle, start, end, bs, str(self._file.path), known)
        self._on_bytes(handle.op, end - start, bounced)

    def _aio(self, handle: SwapHandle, ctx: int, fd: int, is_write: bool, transfers: Transfers) -> dict[int, int]:
        """Runs the transfers on the AIO context; returns the checksums it computed, by block index (only the
        transfers that cover a whole block; none after a failure)."""
        c = self._config
        if handle.sums is not None:
            transfers.sums = (ctypes.c_uint64 * len(transfers))()
        failure = self._io.aio_run(ctx, c.depth_per_thread, fd, is_write, transfers, c.single_submit,
                                   c.overlap_events)
        if failure is None:
            if transfers.sums is None:
                return {}
            return {(addr - handle.address) // c.block_size: transfers.sums[i]
                    for i, (addr, n, _) in enumerate(transfers)
                    if n == min(c.block_size, handle.nbytes - (addr - handle.address))}
        index, result = failure
        if result < 0:
            raise _io_error(handle, str(self._file.path), code=-result)
        # a short transfer: finish it (and everything after it, which may not have been submitted) synchronously
        for addr, n, off in transfers[index:]:
            self._sync(handle, memory_at(addr, n), off, is_write)
        return {}

    def _sync(self, handle: SwapHandle, view: memoryview, offset: int, is_write: bool) -> None:
        """Moves the whole view with pread/pwrite, continuing after partial transfers; no progress is an error."""
        op = self._io.pwrite if is_write else self._io.pread
        done, total = 0, len(view)
        while done < total:
            try:
                n = op(self._file.fd, view[done:], offset + done)
            except OSError as exc:
                raise _io_error(handle, str(self._file.path), exc) from None
            if n <= 0 or (self._file.direct and n % PAGE and done + n < total):
                raise ShortTransfer(errno.ENOSPC if is_write else errno.EIO,
                                    f"{handle.op.value} of key {handle.key!r} failed: short "
                                    f"{handle.op.value}, {done + max(n, 0)} of {total} bytes at offset {offset}",
                                    str(self._file.path))
            done += n

    def _bounced(self, handle: SwapHandle, extent: Extent, start: int, end: int, bounce: memoryview,
                 bounce_address: int, is_write: bool) -> None:
        """O_DIRECT through the aligned bounce buffer: for unaligned tensors and sub-page tails (a copy per block)."""
        bs = len(bounce)
        for o in range(start, end, bs):
            n = min(bs, end - o)
            padded = round_up(n, PAGE)
            if is_write:
                ctypes.memmove(bounce_address, handle.address + o, n)
                if padded > n:
                    bounce[n:padded] = bytes(padded - n)
                self._sync(handle, bounce[:padded], extent.offset + o, True)
            else:
                self._sync(handle, bounce[:padded], extent.offset + o, False)
                ctypes.memmove(handle.address + o, bounce_address, n)


class AiofilesWorkers:
    """Runs parts as aiofiles coroutines on a private event loop thread (the portable, buffered baseline)."""

    def __init__(self, file: SwapFile, config: AioConfig, resolve: Resolver,
                 on_bytes: Callable[[Op, int, int], None]) -> None:
        self._file, self._config, self._resolve, self._on_bytes = file, config, resolve, on_bytes
        self._loop = asyncio.new_event_loop()
        self._slots: asyncio.Semaphore | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="nvme_swapper-aiofiles", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._make_semaphore(), self._loop).result()

    async def _make_semaphore(self) -> None:
        self._slots = asyncio.Semaphore(self._config.queue_depth)

    def submit(self, parts: list[Part]) -> None:
        for part in parts:
            asyncio.run_coroutine_threadsafe(self._run(part), self._loop)

    def close(self) -> None:
        """Joins aiofiles' executor threads and the loop's thread (on that loop: the caller may be inside an event
        loop of its own, where no other loop can run), then closes the loop; a close cut short is finished by the
        next call."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        if not self._loop.is_closed():
            self._loop.close()

    async def _run(self, part: Part) -> None:
        import aiofiles

        handle = part.handle
        if handle.after is not None:
            await asyncio.wait([asyncio.wrap_future(handle.after._future)])  # ordering only: its error is its own
        error = None
        try:
            if not handle.failed():
                extent = self._resolve(handle)
                is_write = handle.op is Op.WRITE
                path = str(self._file.path)
                flags = os.O_DSYNC if is_write else 0
                view = memory_at(handle.address + part.start, part.end - part.start)
                assert self._slots is not None
                async with self._slots:
                    async with aiofiles.open(path, "r+b", buffering=0,
                                             opener=lambda p, f: os.open(p, f | flags)) as f:
                        await f.seek(extent.offset + part.start)
                        n = await (f.write(view) if is_write else f.readinto(view))
                        if n != len(view):
                            raise ShortTransfer(errno.EIO, f"{handle.op.value} of key {handle.key!r} failed: short "
                                                           f"{handle.op.value}, {n} of {len(view)} bytes", path)
                        if is_write:
                            os.posix_fadvise(f.fileno(), extent.offset + part.start, len(view),
                                             os.POSIX_FADV_DONTNEED)
                _checksum_part(handle, part.start, part.end, self._config.block_size, path)
                self._on_bytes(handle.op, len(view), 0)
        except OSError as exc:  # named as the other backends name it: the key, the swap file
            error = exc if exc.filename else _io_error(handle, str(self._file.path), exc)
        except BaseException as exc:
            error = exc
        handle.part_done(error)
