"""DeepSpeed's engine accessors, for scripts ported from ``deepspeed.initialize`` that call them: the settings
(batch sizes, precision, clipping, stage, ranks) and the step's counters under DeepSpeed's names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._precision import LossScaler
    from ..config import OffloadConfig
    from ..dist import Comm
    from ..optim.offloaded import OffloadedAdam
    from ._step import StepController


class DeepSpeedAccessors:
    """The :class:`~offload.engine.Engine`'s DeepSpeed-named reads. Owns no state: reads the engine's config,
    optimizer, ranks, loss scaler and step controller, and ``last_grad_norm``."""

    config: "OffloadConfig"
    optimizer: "OffloadedAdam"
    comm: "Comm"
    scaler: "LossScaler"
    stage: int
    rank: int
    world_size: int
    _steps: "StepController"
    last_grad_norm: float | None

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        """DeepSpeed's: each param group's learning rate, as the next update will take it (after the config's
        scheduler or the caller's has stepped)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[tuple[float, float]]:
        """DeepSpeed's: each param group's Adam betas."""
        return [tuple(group["betas"]) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's name for :attr:`last_grad_norm`."""
        return self.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """DeepSpeed's: the steps fp16's loss scaler skipped on overflow (``global_steps`` counts them too)."""
        return self.scaler.skipped

    def was_step_applied(self) -> bool:
        """DeepSpeed's: whether the last ``step()`` updated the parameters (False between accumulation boundaries,
        for a step fp16's loss scaler skipped on overflow, and for one that raised). With the updates finishing
        beside the next forward, "updated" means launched: they are in before any module reads them."""
        return self._steps.applied

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks: micro-batch x accumulation steps x world size."""
        return self.config.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.world_size

    @property
    def global_samples(self) -> int:
        """Samples trained on over all ranks: train_batch_size() a step, from the count a checkpoint restored (a run
        resumed under another batch size counts on from where it was, as DeepSpeed's does)."""
        return self._steps.global_samples(self.train_batch_size())

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.stage

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @property
    def local_rank(self) -> int:
        return self.comm.pg.local_rank

    def __iter__(self) -> Any:
        raise TypeError("offload.initialize returns the engine alone, not DeepSpeed's (engine, optimizer, "
                        "dataloader, lr_scheduler): write `engine = offload.initialize(model, config)`; the others "
                        "are engine.optimizer, your own DataLoader and engine.lr_scheduler")
