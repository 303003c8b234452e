"""Page-aligned host tensors that the swap engine can read into and write from directly, page-locked for CUDA.

O_DIRECT needs the memory address, the file offset and the length aligned to the device's logical block, and the
disk here takes at most 254 segments per request: a buffer scattered over 4 KiB pages reads at less than half the
speed of a physically contiguous one. So I/O buffers and optimizer state are allocated here, once and large: an
anonymous ``mmap`` aligned to 2 MiB (4 KiB when small) with transparent huge pages requested (``MADV_HUGEPAGE``),
prefaulted once so that no page fault lands in a timed loop later.

With ``pin_memory`` the same mapping is page-locked and registered with CUDA (``cudaHostRegister``), so device
copies from and to it run asynchronously at full PCIe speed. torch's own pinned allocator is not used: it rounds
every block up to a power of two (20 GiB asked can pin 32 GiB) and does not promise page alignment. Here the bytes
pinned are the bytes asked, rounded up to one page, and ``pinned_bytes()`` counts them.

The memory lives as long as the returned tensor and any view of it: the tensor's storage holds a
:class:`_HostRegion`, which unregisters and unmaps the memory when the last view dies.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import torch

PAGE = 4096
"""Alignment of addresses, offsets and lengths for O_DIRECT (the largest logical block size in common use)."""

HUGE_PAGE = 2 << 20

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as torch's own pinned memory is
_pinned_lock = threading.Lock()
_pinned = 0


def pinned_bytes() -> int:
    """Bytes of host memory this process has page-locked through :func:`aligned_tensor` and not yet freed."""
    with _pinned_lock:
        return _pinned


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def is_aligned(t: torch.Tensor, alignment: int = PAGE) -> bool:
    """True when the tensor's first byte sits on an ``alignment`` boundary."""
    return t.data_ptr() % alignment == 0


def _clear_last_cuda_error() -> None:
    """Resets CUDA's last-error state after a failed call: torch checks it after every kernel launch, so a refused
    registration would otherwise be reported again, as the error of an unrelated kernel, after the caller has
    handled it (by unpinned buffers, say). torch does not bind cudaGetLastError; the runtime it loaded does."""
    try:
        major = (torch.version.cuda or "").split(".")[0]
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
    except (OSError, AttributeError):
        pass


class _HostRegion:
    """One anonymous mapping, aligned, optionally registered with CUDA; unregistered (then unmapped) when the last
    tensor viewing it is gone. Tensors keep it alive through the ctypes array they are built on."""

    def __init__(self, nbytes: int, alignment: int, *, pin: bool) -> None:
        self.nbytes = nbytes
        self.pinned = 0
        length = round_up(max(nbytes, 1), PAGE) + (alignment - PAGE)
        self._map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.address = base + (-base % alignment)
        if self.address % alignment:
            raise RuntimeError(f"aligned_tensor: the mapping at {self.address:#x} is not {alignment}-byte aligned")
        if alignment == HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # THP disabled ("never"): small pages still work, only slower for large I/O
        if pin:
            self._register(round_up(max(nbytes, 1), PAGE))

    def _register(self, nbytes: int) -> None:
        global _pinned
        if hasattr(mmap, "MADV_DONTFORK"):  # a forked child (a DataLoader worker) must not make these pages
            self._map.madvise(mmap.MADV_DONTFORK)  # copy-on-write: the GPU's copies would land in the child's
        self.device = torch.cuda.current_device()
        error = int(torch.cuda.cudart().cudaHostRegister(self.address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        if error:
            _clear_last_cuda_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {error}: the host cannot "
                               "page-lock that much memory (see ulimit -l and the memory free), or an earlier CUDA "
                               "error is being reported here; lower the host budget or set pin_memory to false")
        self.pinned = nbytes
        with _pinned_lock:
            _pinned += nbytes

    def tensor(self) -> torch.Tensor:
        """A flat uint8 tensor over the region's first ``max(nbytes, 1)`` bytes, holding the region alive."""
        array = (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.address)
        array._region = self  # type: ignore[attr-defined]  # the storage -> array -> region keeps the memory
        return torch.frombuffer(array, dtype=torch.uint8)

    def __del__(self) -> None:
        global _pinned
        if self.pinned:
            try:  # under the device it was registered on: the last view may die on a thread whose current
                with torch.cuda.device(self.device):  # device is another GPU, without a context there yet
                    torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception:  # noqa: BLE001 - interpreter exit: CUDA may be gone already
                pass
            with _pinned_lock:
                _pinned -= self.pinned
            self.pinned = 0
        self._map.close()


def aligned_tensor(
    shape: int | tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.uint8,
    *,
    pin_memory: bool | None = None,
    huge_pages: bool = True,
    prefault: bool = True,
) -> torch.Tensor:
    """A zero-filled, contiguous host tensor whose data starts on a page (2 MiB when large) boundary.

    ``pin_memory=None`` pins (registers with CUDA) when CUDA is available. The swap engine reads into such a tensor
    and writes from it without any extra copy; see :class:`nvme_swapper.SwapEngine` for what happens with other
    tensors. ``prefault=False`` (unpinned only: registering faults every page in) leaves the pages to be faulted in
    by their first writer: for a buffer that a read fills at once, the I/O thread then pays for the faults instead
    of the caller's thread.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"aligned_tensor: negative dimension in shape {shape}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    elif pin_memory and not torch.cuda.is_available():
        raise ValueError("aligned_tensor(pin_memory=True): pinning registers the memory with CUDA, which this "
                         "process does not have; pass pin_memory=False (or None: pinned where CUDA is)")
    alignment = HUGE_PAGE if huge_pages and nbytes >= HUGE_PAGE else PAGE
    body = _HostRegion(nbytes, alignment, pin=pin_memory).tensor()
    if prefault and not pin_memory:
        body.fill_(0)  # fault the (already zero) pages in now, as huge pages where granted, not inside a timed step
    return body[:nbytes].view(dtype).view(shape)
