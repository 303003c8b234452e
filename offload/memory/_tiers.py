"""Tiers and their byte budgets: the accounting every allocation of the service goes through.

A budget is enforced, not advisory: ``reserve`` refuses bytes that would cross it with an error that says what was
asked for, what is in use, the budget, and which configuration key changes it. On a machine without CUDA the
DEVICE tier is CPU memory held to ``offload.device_memory_budget``, so "larger than device memory" stays real.
"""

from __future__ import annotations

import threading
from enum import Enum


class Tier(Enum):
    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


BUDGET_KEYS = {
    Tier.DEVICE: "offload.device_memory_budget",
    Tier.HOST: "offload.host_memory_budget",
    Tier.NVME: "offload.nvme_memory_budget",
}


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class BudgetExceeded(RuntimeError):
    """A tier's budget cannot hold what the configuration needs."""

    def __init__(self, tier: Tier, what: str, need: int, current: int, budget: int, fix: str = "") -> None:
        self.tier, self.need, self.current, self.budget = tier, need, current, budget
        advice = fix or f"raise {BUDGET_KEYS[tier]}"
        super().__init__(f"{tier.value} tier: {what} needs {fmt_bytes(need)} ({need} B) but {fmt_bytes(current)} of "
                         f"its budget of {fmt_bytes(budget)} ({budget} B) is in use; {advice}")


class TierAccount:
    """Current and peak bytes of one tier against its budget (None: unlimited). Thread-safe."""

    def __init__(self, tier: Tier, budget: int | None) -> None:
        self.tier = tier
        self.budget = budget
        self.current = 0
        self.peak = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str, fix: str = "") -> None:
        with self._lock:
            if self.budget is not None and self.current + nbytes > self.budget:
                raise BudgetExceeded(self.tier, what, nbytes, self.current, self.budget, fix)
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        with self._lock:
            assert nbytes <= self.current, f"{self.tier.value} tier released more than it holds"
            self.current -= nbytes

    def report(self) -> dict[str, int | None]:
        with self._lock:
            return {"current": self.current, "peak": self.peak, "budget": self.budget}
