"""The tiers: budgets and accounting (``_tiers``), the staging-buffer pool (``_pool``), the tiered store that
places and moves bytes across DEVICE, HOST and NVME (``_store``), the one owner of NVMe storage that every NVMe user
is an instance of (``_nvme``: claim, swap file, counted part reads and writes), the device<->host copies with their
streams, events and pinned staging (``_copies``), and the C heap's free pages returned during backward on a CPU
device (``_heap``)."""

from ._nvme import NvmeSpace
from ._pool import BufferPool
from ._store import Residency, TieredStore, Transfer, default_host_budget, prepare_nvme_path
from ._tiers import BUDGET_KEYS, BudgetExceeded, Tier, TierAccount, fmt_bytes
from ._copies import DONE, AllOf, Copy, StagingArena, StagingRing, CopyStreams, arena_span, start_all, wait_all
from ._heap import HeapTrim

__all__ = ["BUDGET_KEYS", "DONE", "AllOf", "BudgetExceeded", "BufferPool", "Copy", "CopyStreams", "HeapTrim",
           "NvmeSpace", "Residency", "StagingArena", "StagingRing", "Tier", "TierAccount", "TieredStore", "Transfer",
           "arena_span", "default_host_budget", "fmt_bytes", "prepare_nvme_path", "start_all", "wait_all"]
