"""BufferPool: the staging buffers that NVMe-resident tensors pass through, allocated once and reused.

One large page-aligned (huge-page backed; pinned with CUDA) allocation carved into ``count`` equal slots, so every
I/O request is physically contiguous (this disk reads at half speed from scattered 4 KiB pages) and no step pays
for page faults. Its bytes are reserved on the HOST tier when the pool is made, so a pool that cannot fit fails at
initialize, not mid-step.
"""

from __future__ import annotations

import torch

from nvme_swapper import aligned_tensor

from ._tiers import TierAccount


class BufferPool:
    """``count`` slots of ``slot_bytes`` each; ``take``/``give`` hand out slot indices (single-threaded owner)."""

    def __init__(self, count: int, slot_bytes: int, account: TierAccount, *, pin_memory: bool, what: str,
                 fix: str = "") -> None:
        if count < 1:
            raise ValueError(f"{what}: a buffer pool needs at least one buffer, got {count}")
        self.slot_bytes = -(-slot_bytes // 4096) * 4096
        self.count = count
        self._account = account
        account.reserve(self.count * self.slot_bytes, what, fix)
        try:
            self._memory = aligned_tensor(self.count * self.slot_bytes, pin_memory=pin_memory)
        except BaseException:
            account.release(self.count * self.slot_bytes)
            raise
        self._free = list(range(count - 1, -1, -1))

    def slot(self, index: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first ``numel`` elements of slot ``index`` as a flat ``dtype`` tensor."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert nbytes <= self.slot_bytes, "a slot view larger than the slot"
        start = index * self.slot_bytes
        return self._memory[start : start + nbytes].view(dtype)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, index: int) -> None:
        assert index not in self._free, "a buffer given back twice"
        self._free.append(index)

    def close(self) -> None:
        if self._memory is not None:
            self._memory = None
            self._account.release(self.count * self.slot_bytes)
