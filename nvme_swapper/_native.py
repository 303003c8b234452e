"""The OS-call boundary of the swap engine: every read and write of a swap file passes through :class:`FileIO`.

Two ways to move bytes live here:

* kernel AIO (``_aio.c``, compiled with the system C compiler on first use, cached, loaded with ctypes, which drops
  the GIL for the call): one thread keeps ``depth`` O_DIRECT requests in flight;
* ``os.preadv`` / ``os.pwritev`` (release the GIL too): one request in flight per thread; used where the C compiler
  or kernel AIO is missing, for buffered files, and for the sub-page tails that go through a bounce buffer.

Keeping every syscall in one small class gives the fault-injection tests a single seam (they subclass it to fail a
chosen call with ENOSPC, EIO or a short count) without touching the engine under test.

Block checksums (``swp_hash`` in ``_aio.c``, vectorized with AVX2 or SSE2, 10-30 GB/s on one core) come from the
same compiled library; the kernel-AIO runner computes them while the I/O is in flight (writes) or as each read
completes. Where the library cannot be built, :func:`checksum` falls back to ``zlib.crc32`` (about 4 GB/s). One
process uses one of the two for its whole life, and checksums live only in memory, so the two never meet.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_aio.c")
_lib: ctypes.CDLL | None = None  # built and loaded
_lib_error: str | None = None  # why it could not be built
_aio_ok: bool | None = None  # whether kernel AIO works here (io_setup probed once)
_aio_error: str | None = None
_lib_lock = threading.Lock()


def cache_dir() -> Path:
    """Where compiled helpers are cached: ``$OFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/offload``, else ~/.cache."""
    root = os.environ.get("OFFLOAD_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "offload" if xdg else Path.home() / ".cache" / "offload"


_FLAGS = ("-O3", "-shared", "-fPIC")


def build_key(compiler: str, *inputs: bytes) -> str:
    """16 hex digits naming a build in the cache: the compiler as it resolves (``/usr/bin/cc`` names no version;
    its target does) and every input of the build (source, flags, ABI), so identical inputs share one build."""
    found = shutil.which(compiler)
    identity = os.path.realpath(found) if found else compiler
    return hashlib.sha256(b"\0".join([identity.encode(), *inputs])).hexdigest()[:16]


def _build() -> ctypes.CDLL:
    """The library from the cache, compiled first where it is not there: named after a hash of the source, the flags
    and the compiler, so every install of the same source shares one build and a changed one never loads an old
    one; written under a temporary name and renamed, so a concurrent or killed build never leaves a half-written
    library under the real one. A build says so (a warning: the first run waits on it), a cache hit says nothing."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    tag = build_key(compiler, _SOURCE.read_bytes(), " ".join(_FLAGS).encode(), sys.platform.encode())
    target = cache_dir() / "nvme_swapper" / f"aio-{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        log.warning("nvme_swapper: building its C helper (kernel AIO, checksums) as %s, once per source version...",
                    target)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            cmd = [compiler, *_FLAGS, "-o", tmp, str(_SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
            os.replace(tmp, target)  # atomic: a concurrent build never sees a half-written library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    u64p, i64p, lp = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_long)
    lib.swp_setup.argtypes = [ctypes.c_long, u64p]
    lib.swp_destroy.argtypes = [ctypes.c_uint64]
    lib.swp_run.argtypes = [ctypes.c_uint64, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_long,
                            u64p, u64p, i64p, ctypes.c_int, ctypes.c_int, lp, lp, u64p]
    for fn in (lib.swp_setup, lib.swp_destroy, lib.swp_run):
        fn.restype = ctypes.c_long
    lib.swp_hash.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    lib.swp_hash.restype = ctypes.c_uint64
    lib.swp_hash_isa.restype = ctypes.c_char_p
    lib.swp_hash_variant.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, u64p]
    lib.swp_hash_variant.restype = ctypes.c_int
    return lib


def _library() -> ctypes.CDLL | None:
    """The compiled helper library, or None (with the reason logged once) when it cannot be built here."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is None and _lib_error is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError) as exc:
                _lib_error = str(exc)
                log.warning("nvme_swapper C helper unavailable (threaded pread/pwrite, zlib checksums): %s", exc)
        return _lib


def kernel_aio() -> ctypes.CDLL | None:
    """The compiled kernel-AIO runner, or None (with the reason logged once) when it cannot be built or used here."""
    global _aio_ok, _aio_error
    lib = _library()
    if lib is None:
        return None
    with _lib_lock:
        if _aio_ok is None:
            probe = ctypes.c_uint64()
            err = lib.swp_setup(1, ctypes.byref(probe))
            _aio_ok = err == 0
            if err:
                _aio_error = f"io_setup: {os.strerror(-err)}"
                log.warning("kernel AIO unavailable, using threaded pread/pwrite: %s", _aio_error)
            else:
                lib.swp_destroy(probe.value)
        return lib if _aio_ok else None


def kernel_aio_error() -> str | None:
    return _lib_error or _aio_error


def checksum(address: int, nbytes: int) -> int:
    """The checksum of ``nbytes`` of host memory at ``address`` (the C hash, or zlib.crc32 without the library)."""
    lib = _library()
    if lib is not None:
        return int(lib.swp_hash(address, nbytes))
    return zlib.crc32(memory_at(address, nbytes))


def tensor_checksum(t: Any) -> int:
    """:func:`checksum` of a contiguous host tensor's bytes: equal bytes give equal checksums in every process that
    computes the same :func:`checksum_kind` (ranks comparing their copies of a model use it)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        raise ValueError(f"tensor_checksum needs a contiguous host tensor, got one on {t.device} "
                         f"(contiguous: {t.is_contiguous()}, lazy conjugate or negative view: "
                         f"{t.is_conj() or t.is_neg()}); pass .contiguous().cpu().resolve_conj().resolve_neg()")
    return checksum(t.data_ptr(), t.numel() * t.element_size())


def checksum_kind() -> str:
    """Which checksum :func:`checksum` computes in this process: "swp_hash" (C) or "crc32" (the fallback)."""
    return "swp_hash" if _library() is not None else "crc32"


HASH_VARIANTS = ("scalar", "sse2", "avx2")


def checksum_isa() -> str | None:
    """The instructions ``swp_hash`` runs with here ("avx2", "sse2" or "scalar"), None without the C helper."""
    lib = _library()
    return lib.swp_hash_isa().decode() if lib is not None else None


def checksum_variants(address: int, nbytes: int) -> dict[str, int]:
    """``swp_hash`` of the bytes by each variant this CPU runs, by name: they must all agree (tests)."""
    lib, out, value = _library(), {}, ctypes.c_uint64()
    if lib is not None:
        for i, name in enumerate(HASH_VARIANTS):
            if lib.swp_hash_variant(i, address, nbytes, ctypes.byref(value)) == 0:
                out[name] = value.value
    return out


class Transfers(list):
    """(address, length, offset) transfers for :meth:`FileIO.aio_run`. When ``sums`` is a ctypes uint64 array of
    the same length, the runner stores each transfer's checksum there. A FileIO subclass that hands a different
    list to ``FileIO.aio_run`` must report a failure for it (the caller then recomputes the checksums)."""

    sums: ctypes.Array | None = None


class ShortTransfer(OSError):
    """A read or write moved fewer bytes than asked (a truncated file, a full disk, a failing device)."""


class FileIO:
    """The syscalls the engine makes on swap files. One instance per engine; methods are thread-safe."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.pwritev(fd, [buf], offset)

    def aio_setup(self, depth: int) -> int:
        lib = kernel_aio()
        if lib is None:
            raise RuntimeError(f"kernel AIO unavailable: {_lib_error}")
        ctx = ctypes.c_uint64()
        err = lib.swp_setup(depth, ctypes.byref(ctx))
        if err:
            raise OSError(-err, f"io_setup({depth}): {os.strerror(-err)}")
        return ctx.value

    def aio_destroy(self, ctx: int) -> None:
        lib = kernel_aio()
        if lib is not None:
            lib.swp_destroy(ctx)

    def aio_run(self, ctx: int, depth: int, fd: int, is_write: bool, transfers: list[tuple[int, int, int]],
                single_submit: bool = False, overlap: bool = True) -> tuple[int, int] | None:
        """Moves (address, length, offset) transfers; None on success, else (index, result) of the first failure,
        result being a negative errno or the short byte count. Fills ``transfers.sums`` (see :class:`Transfers`)."""
        lib = kernel_aio()
        if lib is None:
            raise RuntimeError(f"kernel AIO unavailable: {_lib_error}")
        n = len(transfers)
        bufs, lens, offs = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)(), (ctypes.c_int64 * n)()
        for i, (addr, length, offset) in enumerate(transfers):
            bufs[i], lens[i], offs[i] = addr, length, offset
        bad_index, bad_result = ctypes.c_long(), ctypes.c_long()
        sums = getattr(transfers, "sums", None)
        rc = lib.swp_run(ctx, depth, fd, int(is_write), n, bufs, lens, offs, int(single_submit), int(overlap),
                         ctypes.byref(bad_index), ctypes.byref(bad_result), sums)
        return None if rc == 0 else (bad_index.value, bad_result.value)


def writable(address: int, nbytes: int) -> bool:
    """Whether the first and last byte of host memory can be written, as the kernel sees it: a read(2) into
    read-only memory (a read-only memory map) fails with EFAULT where a copy from Python would crash the process.
    The bytes keep their values."""
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        for a in sorted({address, address + nbytes - 1}) if nbytes else ():
            value = ctypes.string_at(a, 1)
            try:
                os.readv(fd, [memory_at(a, 1)])
            except OSError as exc:
                if exc.errno == errno.EFAULT:
                    return False
                raise
            ctypes.memmove(a, value, 1)
    finally:
        os.close(fd)
    return True


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of host memory owned by someone else (a tensor the caller keeps alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
