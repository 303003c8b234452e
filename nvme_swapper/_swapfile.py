"""One swap file: its descriptor, its extents and its free space.

Layout: a single file per engine. Page 0 is a header (written at creation; it also probes whether the filesystem
takes O_DIRECT). Every stored tensor occupies one extent: a page-aligned byte range. The engine never overwrites a
live extent in place: a write goes to a free extent and the key moves to it only once the write has completed, so a
failed or interrupted write leaves the previous content readable. The extent the key left becomes free space that
the next write reuses; reusing written space is what keeps writes fast here (writing fresh, unwritten blocks ran
2.5x slower than overwriting on this kind of disk). So steady-state training, which rewrites the same keys every
step, needs the live bytes plus the bytes of the writes in flight, and runs at overwrite speed.

Free space is kept in two forms. An extent a key left is kept whole, listed by its length: the next write of a key
of that length takes it back, so keys of different sizes written over and over (sub-groups and a smaller last one,
parameters of many shapes) never split each other's space, and the file needs no more than the live bytes plus,
for each length, the writes of that length in flight at once (:func:`cow_spare` counts them). The rest (space
reserved, space of deleted keys) is kept best-fit and coalesced, and lengths with no extent of their own take from
it, then from the kept extents merged back. The file grows with fallocate only when nothing fits, so a full disk
shows as ENOSPC when the write is issued rather than as a short write later. ``release`` (used by delete) returns
space to the filesystem: the file is truncated when the space is at its end, otherwise the range is punched out.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ._buffers import PAGE, aligned_tensor, round_up
from ._native import FileIO, memory_at

log = logging.getLogger(__name__)

MAGIC = b"nvme_swapper swap file v1\n"
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def cow_spare(groups: Iterable[Iterable[int]], writes: int) -> int:
    """Bytes a swap file needs beside its live keys for copy-on-write rewrites, with the extents keys leave kept
    per length (:meth:`SwapFile.free`): keys are rewritten in ``groups`` (the byte sizes of the keys of one group
    are written together), at most ``writes`` groups at once; each page-rounded length needs one spare extent per
    key of that length in the ``writes`` groups that hold the most of them."""
    per_length: dict[int, list[int]] = collections.defaultdict(list)
    for group in groups:
        for length, count in collections.Counter(round_up(n, PAGE) for n in group if n > 0).items():
            per_length[length].append(count)
    return sum(length * sum(sorted(counts, reverse=True)[:writes]) for length, counts in per_length.items())


def swap_file_bytes(groups: Iterable[Iterable[int]], writes: int, singles: Iterable[int] = ()) -> int:
    """The most a swap file takes for keys of these byte sizes, when :meth:`SwapEngine.reserve` made it that
    large first (as the offload store does): each key in whole pages, the header page, and the room of their
    rewrites (:func:`cow_spare`): ``groups`` rewritten together, ``writes`` groups at once, and ``singles`` one at a
    time. A file grown write by write may fragment past it (a smaller key splitting a hole another length needs)."""
    groups, singles = [list(g) for g in groups], [[n] for n in singles]
    live = sum(round_up(n, PAGE) for group in groups + singles for n in group)
    return live + PAGE + cow_spare(groups, writes) + cow_spare(singles, 1)


@dataclass(frozen=True)
class Extent:
    offset: int
    length: int  # capacity in bytes, a multiple of PAGE


class SwapFile:
    """Owns one file descriptor and the allocation of the file's bytes. Thread-safe."""

    def __init__(self, path: Path, io: FileIO, *, o_direct: bool) -> None:
        self.path = path
        self._io = io
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = []  # (offset, length), sorted by offset, coalesced
        self._kept: dict[int, list[int]] = {}  # length -> offsets of extents keys left, for keys of that length
        self.direct = False
        self.fallback_reason: str | None = None
        base = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.fd = -1
        try:
            if o_direct:
                try:
                    self.fd = io.open(str(path), base | os.O_DIRECT, 0o600)
                    self._write_header()
                    self.direct = True
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    self.fallback_reason = (f"{path.parent} refuses O_DIRECT ({os.strerror(exc.errno)}); using "
                                            "buffered I/O")
                    self._discard()
            else:
                self.fallback_reason = "O_DIRECT disabled by AioConfig(o_direct=False)"
            if not self.direct:
                self.fd = io.open(str(path), base, 0o600)
                self._write_header()
        except BaseException:  # (an interrupt too): no file or fd is left
            self._discard()
            raise
        self.size = PAGE

    def _write_header(self) -> None:
        page = aligned_tensor(PAGE, pin_memory=False)
        view = memory_at(page.data_ptr(), PAGE)
        view[: len(MAGIC)] = MAGIC
        written = self._io.pwrite(self.fd, view, 0)
        if written != PAGE:
            raise OSError(errno.EIO, f"short write of the header of {self.path}: {written} of {PAGE} bytes")

    def _discard(self) -> None:
        if self.fd >= 0:
            self._io.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # allocation -------------------------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> Extent:
        """A free extent of at least ``nbytes`` (page-rounded); grows the file when nothing fits (OSError ENOSPC)."""
        length = round_up(nbytes, PAGE)
        if length == 0:
            return Extent(0, 0)
        with self._lock:
            kept = self._kept.get(length)
            if kept:
                return Extent(kept.pop(), length)
            extent = self._best_fit(length)
            if extent is None and self._kept:  # other lengths' kept extents, merged back, before the file grows
                self._merge_kept()
                extent = self._best_fit(length)
            if extent is not None:
                return extent
            # grow: extend a free run that ends at the end of the file, or append
            tail = bool(self._free) and sum(self._free[-1]) == self.size
            start = self._free[-1][0] if tail else self.size
            self._grow(start + length)  # (a failed growth leaves the free run where it was)
            if tail:
                self._free.pop()
            return Extent(start, length)

    def _merge_kept(self) -> None:
        for ln, offsets in self._kept.items():
            for off in offsets:
                self._insert_free(off, ln)
        self._kept.clear()

    def _best_fit(self, length: int) -> Extent | None:
        best = None
        for i, (off, ln) in enumerate(self._free):
            if ln >= length and (best is None or ln < self._free[best][1]):
                best = i
                if ln == length:
                    break
        if best is None:
            return None
        off, ln = self._free.pop(best)
        if ln > length:
            self._free.insert(best, (off + length, ln - length))
        return Extent(off, length)

    def _grow(self, new_size: int) -> None:
        try:
            self._io.fallocate(self.fd, self.size, new_size - self.size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._io.truncate(self.fd, new_size)  # no fallocate here: a sparse file, filled by the writes
            else:
                self._io.truncate(self.fd, self.size)  # give back blocks a failed fallocate may have taken
                raise OSError(exc.errno, f"cannot grow swap file {self.path} to {new_size} bytes: "
                                         f"{os.strerror(exc.errno)}", str(self.path)) from None
        self.size = new_size

    def free(self, extent: Extent) -> None:
        """Keeps an extent a key left, with its blocks, for the next write of that length (an overwrite)."""
        if extent.length == 0:
            return
        with self._lock:
            kept = self._kept.setdefault(extent.length, [])
            assert extent.offset not in kept, "double free of a swap extent"
            kept.append(extent.offset)

    def _insert_free(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (offset, 0))
        assert i == len(self._free) or self._free[i][0] >= offset + length, "double free of a swap extent"
        assert i == 0 or sum(self._free[i - 1]) <= offset, "double free of a swap extent"
        if i < len(self._free) and self._free[i][0] == offset + length:
            length += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:
            offset, length = self._free[i - 1][0], self._free[i - 1][1] + length
            self._free.pop(i - 1)
            i -= 1
        self._free.insert(i, (offset, length))

    def release(self, extent: Extent) -> None:
        """Frees an extent and gives its blocks back to the filesystem (used when a key is deleted)."""
        if extent.length == 0:
            return
        with self._lock:
            self._insert_free(extent.offset, extent.length)
            self._merge_kept()  # (a delete is rare: the space at the end goes back whole)
            off, ln = self._free[-1]
            if off + ln == self.size:
                self._free.pop()
                self._io.truncate(self.fd, off)
                self.size = off
            elif not _punch_hole(self.fd, extent.offset, extent.length):
                log.debug("cannot punch a hole in %s; its space is reused but not returned", self.path)

    def reserve(self, nbytes: int, chunk: int = 64 << 20) -> None:
        """Adds ``nbytes`` of free space whose blocks are already written (zeros), so first writes into it run at
        overwrite speed, and a disk too small for the plan fails now rather than mid-training."""
        length = round_up(nbytes, PAGE)
        if length <= 0:
            return
        extent = self.allocate(length)
        zeros = aligned_tensor(min(chunk, length), pin_memory=False)
        view = memory_at(zeros.data_ptr(), zeros.numel())
        done = 0
        try:
            while done < length:
                n = min(len(view), length - done)
                try:
                    wrote = self._io.pwrite(self.fd, view[:n], extent.offset + done)
                except OSError as exc:
                    raise OSError(exc.errno, f"writing {length} bytes of zeros to reserve space in {self.path} "
                                             f"failed after {done}: {os.strerror(exc.errno or 0)}",
                                  str(self.path)) from None
                if wrote != n:
                    raise OSError(errno.ENOSPC, f"short write reserving space in {self.path}")
                done += n
        finally:
            with self._lock:
                self._insert_free(extent.offset, extent.length)  # for any length

    # accounting and lifetime ------------------------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(ln for _, ln in self._free) + sum(ln * len(offs) for ln, offs in self._kept.items())

    def close(self, remove: bool) -> None:
        if self.fd >= 0:
            self._io.close(self.fd)
            self.fd = -1
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


_libc = None


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0
