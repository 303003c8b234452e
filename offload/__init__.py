"""offload: train models larger than device memory with tiered GPU / host / NVMe storage for optimizer state.

The public entry points are re-exported here; see docs/ for the design of each part.
"""

from .optim import CPUAdam

__all__ = ["CPUAdam"]
