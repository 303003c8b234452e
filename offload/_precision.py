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
        """Called once per optimizer step with whether that step's gradients overflowed."""
        if overflow:
            self.skipped += 1
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.hysteresis_left == 1:
                    self.scale = max(self.scale / 2, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                if (self.iteration - self.last_overflow) % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis_left = self.hysteresis
                    self.scale *= 2
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("scale", "hysteresis_left", "iteration", "last_overflow", "skipped")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
