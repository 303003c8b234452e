"""Page-aligned host tensors that the swap engine can read into and write from directly.

O_DIRECT needs the memory address, the file offset and the length aligned to the device's logical block, and the
disk here takes at most 254 segments per request: a buffer scattered over 4 KiB pages reads at less than half the
speed of a physically contiguous one. So I/O buffers and optimizer state are allocated here, once and large:

* with CUDA: ``torch.empty(..., pin_memory=True)`` (page-locked, page-aligned, eligible for async H2D/D2H copies);
* without CUDA: an anonymous ``mmap`` aligned to 2 MiB with transparent huge pages requested (``MADV_HUGEPAGE``),
  prefaulted once so that no page fault lands in a timed loop later.

The memory lives as long as the returned tensor (and any view of it): the tensor holds the mapping.
"""

from __future__ import annotations

import mmap
import numpy as np
import torch

PAGE = 4096
"""Alignment of addresses, offsets and lengths for O_DIRECT (the largest logical block size in common use)."""

HUGE_PAGE = 2 << 20


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def is_aligned(t: torch.Tensor, alignment: int = PAGE) -> bool:
    """True when the tensor's first byte sits on an ``alignment`` boundary."""
    return t.data_ptr() % alignment == 0


def aligned_tensor(
    shape: int | tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.uint8,
    *,
    pin_memory: bool | None = None,
    huge_pages: bool = True,
    prefault: bool = True,
) -> torch.Tensor:
    """A zero-filled, contiguous host tensor whose data starts on a page (2 MiB when large) boundary.

    ``pin_memory=None`` pins when CUDA is available. The swap engine reads into such a tensor and writes from it
    without any extra copy; see :class:`nvme_swapper.SwapEngine` for what happens with other tensors.
    ``prefault=False`` (unpinned only) leaves the pages to be faulted in by their first writer: for a buffer that a
    read fills at once, the I/O thread then pays for the faults instead of the caller's thread.
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
    if pin_memory:
        t = torch.zeros(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % PAGE:
            raise RuntimeError("pinned allocation is not page-aligned; report this with your CUDA version")
        return t[:nbytes].view(dtype).view(shape)
    alignment = HUGE_PAGE if huge_pages and nbytes >= HUGE_PAGE else PAGE
    length = round_up(max(nbytes, 1), PAGE) + (alignment - PAGE)
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8)
    start = (-array.ctypes.data) % alignment
    if alignment == HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled ("never"): small pages still work, only slower for large I/O
    body = torch.from_numpy(array[start : start + nbytes])
    if prefault:
        body.fill_(0)  # fault the (already zero) pages in now, as huge pages where granted, not inside a timed step
    return body.view(dtype).view(shape)
