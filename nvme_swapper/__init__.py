"""nvme_swapper: tensors <-> files with asynchronous, aligned O_DIRECT I/O.

Knows nothing of models or optimizers: it stores the bytes of host tensors under string keys in a swap file and
moves them with worker threads (kernel AIO with several requests in flight per thread, or pread/pwrite), returning
handles to wait on. Start at :class:`SwapEngine`; docs/architecture.md explains the file layout. :func:`tune_aio`
measures a directory over block sizes, queue depths and thread counts and picks the fastest :class:`AioConfig`.
"""

from ._arena import FileArena, arena_device, evict_pages, in_arena
from ._buffers import PAGE, aligned_tensor, is_aligned, pinned_bytes
from ._config import AioConfig
from ._engine import SwapEngine
from ._handle import SwapHandle
from ._native import FileIO, ShortTransfer, checksum_kind, tensor_checksum
from ._owner import remove_left_behind
from ._swapfile import cow_spare, swap_file_bytes
from ._tune import TuneResult, tune_aio

__all__ = ["AioConfig", "FileArena", "FileIO", "PAGE", "ShortTransfer", "SwapEngine", "SwapHandle", "TuneResult",
           "aligned_tensor", "arena_device", "checksum_kind", "cow_spare", "evict_pages", "in_arena", "is_aligned",
           "pinned_bytes", "remove_left_behind", "swap_file_bytes", "tensor_checksum", "tune_aio"]
