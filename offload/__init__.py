"""offload: train models larger than device memory with tiered GPU / host / NVMe storage for optimizer state.

``offload.initialize(model, config)`` returns an :class:`Engine` (see offload/engine.py for the data flow);
``offload.CPUAdam`` is the fast CPU Adam as a plain torch optimizer. docs/architecture.md maps the folders.
"""

from .config import OffloadConfig
from .engine import Engine, Phase, initialize
from .memory import BudgetExceeded, Tier
from .optim import CPUAdam
from .planner import estimate

__all__ = ["BudgetExceeded", "CPUAdam", "Engine", "OffloadConfig", "Phase", "Tier", "estimate", "initialize"]
