"""FileArena: host tensors whose memory is a shared mapping of a file, so that together they can outgrow RAM.

A tensor made by ``arena.tensor(shape, dtype)`` lives in its own page-aligned range of the arena's file, mapped
shared: it is read and written like any host tensor, and its pages can be dropped from RAM at any moment with
:func:`evict_pages`, which writes them to the file and drops them from the page cache too (the next access reads
them back). Leaving them cached would fill the page cache with the whole model, scattering the memory the engine
then allocates its I/O buffers from (fewer huge pages for them: measured 1.1 GiB fewer at 3.8B). The file is
unlinked as soon as it is made: its space lives exactly as long as the tensors do, and a crash leaves nothing on
disk. A tensor's range gives its disk space back (a hole punched in the file) when its last view is gone, so a
model moving out of the arena parameter by parameter frees the disk as it goes. ``close()`` ends making tensors;
the descriptor stays open while tensors made before use it.

Knows nothing of training: ``offload.init`` builds a model's parameters here so the model never needs its size in
RAM (see offload/_init.py).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from ._buffers import PAGE, round_up

_FALLOC_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (Linux)
_LIBC = ctypes.CDLL(None, use_errno=True)
_lock = threading.Lock()
_starts: list[int] = []  # start addresses of live regions, sorted
_regions: dict[int, "weakref.ref[_FileRegion]"] = {}


class _File:
    """The arena's file descriptor, closed when the arena and every region using it are gone."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        os.close(self.fd)


class _FileRegion:
    """One shared mapping of part of an arena's file; unmapped when the last tensor viewing it is gone."""

    def __init__(self, file: _File, offset: int, nbytes: int) -> None:
        self.length = round_up(max(nbytes, 1), PAGE)
        self._file, self.offset = file, offset
        self._map = mmap.mmap(file.fd, self.length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=offset)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.nbytes = nbytes
        with _lock:
            bisect.insort(_starts, self.address)
            _regions[self.address] = weakref.ref(self)

    def tensor(self) -> torch.Tensor:
        array = (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.address)
        array._region = self  # type: ignore[attr-defined]  # the storage -> array -> region keeps the mapping
        return torch.frombuffer(array, dtype=torch.uint8)[: self.nbytes]

    def evict(self) -> None:
        """Writes the dirty pages to the file, unmaps them, and drops them from the page cache as well."""
        self._map.flush()
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._file.fd, self.offset, self.length, os.POSIX_FADV_DONTNEED)

    def __del__(self) -> None:
        with _lock:  # no other region can start here until the mapping below is closed
            if _regions.pop(self.address, None) is not None:
                _starts.remove(self.address)
        self._map.close()
        _punch_hole(self._file.fd, self.offset, self.length)


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Frees the disk blocks of a range no tensor uses any more. Best effort: without fallocate's punch-hole
    (another OS, some filesystems) the space comes back when the file closes."""
    fallocate = getattr(_LIBC, "fallocate", None)
    if fallocate is not None:
        fallocate(fd, _FALLOC_PUNCH, ctypes.c_int64(offset), ctypes.c_int64(length))


def _region_of(t: torch.Tensor) -> _FileRegion | None:
    if t.device.type != "cpu" or not _starts:
        return None
    ptr = t.data_ptr()
    with _lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        if i < 0:
            return None
        ref = _regions.get(_starts[i])
    region = ref() if ref is not None else None
    return region if region is not None and ptr < region.address + region.length else None


def in_arena(t: torch.Tensor) -> bool:
    """True when ``t``'s memory is a :class:`FileArena`'s."""
    return _region_of(t) is not None


def arena_device(t: torch.Tensor) -> int | None:
    """The device number (``st_dev``) of the filesystem holding the arena file ``t`` lives in; None for a tensor
    not in an arena. Space there comes back as such tensors die."""
    region = _region_of(t)
    return os.fstat(region._file.fd).st_dev if region is not None else None


def evict_pages(t: torch.Tensor) -> bool:
    """Drops the RAM pages of the arena range ``t`` lives in (its contents stay: the file has them); False, and
    nothing done, for a tensor not in an arena."""
    region = _region_of(t)
    if region is None:
        return False
    region.evict()
    return True


class FileArena:
    """Makes file-backed tensors in ``directory`` (see the module docstring). ``close()`` closes the descriptor."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        root = Path(directory)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(root, os.O_TMPFILE | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
        except (AttributeError, OSError):  # no O_TMPFILE here: a named file, unlinked at once
            fd, name = tempfile.mkstemp(prefix=".arena-", dir=root)
            os.unlink(name)
        self._file: _File | None = _File(fd)
        self.size = 0
        self.directory = root

    def tensor(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new file-backed tensor (zeros). Raises OSError (ENOSPC) when the disk cannot hold it."""
        if self._file is None:
            raise RuntimeError("FileArena is closed")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        offset, self.size = self.size, self.size + round_up(max(nbytes, 1), PAGE)
        os.posix_fallocate(self._file.fd, offset, self.size - offset)  # the disk's space now: ENOSPC here
        return _FileRegion(self._file, offset, nbytes).tensor().view(dtype).view(tuple(shape))

    def close(self) -> None:
        """No more tensors from this arena; the file stays open while tensors made before use it."""
        self._file = None

    def __enter__(self) -> "FileArena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
