"""The config's ``scheduler``: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR as a torch LR scheduler, step
for step.

DeepSpeed sets ``warmup_min_lr`` when it builds the scheduler and steps it after each update, so optimizer step
``t`` (0 for the first update) uses ``lr(t) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g(t - 1)``, with
``g(-1) = 0`` (the first two updates run at warmup_min_lr) and, for ``n = max(2, warmup_num_steps)``:

* during warm-up (``s < n``): ``g(s) = log(s + 1) / log(n)`` ("log", DeepSpeed's default) or ``s / n``
  ("linear");
* after it: ``g = 1`` (WarmupLR), or for WarmupDecayLR a linear decay to warmup_min_lr at ``total_num_steps``:
  ``g(s) = max(0, (total_num_steps - s) / max(1, total_num_steps - n))``.

``warmup_max_lr`` left out is each param group's own lr for WarmupLR (DeepSpeed 0.17.2 on), so groups with their own
lr keep their ratios; WarmupDecayLR's is still 1e-3 in DeepSpeed, and so here.

WarmupCosineLR scales each group's own lr by a ratio instead: 0 before the first step (so update 0 runs at lr 0),
``r + (1 - r) * g(s)`` during warm-up (``r`` = warmup_min_ratio), then a cosine from 1 down to ``cos_min_ratio``,
``c + (1 - c) * (1 + cos(pi * p)) / 2`` with ``p = min(1, (s - n + 1) / max(1, total_num_steps - n))``.

Being a ``torch.optim.lr_scheduler.LRScheduler``, it sets ``param_groups[i]["lr"]``, which the CPU Adam kernel reads
at every update, and its ``state_dict`` is plain numbers (checkpoints store it as JSON).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator

import torch

from ..config import SchedulerConfig

log = logging.getLogger("offload")


@contextlib.contextmanager
def after_engine_update() -> Iterator[None]:
    """Around a scheduler's step after the engine's update: the engine also updates through ``launch`` (the
    delayed update, the update beside the next forward), which torch's check that the optimizer stepped first
    does not see, so its warning does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        yield


class WarmupSchedule(torch.optim.lr_scheduler.LRScheduler):
    """WarmupLR, WarmupDecayLR or WarmupCosineLR (``cfg.type``); see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig) -> None:
        self.type = cfg.type
        own = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        default_max = 1e-3 if cfg.type == "warmupdecaylr" else None  # DeepSpeed's WarmupDecayLR default
        max_lr = cfg.warmup_max_lr if cfg.warmup_max_lr is not None else default_max
        self.max_lrs = own if self.type == "warmupcosinelr" or max_lr is None else [max_lr] * len(own)
        self.min_lr = cfg.warmup_min_lr
        self.warmup, self.kind = max(2, cfg.warmup_num_steps), cfg.warmup_type
        self.total = cfg.total_num_steps if cfg.type != "warmuplr" else None
        self.min_ratio, self.cos_min_ratio = cfg.warmup_min_ratio, cfg.cos_min_ratio
        if default_max is not None and cfg.warmup_max_lr is None and any(lr != default_max for lr in own):
            log.warning("offload: WarmupDecayLR without warmup_max_lr peaks at DeepSpeed's default, %g, not the "
                        "optimizer's lr (%s); set scheduler.params.warmup_max_lr to choose", default_max,
                        ", ".join(f"{lr:g}" for lr in own))
        super().__init__(optimizer)

    def gamma(self, s: int) -> float:
        """DeepSpeed's ``g`` after ``s`` scheduler steps (-1: before the first)."""
        if s < 0:
            return 0.0
        if s < self.warmup:
            return s / self.warmup if self.kind == "linear" else math.log(s + 1) / math.log(self.warmup)
        if self.total is None:
            return 1.0
        return max(0.0, (self.total - s) / max(1, self.total - self.warmup))

    def ratio(self, s: int) -> float:
        """WarmupCosineLR's factor of each group's lr after ``s`` scheduler steps (-1: before the first)."""
        if s < 0:
            return 0.0
        if s < self.warmup:
            return self.min_ratio + (1.0 - self.min_ratio) * self.gamma(s)
        progress = min(1.0, (s - self.warmup + 1) / max(1, self.total - self.warmup))
        c = self.cos_min_ratio
        return max(0.0, c + (1.0 - c) * (1 + math.cos(math.pi * progress)) / 2)

    def step(self, epoch: int | None = None) -> None:
        """Advances one optimizer step (the Trainer steps it too, not only the engine)."""
        with after_engine_update():
            super().step(epoch)

    def state_dict(self) -> dict:
        """The position in the schedule, as DeepSpeed's schedulers save it (``last_batch_iteration``): the shape
        (warm-up, maximum, total) is this run's config's."""
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        """The saved position under this config's schedule (a run resumed or fine-tuned with another warm-up,
        maximum or total follows its own); older checkpoints saved the whole schedule, whose shape is ignored."""
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        self._last_lr = self.get_lr()

    def get_lr(self) -> list[float]:
        s = self.last_epoch - 1  # last_epoch: the updates done, so the next is update last_epoch
        if self.type == "warmupcosinelr":
            return [lr * self.ratio(s) for lr in self.max_lrs]
        return [self.min_lr + (hi - self.min_lr) * self.gamma(s) for hi in self.max_lrs]


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> WarmupSchedule | None:
    return None if cfg.type is None else WarmupSchedule(optimizer, cfg)
