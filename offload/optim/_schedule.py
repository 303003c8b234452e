"""The config's ``scheduler``: DeepSpeed's WarmupLR and WarmupDecayLR as a torch LR scheduler.

Optimizer step ``t`` (0 for the first update) uses ``lr(t) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g(t)``:

* during warm-up (``t < warmup_num_steps``): ``g(t) = log(t + 1) / log(warmup_num_steps)`` ("log", DeepSpeed's
  default) or ``t / warmup_num_steps`` ("linear");
* after it: ``g = 1`` (WarmupLR), or for WarmupDecayLR a linear decay to warmup_min_lr at ``total_num_steps``:
  ``g(t) = max(0, (total_num_steps - t) / max(1, total_num_steps - warmup_num_steps))``.

Being a ``torch.optim.lr_scheduler.LRScheduler``, it sets ``param_groups[i]["lr"]``, which the CPU Adam kernel
reads at every update, and its ``state_dict`` is plain numbers (checkpoints store it as JSON).
"""

from __future__ import annotations

import math
import warnings

import torch

from ..config import SchedulerConfig


class WarmupSchedule(torch.optim.lr_scheduler.LRScheduler):
    """WarmupLR (``total_num_steps`` None) or WarmupDecayLR; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig) -> None:
        self.min_lr, self.max_lr = cfg.warmup_min_lr, cfg.warmup_max_lr
        self.warmup, self.kind = cfg.warmup_num_steps, cfg.warmup_type
        self.total = cfg.total_num_steps if cfg.type == "warmupdecaylr" else None
        super().__init__(optimizer)

    def gamma(self, t: int) -> float:
        if t < self.warmup:
            if self.kind == "linear":
                return t / self.warmup
            return math.log(t + 1) / math.log(self.warmup) if self.warmup > 1 else 1.0
        if self.total is None:
            return 1.0
        return max(0.0, (self.total - t) / max(1, self.total - self.warmup))

    def step(self, epoch: int | None = None) -> None:
        """Advances one optimizer step. The engine also updates through ``launch`` (delayed update), which
        torch's check that the optimizer stepped first does not see: that warning does not apply here."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            super().step(epoch)

    def get_lr(self) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self.gamma(self.last_epoch)
        return [lr for _ in self.optimizer.param_groups]


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> WarmupSchedule | None:
    return None if cfg.type is None else WarmupSchedule(optimizer, cfg)
