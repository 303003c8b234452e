"""The engine's persistence facade: checkpoints (``save_checkpoint``/``load_checkpoint``), the counters they
hold besides tensors (:class:`TrainingState`), model weights in (``load_state_dict``) and out
(``consolidated_state_dict``, ``save_safetensors``, ``save_16bit_model``).

The work is persistence's, written against the engine's state contract (offload/_state.py); here each call checks
the phase, finishes the updates in flight and holds Ctrl-C, and a load that fails after it began writing leaves
the engine FAILED.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from .. import persist
from ._lifetime import held
from ._step import Phase

if TYPE_CHECKING:
    from .._precision import LossScaler
    from ..optim.offloaded import OffloadedAdam
    from ..plan import Plan
    from ._norm import GradNorm
    from ._step import StepController
    from ..params._weights import Weights

log = logging.getLogger("offload")


@dataclass
class TrainingState:
    """Everything a checkpoint holds besides tensors: the contract between the engine and ``_checkpoint``."""

    global_steps: int
    micro_steps: int
    optimizer_steps: int
    loss_scaler: dict[str, Any]
    param_groups: list[dict[str, Any]]
    pending_update: bool  # delayed update: the device holds the previous parameters, the newest wait on the host
    dtype: str = ""
    lr_scheduler: dict[str, Any] | None = None  # the config's scheduler (its state_dict: plain numbers)
    global_samples: int | None = None  # None: global_steps x this engine's train_batch_size()
    extra: dict[str, Any] = field(default_factory=dict)


class Persistence:
    """The :class:`~offload.engine.Engine`'s saves and loads. Owns no state: reads and writes the step controller's
    counters and phase, the optimizer's step count and groups, the loss scaler, the LR scheduler, the delayed
    update's pending flag and the norm."""

    optimizer: "OffloadedAdam"
    weights: "Weights"
    scaler: "LossScaler"
    lr_scheduler: Any
    dtype: torch.dtype
    phase: Phase
    global_steps: int
    micro_steps: int
    global_samples: int
    gradient_accumulation_steps: int
    _plan: "Plan"
    _steps: "StepController"
    _norm: "GradNorm"
    train_batch_size: Callable[[], int]
    parameters_current: Callable[[], None]

    def training_state(self) -> TrainingState:
        """The counters and settings a checkpoint stores beside the tensors."""
        self._steps.settle()
        opt = self.optimizer
        return TrainingState(self.global_steps, self.micro_steps, opt.step_count, self.scaler.state_dict(),
                             [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                             self.weights.pending, str(self.dtype),
                             self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                             self.global_samples)

    @held("engine.load_training_state")
    def load_training_state(self, state: TrainingState) -> None:
        samples = state.global_steps * self.train_batch_size() if state.global_samples is None else \
            state.global_samples
        self._steps.restore(state.global_steps, state.micro_steps, samples)
        self.optimizer.restart_at(state.optimizer_steps)
        self._norm.forget()  # the norm of a step the checkpoint does not hold
        self.scaler.load_state_dict(state.loss_scaler)
        for group, saved in zip(self.optimizer.param_groups, state.param_groups):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self.weights.pending = state.pending_update and self._plan.delayed
        if self.lr_scheduler is not None and state.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state.lr_scheduler)

    @held("engine.load_state_dict")
    def load_state_dict(self, source: str | Path | Mapping[str, torch.Tensor], *, strict: bool = True) -> Any:
        """Loads model weights (a safetensors file, a sharded checkpoint folder or index, a torch file, or a dict)
        tensor by tensor into the fp32 master weights and each parameter's home; Adam's moments and the counters
        stay. Returns what did not match (``missing``, ``unexpected``); ``strict`` makes either an error."""
        self._steps.expect("engine.load_state_dict()", Phase.IDLE, Phase.ACCUMULATING)
        self.parameters_current()  # a pending delayed update would overwrite the loaded values at the next step

        return persist.load_into_engine(self, source, strict)

    @held("engine.consolidated_state_dict")
    def consolidated_state_dict(self, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The model state as plain CPU tensors: fp32 master weights for trainable parameters. ``keys``: only
        those entries of ``module.state_dict()`` (a LoRA adapter's, say), read from the sub-groups holding them.
        Collective with several ranks (every rank passes the same keys)."""
        self._steps.expect("engine.consolidated_state_dict()", Phase.IDLE, Phase.ACCUMULATING)
        self._steps.finish_updates()
        if keys is None:
            return persist.consolidated_state_dict(self)
        return persist.engine_tensors(self, list(keys))

    @held("engine.save_safetensors")
    def save_safetensors(self, path: str | Path, *, max_shard_size: int | str = "5GB") -> list[Path]:
        """Writes the model (fp32 master weights) into the folder ``path`` as ``model.safetensors``, or as shards of
        at most ``max_shard_size`` with ``model.safetensors.index.json``: what ``from_pretrained`` and
        :func:`offload.load_state_dict` read. One shard is in memory at a time. Collective with several ranks
        (rank 0 writes). Returns the files written."""
        self._steps.expect("engine.save_safetensors()", Phase.IDLE, Phase.ACCUMULATING)
        self._steps.finish_updates()

        return persist.save_engine(self, path, max_shard_size)

    @held("engine.save_16bit_model")
    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> Path:
        """DeepSpeed's: the model in the training dtype in one file, ``save_dir/save_filename`` (a torch state
        dict; safetensors for a ``.safetensors`` name), built in RAM on rank 0 as DeepSpeed builds it; returns
        the file (DeepSpeed returns True; a path is true too). With the delayed update it holds the newest
        weights, which the device gets at the next step. ``save_safetensors`` writes the fp32 masters in shards,
        one in RAM at a time. Collective with several ranks."""
        if not save_filename or os.sep in save_filename or save_filename in (".", ".."):
            raise ValueError(f"engine.save_16bit_model: save_filename must be a file name inside save_dir, got "
                             f"{save_filename!r} (put folders in save_dir)")
        self._steps.expect("engine.save_16bit_model()", Phase.IDLE, Phase.ACCUMULATING)
        self._steps.finish_updates()

        return persist.save_16bit(self, save_dir, save_filename, exclude_frozen_parameters)

    @held("engine.save_checkpoint")
    def save_checkpoint(self, path: str | Path, tag: str | int | None = None, client_state: dict | None = None, *,
                        exclude_frozen_parameters: bool = False) -> Path:
        """Writes model, optimizer state (wherever it lives), loss scaler and counters under ``path/tag`` and then
        points ``path/latest`` at it; a crash mid-save leaves the previous checkpoint loadable; returns that folder.
        ``client_state`` (DeepSpeed's): a dict of the loop's own (epoch, data position), rank 0's saved beside it
        and given back by load_checkpoint; tensors, numbers, strings and containers of them (never unpickled).
        ``exclude_frozen_parameters`` (DeepSpeed's name): leaves the parameters that do not train out (a LoRA run's
        base model, which the training script builds again); loading it keeps the model's own."""
        self._steps.expect("engine.save_checkpoint()", Phase.IDLE, Phase.ACCUMULATING)
        if self.phase is Phase.ACCUMULATING:  # a checkpoint holds no gradients: a resume would lose these
            gas = self.gradient_accumulation_steps
            raise RuntimeError(
                f"engine.save_checkpoint() with the gradients of an unfinished accumulation window held (after "
                f"micro-batch {self.micro_steps % gas or gas} of {gas}, or a backward not yet stepped): a checkpoint "
                "holds no gradients, so a resume would lose them. Save after the engine.step() that ends the window")
        self._steps.finish_updates()
        return persist.save(self, Path(path), f"step{self.global_steps}" if tag is None else str(tag),
                                frozen=not exclude_frozen_parameters, client_state=client_state)

    @held("engine.load_checkpoint")
    def load_checkpoint(self, path: str | Path, tag: str | int | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Path, dict[str, Any]]:
        """Restores a checkpoint written by save_checkpoint (``latest`` unless ``tag``); returns, as DeepSpeed's,
        the folder it loaded and the client_state saved with it ({} if none). DeepSpeed's partial loads (a run
        fine-tuned from another's checkpoint): ``load_optimizer_states=False`` loads the weights and the step
        counters, keeping this engine's Adam moments, optimizer step count, hyperparameters and loss scale;
        ``load_lr_scheduler_states=False`` keeps its LR schedule; ``load_module_only`` loads the weights alone."""
        if not load_module_strict:
            raise ValueError("engine.load_checkpoint(load_module_strict=False): a checkpoint of this engine loads "
                             "whole; for the weights of another model, export it (python -m offload export CKPT "
                             "OUT) and load what matches with engine.load_state_dict(OUT, strict=False)")
        if custom_load_fn is not None:
            raise ValueError("engine.load_checkpoint(custom_load_fn=...): DeepSpeed's hook for its own module "
                             "format; here load the weights with engine.load_state_dict(source) after the load")
        self._steps.expect("engine.load_checkpoint()", Phase.IDLE, Phase.ACCUMULATING, Phase.FAILED)
        partial = "load_module_only=True" if load_module_only else \
            "load_optimizer_states=False" if not load_optimizer_states else None
        if partial and self.phase is Phase.FAILED:
            raise RuntimeError(f"engine.load_checkpoint({partial}) after a failed step ({self._steps.failure}) would "
                               "keep the Adam state that step half updated: load a checkpoint whole first (this "
                               "run's last one), then the weights of the other")
        if partial and self.phase is Phase.ACCUMULATING and self._steps.window_updates_started():
            raise RuntimeError(f"engine.load_checkpoint({partial}): this window's updates have started (its last "
                               "micro-batch's backward ran them), so the Adam state it would keep holds a step "
                               "that never completes; call engine.step() first, or load the checkpoint whole")
        window = self._steps.open_window()
        try:
            self._steps.settle()
        except Exception as exc:  # noqa: BLE001 - the engine is FAILED now, which a load is for
            log.warning("offload: loading a checkpoint over a failed step (%s: %s)", type(exc).__name__, exc)
        writing = []

        def before_write() -> None:  # the checkpoint matches the model: from here a failure leaves a half load
            self._steps.discard_window()
            writing.append(True)

        try:
            loaded = persist.load(self, Path(path), None if tag is None else str(tag), before_write,
                                      optimizer=load_optimizer_states and not load_module_only,
                                      counters=not load_module_only,
                                      scheduler=load_lr_scheduler_states and not load_module_only)
        except BaseException as exc:
            if writing:
                self._steps.fail("engine.load_checkpoint", exc)
            raise
        # the counters stay with load_module_only: the dropped window's micro-batches go
        self._steps.loaded(window if load_module_only else None)
        return loaded
