"""transformers' Trainer on the offload engine: an existing fine-tuning script changes one line.

    from offload.integrations.transformers import OffloadTrainer

    trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=train, eval_dataset=val,
                             offload_config="offload.json")        # was: Trainer(model=model, args=..., ...)
    trainer.train(resume_from_checkpoint=True)
    trainer.save_model("out")                                     # a folder from_pretrained loads
    trainer.close()                                               # or: with OffloadTrainer(...) as trainer:

Everything the Trainer does stays the Trainer's: data loading and sharding, the loop, accumulation, evaluation,
logging, callbacks, checkpoint rotation, RNG state. What changes is who holds the weights and the optimizer:

* ``offload_config`` (a DeepSpeed-shaped dict, JSON path or :class:`~offload.OffloadConfig`) says where the
  optimizer state and parameters live. Keys the TrainingArguments also set (micro-batch size, accumulation steps,
  clipping, fp16/bf16, the optimizer's lr/betas/eps/weight_decay, the device, the collectives' timeout
  ``ddp_timeout``) may be absent or ``"auto"`` and are
  then taken from the TrainingArguments; a value given in both that differs is an error naming both. The engine is
  built (``offload.initialize``) when training or evaluation starts, from the TrainingArguments as they are then
  (a hyperparameter search's trial sets them; one an evaluate() built before any training is built again at
  train() if they changed since, and refused under bf16/fp16, whose engine handed back rounded weights), with
  the Trainer's two parameter groups (no weight decay for biases and norms), or the groups of the torch
  Adam/AdamW a subclass's ``create_optimizer`` makes (their lr, betas, eps and weight decay; the engine's AdamW
  does the steps). ``trainer.optimizer`` steps the engine; Adam's state is in the
  engine's tiers, so its ``state_dict()`` refuses and points to the engine's checkpoints.
* The learning-rate schedule is the TrainingArguments' (``lr_scheduler_type``, warm-up), or the config's
  ``scheduler`` (WarmupLR / WarmupDecayLR / WarmupCosineLR; ``"auto"`` values from the TrainingArguments and the
  step count), stepped by the Trainer. The optimizer must be AdamW (``optim`` one of :data:`ADAMW`) or the
  config's ``optimizer``.
* Each micro-batch's loss, normalised as the Trainer normalises it, goes to ``engine.backward``; the Trainer's
  optimizer step is ``engine.step()``, at the boundaries the Trainer decides (a short last window included).
  Clipping and fp16 loss scaling are the engine's, and the logged ``grad_norm`` is its global norm
  (``engine.last_grad_norm``, read only on the steps that log: with clipping off the updates sum it as they run,
  and reading it waits for those still running beside the next forward).
* A parameter with no gradient in a step (a branch or expert the batches did not take) is updated with a zero
  gradient, as under DeepSpeed: its Adam moments and weight decay still move it, where torch's AdamW skips it.
* Checkpoints (``save_steps``): the Trainer's folder gets the model as safetensors, the engine's checkpoint
  (fp32 masters, Adam moments, counters) under ``offload_state/`` and the scheduler; ``resume_from_checkpoint``
  restores them and continues bit-identically. A checkpoint folder of a plain Trainer resumes too (its weights;
  the Adam state starts fresh, with a warning). A save killed midway leaves its folder incomplete (no
  trainer_state.json, which is written last, or no committed engine state): ``resume_from_checkpoint=True`` takes
  the newest complete folder, not the highest-numbered one, and warns of those it skips; the next save removes
  them (so rotation by ``save_total_limit`` never counts them); naming an incomplete folder is an error. With
  several ranks, what the folder holds (the tag a save takes, whether a resume finds the engine's state, which
  folder is complete) is read by rank 0 for all: a shared filesystem may list it differently.
* ``save_model`` writes ``config.json`` and the fp32 weights as ``model.safetensors`` (sharded with an index above
  ``save_max_shard_size``), streamed from wherever they live, one shard in RAM at a time.
* A peft model (LoRA and the like) is saved as the Trainer saves one: the adapter alone, through peft's
  ``save_pretrained`` (``adapter_config.json``, ``adapter_model.safetensors``: the fp32 masters of the trainable
  parameters, read from the sub-groups holding them). The engine's checkpoints leave the frozen base out (as the
  Trainer asks of DeepSpeed), and a plain Trainer's adapter checkpoint or best model loads through peft.

One process per GPU (torchrun), as with DeepSpeed; the engine's collectives replace DDP, and ``save_model`` and
checkpoints are collective (every rank calls them, as the Trainer does; rank 0 writes into a folder all ranks see):
a DDP script's ``if trainer.is_world_process_zero(): trainer.save_model()`` fails, so call it on every rank.
``torch_compile=True`` compiles the model as with a plain Trainer. An fp16 step skipped for overflow does not
advance the schedule; a model swapped in by ``model_init`` gets a new engine; a ``train()`` interrupted inside an
accumulation window (Ctrl-C) drops that window's gradients when training starts again (``engine.zero_grad()``), as
the Trainer's ``model.zero_grad()`` does. With ``delayed_update``, evaluation applies the update in flight first, so
the step after an evaluation runs undelayed (runs with different ``eval_steps`` differ slightly), and ``train()``
returns with the last update in the model. ``fp16_full_eval``/``bf16_full_eval`` do not cast the model (that would
take it from the engine): evaluation computes in the engine's dtype (the config's or TrainingArguments' bf16/fp16).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import sys
import weakref
from enum import Flag, auto
from pathlib import Path
from typing import Any, Mapping

import torch
import transformers
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import OffloadConfig, OptimizerConfig, SchedulerConfig, flat_fields, read_json
from ..engine import Engine, Phase, initialize
from ..optim._schedule import WarmupSchedule
from ..persist import committed

__all__ = ["ADAMW", "OffloadTrainer", "trainer_config"]

log = logging.getLogger("offload")

ADAMW = ("adamw_torch", "adamw_torch_fused")  # TrainingArguments.optim values the engine's AdamW stands in for
# the Trainer's methods this class overrides that older transformers lack (5.0-5.2): without them the engine would
# be bypassed silently (clipping, gradient norms, the window's bookkeeping)
_TRAINER_HOOKS = ("_build_accelerator_args", "_prepare_for_training", "_clip_grad_norm", "_get_grad_norm")
STATE_DIR = "offload_state"  # in a Trainer checkpoint folder: the engine's checkpoint
_SCHEDULER_FILE = "scheduler.pt"
_ARGS_FILE = "training_args.bin"

# (config key path, the TrainingArguments value that "auto" or an absent key takes)
_FROM_ARGS: list[tuple[tuple[str, ...], Any]] = [
    (("train_micro_batch_size_per_gpu",), lambda a: a.per_device_train_batch_size),
    (("gradient_accumulation_steps",), lambda a: a.gradient_accumulation_steps),
    (("train_batch_size",), lambda a: a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size),
    (("gradient_clipping",), lambda a: a.max_grad_norm),
    (("fp16", "enabled"), lambda a: a.fp16),
    (("bf16", "enabled"), lambda a: a.bf16),
    (("optimizer", "params", "lr"), lambda a: a.learning_rate),
    (("optimizer", "params", "betas"), lambda a: [a.adam_beta1, a.adam_beta2]),
    (("optimizer", "params", "eps"), lambda a: a.adam_epsilon),
    (("optimizer", "params", "weight_decay"), lambda a: a.weight_decay),
    # several ranks: each takes cuda:LOCAL_RANK, the device the Trainer gave it ("cuda:N" would name one for all)
    (("offload", "device"),
     lambda a: "cpu" if a.device.type == "cpu" else "cuda" if a.world_size > 1 else str(a.device)),
    # what the Trainer's process group waits (DeepSpeed under the Trainer gets it too): the engine's collectives
    (("offload", "comm_timeout"), lambda a: float(a.ddp_timeout)),
]
_ARG_NAMES = {("train_micro_batch_size_per_gpu",): "per_device_train_batch_size",
              ("train_batch_size",): "per_device_train_batch_size x gradient_accumulation_steps x world_size",
              ("gradient_clipping",): "max_grad_norm", ("fp16", "enabled"): "fp16", ("bf16", "enabled"): "bf16",
              ("optimizer", "params", "lr"): "learning_rate",
              ("optimizer", "params", "betas"): "[adam_beta1, adam_beta2]",
              ("optimizer", "params", "eps"): "adam_epsilon", ("offload", "device"): "device",
              ("offload", "comm_timeout"): "ddp_timeout"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _same_device(spec: Any, device: str) -> bool:
    """A config device ("cuda", "cuda:1", "cpu") that names the TrainingArguments' device ("cuda" alone: any index,
    the engine takes the rank's own)."""
    try:
        a, b = torch.device(spec), torch.device(device)
    except (RuntimeError, TypeError):
        return False
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def trainer_config(config: OffloadConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
                   args: Any) -> tuple[OffloadConfig, dict[str, Any] | None]:
    """The engine's config with ``"auto"`` and absent keys filled from the TrainingArguments (see the module
    docstring), and the ``scheduler`` section, kept apart: its "auto" values need the number of steps."""
    if isinstance(config, OffloadConfig):  # values left at their defaults count as absent
        raw, defaults = config.to_dict(), OffloadConfig().to_dict()
        for path, _ in _FROM_ARGS:
            if _get(raw, path) == _get(defaults, path) and _get(raw, path[:-1]) is not None:
                _get(raw, path[:-1]).pop(path[-1], None)
        if config.optimizer == OptimizerConfig():
            del raw["optimizer"]  # nothing chosen: TrainingArguments.optim decides, as with a dict
    elif config is None or isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config or {}))
    else:
        raw = read_json(config)
    if "bfloat16" in raw:
        raw["bf16"] = raw.pop("bfloat16")
    if "optimizer" not in raw:
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in ADAMW:
            raise ValueError(f"TrainingArguments.optim={optim!r}: OffloadTrainer trains with the offload engine's "
                             f"AdamW; use optim one of {', '.join(ADAMW)}, or give the config an \"optimizer\" "
                             "section (Adam or AdamW)")
        raw["optimizer"] = {"type": "AdamW", "params": {}}
    for path, value in _FROM_ARGS:
        section = raw
        for key in path[:-1]:
            section = section.setdefault(key, {})
            if not isinstance(section, dict):
                raise ValueError(f"{'.'.join(path[:-1])} must be a JSON object, got {section!r}")
        want = value(args)
        have = section.get(path[-1], "auto")
        if have == "auto":
            section[path[-1]] = want
        elif not (_same_device(have, want) if path == ("offload", "device") else _same(have, want)):
            name = _ARG_NAMES.get(path, path[-1])
            kind = f" (a {type(have).__name__}, where a {type(want).__name__} is meant)" \
                if isinstance(have, str) and not isinstance(want, str) else ""
            raise ValueError(f"offload config {'.'.join(path)} = {have!r}{kind} but TrainingArguments.{name} = "
                             f"{want!r}; set one of them to match, or the config's to \"auto\"")
    scheduler = raw.pop("scheduler", None)
    if scheduler is not None:
        SchedulerConfig.from_dict(_fill_scheduler(scheduler, args, 1))  # its errors now, not when training starts
    return OffloadConfig.load(raw), scheduler


