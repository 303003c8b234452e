"""Giving the C heap's free pages back to the OS during backward, when the device is the CPU.

With the device tier in CPU memory, autograd's tensors come from glibc's malloc. A freed tensor below the mmap
threshold (which glibc raises to the size of the largest freed mmapped chunk, up to 32 MiB) returns to the heap,
and the heap keeps its pages resident: glibc gives memory back only from the top of the heap. Backward frees the
forward's activations one by one while it allocates gradients, so on a ~100M GPT the heap held about 390 MB of
free but resident pages at the step's peak, a third of the process's RSS (``mallinfo2``: heap in use 131 MB,
free 388 MB). ``malloc_trim(0)`` returns the free pages of every arena (MADV_DONTNEED on each free chunk); it is
the CPU's counterpart of emptying CUDA's caching allocator, and changes no allocator setting.

:class:`HeapTrim` calls it at the start of backward and once half of the gradient bytes have arrived, so the
activations backward has already freed stop counting before its later allocations. The price: the released pages
fault back in when the heap is reused (about 3 us a page on this VM), so trims are few. On that GPT, trims at the
start and after each quarter faulted 264K pages a step against 139K without trimming, start and half 216K, for
the same peak (1.01 GiB against 1.21; docs/architecture.md "Host heap"). No trim when the last gradient arrives:
the peak has passed and the next forward would fault back all it released. glibc only: :func:`available` says
whether this process's C library has it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Any

_TRIM: Any = None  # malloc_trim, once looked up; False where the C library has none


def _malloc_trim() -> Any:
    global _TRIM
    if _TRIM is None:
        try:
            fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            fn = False
        else:
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        _TRIM = fn
    return _TRIM


def available() -> bool:
    """Whether this process's C library can return free heap pages (glibc's ``malloc_trim``)."""
    return bool(_malloc_trim())


class HeapTrim:
    """Returns the heap's free pages at the start of backward and once half of ``gradient_bytes`` have arrived."""

    def __init__(self, gradient_bytes: int) -> None:
        if not available():
            raise RuntimeError("this C library has no malloc_trim (glibc only); set offload.trim_host_heap to false")
        self.half = max(1, gradient_bytes // 2)
        self._since = 0
        self.trims = 0
        self.seconds = 0.0

    def begin_backward(self) -> None:
        """The forward's freed temporaries go back before backward allocates."""
        self._since = 0
        self._trim()

    def add(self, nbytes: int) -> None:
        """A gradient of ``nbytes`` arrived: trim when it takes this backward's total past half."""
        before, self._since = self._since, self._since + nbytes
        if before < self.half <= self._since:
            self._trim()

    def _trim(self) -> None:
        t = time.perf_counter()
        _malloc_trim()(0)
        self.seconds += time.perf_counter() - t
        self.trims += 1

    def stats(self) -> dict[str, Any]:
        return {"trims": self.trims, "seconds": self.seconds}
