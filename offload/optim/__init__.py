"""Optimizers for host-resident (offloaded) parameters."""

from .cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
