"""The training-step engine: ``offload.initialize(model, config)`` returns an :class:`Engine`.

* ``_engine.py``: :class:`Engine` wires the layers a :class:`~offload.plan.Plan` asks for and runs the step
  (:class:`Phase` says where it is; :class:`TrainingState` is what checkpoints store besides tensors);
* ``_weights.py``: :class:`Weights`, where the low-precision parameters live and how new values reach them;
* ``_grads.py``: :class:`GradientStream`, gradients from the device to the host buffers as they become final;
* ``_gate.py``: :class:`UpdateGate`, the next forward beside the step's last updates (``overlap_forward``);
* ``_model_state.py``: :class:`ModelStateHooks`, the model's own ``state_dict()`` and ``load_state_dict()`` through
  the engine;
* ``_gathered.py``: :class:`Gathered`, one ``engine.gathered()`` block: parameters whole on the device for the
  user's code, and the changes it makes kept.
"""

from ._engine import Engine, Phase, TrainingState, initialize

__all__ = ["Engine", "Phase", "TrainingState", "initialize"]
