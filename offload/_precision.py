"""LossScaler: fp16 dynamic loss scaling with DeepSpeed's semantics and keys.

The loss is multiplied by the scale before backward so small fp16 gradients do not flush to zero. A step whose
gradients hold inf/NaN is skipped and the scale drops (after ``hysteresis`` overflows in a row, unless
``consecutive_hysteresis`` is off, in which case the budget refills only after a clean window); after
``loss_scale_window`` clean steps the scale doubles. ``loss_scale > 0`` fixes the scale.
"""

from __future__ import annotations

from typing import Any

from .config import FP16Config


class LossScaler:
    def __init__(self, cfg: FP16Config) -> None:
        self.dynamic = cfg.enabled and cfg.loss_scale == 0
        self.scale = float(2 ** cfg.initial_scale_power) if self.dynamic else (cfg.loss_scale or 1.0)
        self.window = cfg.loss_scale_window
        self.min_scale = cfg.min_loss_scale
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.hysteresis_left = cfg.hysteresis
        self.iteration = 0
        self.last_overflow = -1
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step with whether that step's gradients overflowed; DeepSpeed's
        DynamicLossScaler rule: the scale doubles after ``window`` clean steps that follow the clean step after the
        last overflow. An overflow with the scale already at ``min_loss_scale`` (and no hysteresis left) is counted,
        then raises FloatingPointError, as DeepSpeed ends the run there: every later step would be skipped too."""
        at_floor = False
        if overflow:
            self.skipped += 1
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.hysteresis_left == 1:
                    at_floor = self.scale == self.min_scale
                    self.scale = max(self.scale / 2, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                stable = self.iteration - self.last_overflow - 1
                if stable > 0 and stable % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis_left = self.hysteresis
                    self.scale *= 2
        self.iteration += 1
        if at_floor:
            raise FloatingPointError(
                f"fp16: the gradients overflowed with the loss scale already at fp16.min_loss_scale "
                f"({self.min_scale:g}), so every step from here would be skipped (the step was skipped; "
                f"{self.skipped} skipped so far). The loss or the model produce inf/NaN, or fp16's range is too "
                "small for them: check the loss, use bf16 (no loss scaling), or lower min_loss_scale")

    def state_dict(self) -> dict[str, Any]:
        """The scale and its counters; ``dynamic`` says how the scale came about (a load keeps its own mode)."""
        keys = ("scale", "hysteresis_left", "iteration", "last_overflow", "skipped", "dynamic")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k != "dynamic":  # the config's
                setattr(self, k, v)
