"""offload: train models larger than device memory with tiered GPU / host / NVMe storage for optimizer state.

``offload.initialize(model, config)`` returns an :class:`Engine` (see offload/engine/ for the data flow), which
runs the :class:`Plan` it resolved once from the config, the model and the machine (``engine.plan()``);
``offload.CPUAdam`` is the fast CPU Adam as a plain torch optimizer; ``offload.default_device()`` is the device
``offload.device: "auto"`` trains on. ``offload.integrations.transformers.OffloadTrainer`` is transformers' Trainer
on the engine (imported on its own: transformers stays optional). docs/architecture.md maps the folders.
"""

from ._device import default_device
from ._init import init
from .config import OffloadConfig
from .engine import Engine, Phase, initialize
from .memory import BudgetExceeded, Tier
from .optim import CPUAdam
from .persist import load_state_dict
from .plan import Plan
from .planner import estimate

__all__ = ["BudgetExceeded", "CPUAdam", "Engine", "OffloadConfig", "Phase", "Plan", "Tier", "default_device",
           "estimate", "init", "initialize", "load_state_dict"]
