"""nvme_swapper: tensors <-> files with asynchronous, aligned O_DIRECT I/O.

Knows nothing of models or optimizers: it stores the bytes of host tensors under string keys in a swap file and
moves them with worker threads (kernel AIO with several requests in flight per thread, or pread/pwrite), returning
handles to wait on. Start at :class:`SwapEngine`; docs/architecture.md explains the file layout. :func:`tune_aio`
measures a directory over block sizes, queue depths and thread counts and picks the fastest :class:`AioConfig`.
Beside them, what the training library built on it uses: checksums of memory, the owner records that tell a folder
of a process that ended without cleaning up (:func:`write_owner`, :func:`left_behind`, :func:`remove_left_behind`),
and the distribution's build cache (:func:`cache_dir`, :func:`build_key`).
"""

from ._arena import FileArena, arena_device, evict_pages, in_arena
from ._buffers import HUGE_PAGE, PAGE, aligned_tensor, is_aligned, pinned_bytes
from ._config import AioConfig
from ._engine import SwapEngine
from ._handle import SwapHandle
from ._native import FileIO, ShortTransfer, build_key, cache_dir, checksum, checksum_kind, memory_at, tensor_checksum
from ._owner import OWNER, alive, left_behind, remove_left_behind, remove_of_dead, write_owner
from ._swapfile import cow_spare, swap_file_bytes
from ._tune import TuneResult, grid, tune_aio

__all__ = ["AioConfig", "FileArena", "FileIO", "HUGE_PAGE", "OWNER", "PAGE", "ShortTransfer", "SwapEngine",
           "SwapHandle", "TuneResult", "aligned_tensor", "alive", "arena_device", "build_key", "cache_dir", "checksum",
           "checksum_kind", "cow_spare", "evict_pages", "grid", "in_arena", "is_aligned", "left_behind", "memory_at",
           "pinned_bytes", "remove_left_behind", "remove_of_dead", "swap_file_bytes", "tensor_checksum", "tune_aio",
           "write_owner"]
