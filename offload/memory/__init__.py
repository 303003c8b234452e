"""The tiers: budgets and accounting (``_tiers``), the staging-buffer pool (``_pool``), and the tiered store that
places and moves bytes across DEVICE, HOST and NVME (``_store``)."""

from ._pool import BufferPool
from ._store import Residency, TieredStore, Transfer, default_host_budget, prepare_nvme_path
from ._tiers import BUDGET_KEYS, BudgetExceeded, Tier, TierAccount, fmt_bytes

__all__ = ["BUDGET_KEYS", "BudgetExceeded", "BufferPool", "Residency", "Tier", "TierAccount", "TieredStore", "Transfer",
           "default_host_budget", "fmt_bytes", "prepare_nvme_path"]
