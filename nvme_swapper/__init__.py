"""nvme_swapper: tensors <-> files with asynchronous, aligned O_DIRECT I/O.

Knows nothing of models or optimizers: it stores byte images of host tensors under string keys and moves them with
a pool of worker threads. See :class:`SwapEngine` for the contract and docs/architecture.md for the file layout.
"""

from ._buffers import aligned_tensor, is_aligned

__all__ = ["aligned_tensor", "is_aligned"]