class _Lacks(Flag):
    """What a Trainer checkpoint folder lacks to be resumed from: what a save killed midway had not written. The
    Trainer writes trainer_state.json last (after the model, the engine's state, the schedule and RNG states), and
    the engine's state counts once committed (``latest`` names a tag whose folder holds its meta.json; see
    offload/persist/_save.py). A folder without ``offload_state/`` (a plain Trainer's, save_only_model) needs only
    trainer_state.json."""

    NOTHING = 0
    FOLDER = auto()
    TRAINER_STATE = auto()
    ENGINE_STATE = auto()

    def describe(self) -> str:
        what = {_Lacks.FOLDER: "the folder itself", _Lacks.TRAINER_STATE: TRAINER_STATE_NAME,
                _Lacks.ENGINE_STATE: f"a committed engine state ({STATE_DIR}/latest naming a tag folder with its "
                                    "meta.json)"}
        return " and ".join(text for flag, text in what.items() if flag in self)


def _lacks(folder: Path) -> _Lacks:
    """What ``folder`` lacks to be resumed from (see :class:`_Lacks`)."""
    if not folder.is_dir():
        return _Lacks.FOLDER
    out = _Lacks.NOTHING if (folder / TRAINER_STATE_NAME).is_file() else _Lacks.TRAINER_STATE
    if (folder / STATE_DIR).exists() and not committed(folder / STATE_DIR):
        out |= _Lacks.ENGINE_STATE
    return out


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The Trainer's ``checkpoint-N`` folders in ``run_dir``, newest step first (get_last_checkpoint's choice)."""
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    try:
        entries = list(run_dir.iterdir())
    except OSError:
        return []
    found = [(int(p.name[len(prefix):]), p) for p in entries
             if p.name.startswith(prefix) and p.name[len(prefix):].isdigit() and p.is_dir()]
    return sorted(found, key=lambda item: item[0], reverse=True)


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, Mapping):
            return None
        d = d.get(key)
    return d


def _differences(old: OffloadConfig, new: OffloadConfig) -> list[str]:
    """The dotted names of the settings two configs differ in."""
    a, b = flat_fields(old), flat_fields(new)
    return [name for name in a if a[name] != b[name]]


def _fill_scheduler(section: Any, args: Any, max_steps: int) -> Any:
    """The config's scheduler section with "auto" values from the TrainingArguments and the run's step count."""
    if not isinstance(section, Mapping):
        return section
    section = copy.deepcopy(dict(section))
    params = section.get("params")
    if isinstance(params, dict):
        auto = {"warmup_min_lr": 0.0, "warmup_max_lr": args.learning_rate,
                "warmup_num_steps": args.get_warmup_steps(max_steps), "total_num_steps": max_steps}
        for key, value in auto.items():
            if params.get(key) == "auto":
                params[key] = value
    return section


class _EngineOptimizer(torch.optim.Optimizer):
    """The optimizer the Trainer's loop holds: ``step()`` is ``engine.step()``, and its param_groups are the
    engine's own (an LR scheduler sets the lr the CPU Adam kernel reads). Gradients never sit in ``.grad``, so
    ``zero_grad`` has nothing to do."""

    def __init__(self, engine: Engine) -> None:
        inner = engine.optimizer
        super().__init__([{"params": g["params"]} for g in inner.param_groups], dict(inner.defaults))
        self.engine = engine
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.step_was_skipped = False  # read by accelerate: an fp16 overflow skips the update and the LR step

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("trainer.optimizer is the offload engine's: Adam's state lives in its tiers (host memory "
                           "or NVMe), not in a state_dict. The Trainer's checkpoints hold it (offload_state/); to "
                           "save and load it yourself: trainer.engine.save_checkpoint(folder) and "
                           "trainer.engine.load_checkpoint(folder)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("trainer.optimizer is the offload engine's, whose state no torch state_dict holds: resume "
                           "with trainer.train(resume_from_checkpoint=...) or trainer.engine.load_checkpoint(folder)")

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("the offload engine's step does not take a closure")
        skipped = self.engine.scaler.skipped
        self.engine.step()
        self.step_was_skipped = self.engine.scaler.skipped > skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _groups_of(optimizer: Any) -> list[dict[str, Any]]:
    """The engine's parameter groups from a torch Adam/AdamW a subclass's ``create_optimizer`` made: each group's
    parameters, lr, betas, eps and weight decay (Adam's weight decay is L2: ``adamw_mode`` False)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"create_optimizer made a {type(optimizer).__name__}: OffloadTrainer trains with the "
                         "engine's Adam/AdamW, taking the groups (params, lr, betas, eps, weight_decay) of a torch "
                         "Adam or AdamW that create_optimizer makes; make one of those")
    adamw = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay", False)
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        if g.get("amsgrad") or g.get("maximize"):
            raise ValueError(f"create_optimizer's group {i} sets amsgrad or maximize, which the engine's Adam does "
                             "not do")
        # frozen parameters in a group (AdamW(model.parameters())) are no more trained there than by torch's AdamW
        groups.append({"params": [p for p in g["params"] if p.requires_grad], "lr": float(g["lr"]),
                       "betas": tuple(g["betas"]), "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"]),
                       "adamw_mode": adamw})
    return groups


