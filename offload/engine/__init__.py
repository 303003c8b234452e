"""The training-step engine: ``offload.initialize(model, config)`` returns an :class:`Engine`.

* ``_engine.py``: :class:`Engine` wires the layers a :class:`~offload.plan.Plan` asks for and is the API a loop
  calls; ``initialize``, DeepSpeed's keywords too;
* ``_setup.py``: what ``initialize`` checks and warns about before it builds (the model, the param groups, the
  settings every rank shares);
* ``_step.py``: :class:`StepController`, the step: :class:`Phase`, the counters, the accumulation window,
  ``backward`` and ``step`` with fp16's loss scale and clipping, each gradient routed as it becomes final;
* ``_norm.py``: the loss refused before a non-finite backward, and :class:`GradNorm`, ``last_grad_norm``;
* ``_lifetime.py``: :class:`Lifetime`, Ctrl-C held over every call and forward, ``close()`` and its teardown, an
  engine collected unclosed, the exit and SIGTERM;
* ``_inputs.py``: :class:`MoveInputs`, a forward's inputs to the device;
* ``_persistence.py``: the saves and loads (:class:`TrainingState`: what checkpoints store besides tensors);
* ``_reports.py``: ``memory_report()`` and ``stats()``; ``_compat.py``: DeepSpeed's accessors;
* ``_interrupts.py``: :class:`HeldInterrupts`, the Ctrl-C hold itself;
* ``_grads.py``: :class:`GradientStream`, gradients from the device to the host buffers as they become final;
* ``_gate.py``: :class:`UpdateGate`, the next forward beside the step's last updates (``overlap_forward``);
* ``_model_state.py``: :class:`ModelStateHooks`, the model's own ``state_dict()`` and ``load_state_dict()`` through
  the engine;
* ``_gathered.py``: :class:`Gathered`, one ``engine.gathered()`` block: parameters whole on the device for the
  user's code, and the changes it makes kept.
"""

from ._engine import Engine, initialize
from ._persistence import TrainingState
from ._step import Phase

__all__ = ["Engine", "Phase", "TrainingState", "initialize"]