class OffloadTrainer(Trainer):
    """transformers' ``Trainer`` training through the offload engine; see the module docstring."""

    def __init__(self, *args: Any, offload_config: OffloadConfig | Mapping[str, Any] | str | os.PathLike[str] | None
                 = None, save_max_shard_size: int | str = "5GB", **kwargs: Any) -> None:
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers is not None and any(o is not None for o in optimizers):
            raise ValueError("OffloadTrainer builds the optimizer (the engine's AdamW) and takes the schedule from "
                             "TrainingArguments or the config's \"scheduler\": leave out optimizers=(...)")
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("OffloadTrainer builds the optimizer itself: leave out optimizer_cls_and_kwargs")
        missing = [name for name in _TRAINER_HOOKS if not hasattr(Trainer, name)]
        if missing:
            raise RuntimeError(f"OffloadTrainer needs transformers >= 5.3 (its Trainer.{missing[0]} is where the "
                               f"engine steps in); this is transformers {transformers.__version__}: "
                               "pip install 'transformers>=5.3'")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "deepspeed", None):
            raise ValueError(f"TrainingArguments.deepspeed = {training_args.deepspeed!r}: OffloadTrainer trains "
                             "through the offload engine, not DeepSpeed; pass that JSON as offload_config= (its "
                             "DeepSpeed-shaped keys are read) and leave deepspeed unset")
        super().__init__(*args, **kwargs)
        if self.args.n_gpu > 1:
            raise ValueError(f"OffloadTrainer runs one process per GPU, and this process sees {self.args.n_gpu}: "
                             "launch with torchrun --nproc_per_node N (or set CUDA_VISIBLE_DEVICES)")
        self._offload_source = offload_config  # resolved against self.args again for each engine built
        self.offload_config, self._scheduler_section = trainer_config(offload_config, self.args)  # checked now
        self.save_max_shard_size = save_max_shard_size
        if self.args.save_on_each_node:
            raise ValueError("OffloadTrainer saves from every rank into one folder all ranks see (as the engine's "
                             "checkpoints need): set save_on_each_node=False and give output_dir on a shared "
                             "filesystem")
        self.engine: Engine | None = None
        self._finalizer: Any = None
        self._closed = False
        self._closed_dtype: torch.dtype | None = None  # the dtype the engine trained in, once closed
        self._creating = False  # a subclass's create_optimizer is running (see _groups)

    def close(self) -> None:
        """Stops the engine (its threads, swap files and buffers); the model keeps its trained parameters, and a
        later save_model writes them as a plain Trainer would, in the engine's training dtype: the fp32 masters
        of a bf16 or fp16 run close with it (save_model before, for those). ``with OffloadTrainer(...) as
        trainer:`` calls it."""
        self._closed = True
        if self.engine is not None:
            self._closed_dtype = self.engine.dtype
            self.engine = None
            self._finalizer()

    def __enter__(self) -> "OffloadTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def train(self, resume_from_checkpoint: str | os.PathLike[str] | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """transformers' ``train``; ``resume_from_checkpoint=True`` takes the newest COMPLETE checkpoint of
        output_dir (see :meth:`_resume_point`). When it returns, the last step's updates are in the model (with
        ``offload_optimizer.overlap_forward`` they could still be finishing; with ``delayed_update`` the last one
        waited on the host)."""
        out = super().train(self._resume_point(resume_from_checkpoint), *args, **kwargs)
        if self.engine is not None:
            self.engine.finish_step()
            self.engine.apply_delayed_update()
        return out

    def _resume_point(self, resume: str | os.PathLike[str] | bool | None) -> str | None:
        """The folder train() resumes from. transformers takes the highest-numbered ``checkpoint-N`` for True,
        complete or not, and a save killed midway leaves one incomplete (no trainer_state.json, or no committed
        engine state): here the newest complete one is taken, each newer one skipped with a warning (the next save
        removes them, see :meth:`_save_checkpoint`); an incomplete folder given is an error naming what it lacks
        and the newest complete one beside it. Rank 0's reading of the folders is every rank's."""
        if resume is None or resume is False:
            return None
        given = None if resume is True else Path(resume)
        run_dir = Path(self.args.output_dir) if given is None else given.parent
        found = _checkpoints(run_dir)
        newest = next(((step, folder) for step, folder in found if not _lacks(folder)), None)
        mine = _lacks(given) if given is not None else _Lacks.NOTHING
        step, missing = self._rank0s([-1 if newest is None else newest[0], mine.value])
        best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}" if step >= 0 else None
        instead = f"resume from {best} instead, the newest complete checkpoint there" if best is not None else \
            f"{run_dir} holds no complete checkpoint: train without resume_from_checkpoint to start afresh"
        if given is not None:
            if missing:
                raise FileNotFoundError(f"resume_from_checkpoint={str(given)!r} is not a complete checkpoint (a save "
                                        f"interrupted midway?): it lacks {_Lacks(missing).describe()}; {instead}")
            return str(given)
        if self.args.process_index == 0:
            for skipped, folder in found:
                if skipped > step:
                    log.warning("offload: resume_from_checkpoint=True skips %s, an incomplete checkpoint (a save "
                                "killed midway): it lacks %s", folder, _lacks(folder).describe())
        if best is None:
            raise ValueError(f"resume_from_checkpoint=True: {instead}")
        return str(best)

    def _rank0s(self, values: list[int]) -> list[int]:
        """``values`` as rank 0 has them, as ``engine.comm.rank0s`` gives them, over the Trainer's process group:
        train() reads the checkpoint it resumes from before the engine is built."""
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(values, src=0)
        return values

    # the engine -------------------------------------------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The engine does precision and loss scaling: accelerate must not autocast or add a GradScaler."""
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"
        return out

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """``initialize`` puts the model on the device (parameters homed off the device stay there)."""

    def _ensure_engine(self) -> Engine:
        """The engine of ``self.model``, built on first use from the TrainingArguments as they are then (a
        hyperparameter search's trial sets them); a new one when the Trainer swapped the model (``model_init``)."""
        if self._closed:
            raise RuntimeError("this OffloadTrainer was closed: build a new one to train on")
        if self.engine is not None and self.engine.module is not self.model:
            self._finalizer()
            self.engine = None
        if self.engine is None:
            self.offload_config, self._scheduler_section = trainer_config(self._offload_source, self.args)
            groups = self._groups()
            if self.engine is None:  # (a subclass's create_optimizer may have built it, through this class's)
                self.engine = initialize(self.model, self.offload_config, param_groups=groups)
                # threads, buffers and swap files go with the trainer even if close() is never called
                self._finalizer = weakref.finalize(self, self.engine.close)
        if not isinstance(self.optimizer, _EngineOptimizer) or self.optimizer.engine is not self.engine:
            self.optimizer = _EngineOptimizer(self.engine)
        return self.engine

    def _follow_arguments(self) -> None:
        """At train(): an engine built by an evaluate() before any training, from TrainingArguments changed since
        (a notebook's baseline evaluation, then args.learning_rate set), is built again from them, as the plain
        Trainer makes its optimizer only now. One that has trained keeps its settings, which is said."""
        if self.engine is None or self.engine.module is not self.model:
            return
        config, scheduler = trainer_config(self._offload_source, self.args)
        if (config, scheduler) == (self.offload_config, self._scheduler_section):
            return
        changed = ", ".join(_differences(self.offload_config, config)) or "scheduler"
        if self.engine.global_steps == 0 and self.engine.micro_steps == 0:
            if self.engine.dtype is not torch.float32:
                raise ValueError(f"OffloadTrainer: the TrainingArguments changed after evaluate() built the engine "
                                 f"({changed}), and that engine trains in {self.engine.dtype}: built again, it would "
                                 f"start from the {self.engine.dtype} weights the first handed back, not the model's "
                                 "own. Set the arguments before the first evaluate(), or build a new OffloadTrainer "
                                 "over the model loaded again")
            self._finalizer()  # (the model is handed back in fp32, as it was given: the new engine starts from it)
            self.engine = None
            return
        log.warning("OffloadTrainer: the TrainingArguments changed since its engine was built (%s), and that engine "
                    "has trained, so it keeps the settings it was built with; build a new OffloadTrainer (resuming "
                    "from a checkpoint) to train with the new ones", changed)

    def _groups(self) -> list[dict[str, Any]]:
        """The engine's parameter groups: those of the optimizer a subclass's ``create_optimizer`` makes (Trainer's
        documented hook: their lr, betas, eps and weight decay per group; it must be torch's Adam or AdamW, and
        only its groups are used), else the Trainer's two (no weight decay for biases and norms)."""
        if type(self).create_optimizer is not OffloadTrainer.create_optimizer and not self._creating:
            self._creating = True
            try:
                self.optimizer = None
                made = self.create_optimizer(self.model)
            finally:
                self._creating = False
            made = made if made is not None else self.optimizer  # (an override may only set self.optimizer)
            if not isinstance(made, _EngineOptimizer):
                return _groups_of(made)
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        wd = self.offload_config.optimizer.weight_decay
        # both groups even when one is empty (a LoRA adapter has no biases): the schedule's state then has the
        # plain Trainer's shape, so either resumes from the other's checkpoint
        return [{"params": [p for n, p in named if n in decay], "weight_decay": wd},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        self._ensure_engine()
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.lr_scheduler is None and self._scheduler_section is not None:
            cfg = SchedulerConfig.from_dict(_fill_scheduler(self._scheduler_section, self.args, num_training_steps))
            self.lr_scheduler = WarmupSchedule(self.optimizer, cfg)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
                              ) -> tuple[torch.nn.Module, Any]:
        """What Trainer does here for DeepSpeed, for the engine: build it (no DDP or autocast wrapper around the
        model), the schedule, and restore a checkpoint."""
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self._follow_arguments()
        engine = self._ensure_engine()
        if resume_from_checkpoint is None:  # (a resume's load drops the window, and takes a FAILED engine too)
            self._drop_window(engine)
        self.accelerator._optimizers.append(self.optimizer)  # its step_was_skipped gates the LR step
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self._compiled() if self.args.torch_compile else self.model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model_wrapped, train_dataloader

    @staticmethod
    def _drop_window(engine: Engine) -> None:
        """An interrupted train()'s half window goes, as the Trainer's ``model.zero_grad()`` drops a plain model's
        gradients; one whose updates had started cannot be undone, and the error says how to go on."""
        if engine.phase is not Phase.ACCUMULATING:
            return
        try:
            engine.zero_grad()
        except RuntimeError as exc:
            raise RuntimeError("the last train() was interrupted after its window's last backward, whose updates "
                               "had started: resume from a checkpoint (train(resume_from_checkpoint=...)), or "
                               "apply that step first with trainer.engine.step() (the Trainer's step count and "
                               "schedule do not count it)") from exc

    def _compiled(self) -> torch.nn.Module:
        """``torch_compile=True``: the model compiled as accelerate compiles it for a plain Trainer (backend and mode
        from the TrainingArguments), once per model; the engine's hooks stay on ``self.model`` and run between the
        compiled graphs."""
        if getattr(self.model_wrapped, "_orig_mod", None) is not self.model:
            return torch.compile(self.model, backend=self.args.torch_compile_backend or "inductor",
                                 mode=self.args.torch_compile_mode)
        return self.model_wrapped
    # a step -----------------------------------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The Trainer's forward and loss normalisation; backward through the engine, which learns from the
        Trainer whether this micro-batch ends an accumulation window."""
        engine = self._ensure_engine()
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():  # (model(...) holds Ctrl-C over its forward, as engine(...) does)
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers 5.19 on; derived below before
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        engine.set_gradient_accumulation_boundary(self.accelerator.gradient_state.sync_gradients)
        # accelerate's backward divides by its own accumulation steps: 1 since a transformers 5.5 patch release, the
        # Trainer's gradient_accumulation_steps before (5.3 to 5.5.0 built its Accelerator with them)
        engine.backward(loss / self.accelerator.gradient_accumulation_steps, scale_wrt_gas=False)
        return loss.detach()

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # the engine clips (gradient_clipping = max_grad_norm) inside its step

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:
        return None  # known after the step: logged from engine.last_grad_norm

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any) -> Any:
        logs = self.control.should_log and self.state.global_step > getattr(self, "_globalstep_last_logged", -1)
        norm = self.engine.last_grad_norm if self.engine is not None and logs else grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, norm, *args, **kwargs)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluation runs the engine's model as it is (already on its device: no accelerate wrapper); after
        close(), the model as a plain Trainer would."""
        if self._closed:
            return super().evaluation_loop(*args, **kwargs)
        self._ensure_engine().apply_delayed_update()  # the delayed update's newest parameters, not the step before
        if not any(m is self.model for m in self.accelerator._models):
            self.accelerator._models.append(self.model)
        # fp16_full_eval / bf16_full_eval: the Trainer would cast the model (model.to(dtype)), taking its parameters
        # from the engine; the engine's model already computes in its training dtype, and evaluates in it
        full = (self.args.fp16_full_eval, self.args.bf16_full_eval)
        self.args.fp16_full_eval = self.args.bf16_full_eval = False
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.args.fp16_full_eval, self.args.bf16_full_eval = full

    # saving and resuming ----------------------------------------------------------------------------------------

    def _peft(self) -> Any:
        """``self.model`` if it is a peft model (peft is imported by whoever built one), else None."""
        peft = sys.modules.get("peft")
        return self.model if peft is not None and isinstance(self.model, peft.PeftModel) else None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank calls :meth:`_save` while the engine holds the weights, since their gather is collective;
        transformers before 5.23 called it on the main process alone, which left rank 0 waiting for the others in
        the checkpoint's gather while they went on to the optimizer's save."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """A folder ``from_pretrained`` loads: config.json and the fp32 weights as (sharded) safetensors, streamed
        from the engine (a peft model: its adapter, as the Trainer saves it); with several ranks every rank takes
        part and rank 0 writes."""
        if self.engine is None or state_dict is not None:  # (a state dict given: written as the Trainer writes it)
            if self.engine is None and state_dict is None and self._closed_dtype not in (None, torch.float32):
                log.warning("offload: save_model after close() writes the model's %s training weights: the fp32 "
                            "masters closed with the engine (save_model before close for them)",
                            str(self._closed_dtype).removeprefix("torch."))
            return super()._save(output_dir, state_dict)
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        model, adapter = self.model, self._peft()
        if adapter is not None:
            trainable = [k for k, t in adapter.state_dict(keep_vars=True).items() if getattr(t, "requires_grad", False)]
            masters = self.engine.consolidated_state_dict(trainable)  # collective
            adapter.save_pretrained(str(out), state_dict=masters, is_main_process=self.args.should_save)
        else:
            self.engine.save_safetensors(out, max_shard_size=self.save_max_shard_size)
        if not self.args.should_save:
            return None
        config = getattr(model, "config", None)
        if adapter is None and config is not None and hasattr(config, "save_pretrained"):
            config = copy.deepcopy(config)  # the file's: the model's own still says what it trains in
            config.architectures = [type(model).__name__]
            config.dtype = "float32"  # the weights written: the fp32 masters (from_pretrained's dtype="auto" reads it)
            if getattr(model, "is_remote_code", lambda: False)():  # trust_remote_code: its modelling files go too
                from transformers.dynamic_module_utils import custom_object_save

                custom_object_save(model, out, config=config)
            config.save_pretrained(out)
        generation = getattr(model, "generation_config", None)
        if adapter is None and generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(out)
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(out)
        torch.save(self.args, out / _ARGS_FILE)
        return None

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any, *args: Any, **kwargs: Any) -> None:
        """The Trainer's checkpoint, after rank 0 has removed the incomplete ones a killed save left (before
        rotation counts folders, so none counts as a kept checkpoint) and the trainer_state.json of the folder it
        writes into (an incomplete one, or an earlier run's): written last, it marks the folder complete again."""
        if self.args.should_save:
            run_dir = Path(self._get_output_dir(trial=trial))
            target = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            (target / TRAINER_STATE_NAME).unlink(missing_ok=True)
            for _, folder in _checkpoints(run_dir):
                missing = _lacks(folder) if folder != target else _Lacks.NOTHING
                if missing:
                    log.warning("offload: removing %s, an incomplete checkpoint (a save killed midway): it lacks %s",
                                folder, missing.describe())
                    shutil.rmtree(folder, ignore_errors=True)
        super()._save_checkpoint(model, trial, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (masters, moments, counters, loss scale) and the schedule."""
        root = Path(output_dir) / STATE_DIR
        # the Trainer may write a checkpoint folder again (a second run into one output_dir): a new tag, then the
        # old ones go once ``latest`` names it, so a crash in between leaves one loadable
        old = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("v")] if root.is_dir() else []
        engine = self._ensure_engine()
        # each rank lists the folder itself, and a shared filesystem may show them different listings (an NFS
        # attribute cache): the tag, and below what a resume finds, are rank 0's (Comm.rank0s)
        newest = max((int(p.name[1:]) for p in old if p.name[1:].isdigit()), default=0)
        tag = f"v{engine.comm.rank0s([1 + newest])[0]}"
        engine.save_checkpoint(root, tag=tag, exclude_frozen_parameters=self._peft() is not None)
        if self.args.should_save:
            for p in old:
                shutil.rmtree(p, ignore_errors=True)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / _SCHEDULER_FILE)

    def _tune_save_checkpoint(self, checkpoint_dir: str) -> None:
        """A Ray Tune trial's checkpoint: the Trainer's, with the engine's state where it writes the optimizer's
        (``trainer.optimizer`` has no state_dict), as the save_steps checkpoints hold it."""
        output_dir = os.path.join(checkpoint_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.save_model(output_dir, _internal_call=True)
        self._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:  # last: it marks the folder complete (_Lacks)
            self.state.stateful_callbacks["TrainerControl"] = self.control.state()
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """Nothing before the engine exists: :meth:`_load_optimizer_and_scheduler` restores the weights too."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        engine, folder = self._ensure_engine(), Path(checkpoint)
        state, schedule = engine.comm.rank0s([(folder / STATE_DIR / "latest").exists(),
                                              (folder / _SCHEDULER_FILE).exists()])
        if state:
            engine.load_checkpoint(folder / STATE_DIR)
        else:
            log.warning("offload: %s holds no %s/ (written by a plain Trainer, or with save_only_model=True): "
                        "loading its model weights; the Adam moments start from zero", folder, STATE_DIR)
            self._load_weights(folder)
        if self.lr_scheduler is not None and schedule:
            self.lr_scheduler.load_state_dict(torch.load(folder / _SCHEDULER_FILE, weights_only=True))
            for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                group["lr"] = lr  # the schedule's lr for the next step (loading a schedule does not set it)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's weights into the engine (Adam state stays)."""
        best = self.state.best_model_checkpoint
        if self.engine is None or best is None:
            return super()._load_best_model()
        self._load_weights(Path(best))
        return None

    def _load_weights(self, folder: Path) -> None:
        """The weights a save_model folder holds, into the engine (masters and homes); a peft model's adapter
        through peft, whose load of the model's state dict the engine takes (engine/_model_state.py)."""
        adapter = self._peft()
        if adapter is None:
            self.engine.load_state_dict(folder)
            return
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        result = set_peft_model_state_dict(adapter, load_peft_weights(str(folder)))
        if result.unexpected_keys:
            raise ValueError(f"the adapter in {folder} does not match the model: unexpected "
                             f"{result.unexpected_keys[:5]}")
