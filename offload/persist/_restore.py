"""A checkpoint loaded into a running engine (``engine.load_checkpoint``): checked against the model before the
first byte of the engine's state is written (entries, shapes, param groups, the client state read), then the
optimizer state sub-group by sub-group, the training state, and each parameter's working copy.

DeepSpeed's partial loads are here too: the weights alone (``load_optimizer_states=False``, ``load_module_only``)
go by name, so a parameter trainable in one and frozen in the other takes the checkpoint's tensor. What a load
reads and writes of an engine is its state contract (:class:`offload._state.EngineState`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..optim._schedule import WarmupSchedule
from ._entries import frozen_and_buffers, group_names, other_shapes, pieces, trainable_names
from ._format import KINDS
from ._reader import Checkpoint, few

if TYPE_CHECKING:
    from .._state import EngineState


def load(engine: "EngineState", root: Path, tag: str | None, before_write: Any = None, *, optimizer: bool = True,
         counters: bool = True, scheduler: bool = True) -> tuple[Path, dict[str, Any]]:
    """Loads ``root/tag`` into ``engine``; returns that folder and the client_state saved with it ({} if none).
    ``before_write()`` runs once the checkpoint has been checked against the model, right before the first byte of
    the engine's state is overwritten. DeepSpeed's partial loads: without ``optimizer`` the weights go into the
    masters and Adam's moments, its step count, the param groups' hyperparameters and the loss scale stay the
    engine's; without ``counters`` the engine's step counters stay; without ``scheduler`` its LR schedule does."""
    ck = Checkpoint(root, tag)
    meta = ck.meta
    try:
        names = trainable_names(engine)
        layout, opt = engine.layout, engine.optimizer
        frozen = not meta.get("frozen_excluded", False)
        source = _sources(engine, names, ck.shapes, frozen, optimizer, meta.get("state_dict", {}))
        _check_matches(engine, names, ck, source, optimizer)
        groups = _match_groups(engine, names, meta, ck.folder) if optimizer else None
        client = _client_state(ck.folder, meta.get("client_state"))  # read before the engine is touched
        if before_write is not None:
            before_write()
        for sg in layout.sub_groups:
            if optimizer:
                block = opt.stage_state(sg)
                block.zero_()  # padding between parameters
            else:  # the masters alone: the moments are read to be kept
                block = opt.read_state(sg)
            try:
                for name, view, offset in pieces(sg, block, names):
                    if name in source:
                        ck.read_range_as(source[name], view, offset)
            finally:
                opt.done_state(sg, dirty=True)
        opt.wait()
        state = engine.training_state()
        if counters:  # saved where a window ended: under another gradient_accumulation_steps (or another number
            # of ranks under a fixed train_batch_size) the next micro-batch starts one too, as if the run had always
            # had this engine's; under the same, the count goes on (windows a loop ended early included)
            gas, micro = engine.gradient_accumulation_steps, meta["micro_steps"]
            same = meta.get("gradient_accumulation_steps", gas if micro % gas == 0 else None) == gas
            state.global_steps = meta["global_steps"]
            state.micro_steps = micro if same else meta["global_steps"] * gas
            state.global_samples = meta.get("global_samples")  # (None: counted from the steps at today's batch)
            if not optimizer:  # the overflow skips are counted with the steps (DeepSpeed's skipped_steps)
                state.loss_scaler = {**state.loss_scaler, "skipped": meta["loss_scaler"]["skipped"]}
        if optimizer:
            state.optimizer_steps = meta["optimizer_steps"]
            state.loss_scaler = _scaler_state(engine, meta, counters)
            state.param_groups, state.pending_update = groups, bool(meta.get("pending_update"))
        else:
            state.pending_update = False  # the device copies come from the masters just loaded
        if scheduler:
            state.lr_scheduler = meta.get("lr_scheduler")
        engine.load_training_state(state)
        if isinstance(engine.lr_scheduler, WarmupSchedule):  # the config's schedule, at the position kept or
            # loaded, sets the lr; a scheduler assigned in its place keeps the param groups' (DeepSpeed's order)
            for group, lr in zip(opt.param_groups, engine.lr_scheduler.get_last_lr()):
                group["lr"] = lr
        pending = engine.training_state().pending_update  # only where this engine runs the delayed update too
        with torch.no_grad():
            for i, (name, p) in enumerate(zip(names, layout.params)):
                master = ck.read(source[f"param/{name}"])
                if pending:  # resume mid-pipeline: the device keeps the previous parameters one more step
                    engine.write_pending(i, ck.read(f"device/{name}"), master)
                else:
                    engine.write_parameter(p, master)  # the working copy: master rounded to the training dtype
            trainable = {id(p) for p in layout.params}
            for n, p in engine.module.named_parameters():
                if id(p) not in trainable and f"frozen/{n}" in source:
                    engine.write_parameter(p, ck.read(source[f"frozen/{n}"]))
            for n, b in engine.module.named_buffers():
                b.copy_(engine.copies.upload(ck.read(f"buffer/{n}")))
    finally:
        ck.close()
    return ck.folder, client


def _match_groups(engine: "EngineState", names: list[str], meta: Mapping[str, Any],
                  folder: Path) -> list[dict[str, Any]]:
    """The checkpoint's param-group hyperparameters in this engine's order of groups, matched by the parameters
    each holds: groups listed in another order keep their own decay and lr. Groups that differ are refused before
    anything is written (torch's Optimizer.load_state_dict refuses groups of other sizes)."""
    saved, ours = meta["param_groups"], group_names(engine, names)
    members = meta.get("param_group_names")
    if members is None:  # written before the groups' members were saved: by order, as torch matches them
        if len(saved) == len(ours):
            return saved
        theirs = f"{len(saved)} group(s)"
    else:
        index = {frozenset(m): i for i, m in enumerate(members)}
        order = [index.get(frozenset(g)) for g in ours]
        if len(members) == len(ours) and None not in order:
            return [saved[i] for i in order if i is not None]
        theirs = f"{len(members)} group(s) ({_described(members)})"
    raise ValueError(f"checkpoint {folder} does not match the optimizer's param groups: it has {theirs}, this "
                     f"engine {len(ours)} ({_described(ours)}). A whole load restores each group's lr, betas, eps "
                     "and weight_decay with Adam's state, so it needs the same groups, in any order: build the "
                     "engine with the checkpoint's groups, or load the weights alone (load_optimizer_states=False) "
                     "and go on with this engine's groups and fresh Adam state")


def _described(groups: list[list[str]]) -> str:
    return "; ".join(f"{len(g)} parameter(s) {g[:3]}{' ...' if len(g) > 3 else ''}" for g in groups)


def _scaler_state(engine: "EngineState", meta: Mapping[str, Any], counters: bool) -> dict[str, Any]:
    """The loss scaler's state a whole load restores: the checkpoint's where both it and this engine scale fp16
    losses dynamically; otherwise this engine's own (a bf16 engine stays unscaled, an fp16 one starts at its
    configured scale). The count of skipped steps is a counter: the checkpoint's where counters are loaded."""
    theirs, own = meta["loss_scaler"], engine.scaler.state_dict()
    dynamic = theirs.get("dynamic", meta.get("dtype") == "torch.float16")  # (older checkpoints: from the dtype)
    state = dict(theirs) if dynamic and engine.scaler.dynamic else own
    return {**state, "skipped": theirs["skipped"] if counters else own["skipped"]}


def _client_state(folder: Path, name: str | None) -> Any:
    """The client_state a checkpoint holds ({} if none), or ValueError naming the file if it cannot be read."""
    if not name:
        return {}
    try:
        return torch.load(folder / name, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {folder} is damaged: its meta.json names {name}, which is missing; nothing "
                         "was loaded") from None
    except Exception as exc:  # noqa: BLE001 - torch's reader raises RuntimeError/UnpicklingError/EOFError
        raise ValueError(f"checkpoint {folder / name} is damaged ({type(exc).__name__}: {str(exc)[:200]}); nothing "
                         "was loaded") from None


def _sources(engine: "EngineState", names: list[str], held: Mapping[str, Any], frozen: bool,
             optimizer: bool, saved_keys: Mapping[str, str]) -> dict[str, str]:
    """The entry this engine would save -> the checkpoint's entry it loads from. A whole load needs the same
    trainable set (Adam's state is per trainable parameter): each entry its own. The weights alone (DeepSpeed's
    load_module_only, load_optimizer_states=False) go by name, as DeepSpeed's ``module.load_state_dict`` does: a
    parameter trainable here and frozen in the checkpoint, or the reverse, takes the checkpoint's tensor. A frozen
    parameter the checkpoint left out (``exclude_frozen_parameters``) keeps its value. A name the checkpoint kept
    as a tie (``saved_keys``: the state_dict key -> its entry) loads from the tensor it was tied to, so a model
    untied since (a head of its own) gets the saved head."""
    if optimizer:
        ours = [f"{k}/{n}" for n in names for k in KINDS] + list(frozen_and_buffers(engine, frozen))
        return {n: n for n in ours}
    trainable = {id(p) for p in engine.layout.params}
    by_name = {n.split("/", 1)[1]: n for n in held if n.startswith(("param/", "frozen/"))}
    for key, entry in saved_keys.items():
        if entry in held and entry.startswith(("param/", "frozen/")):
            by_name.setdefault(key, entry)
    source = {}
    for n, p in engine.module.named_parameters():
        mine = f"param/{n}" if id(p) in trainable else f"frozen/{n}"
        if n in by_name:
            source[mine] = by_name[n]
        elif id(p) in trainable or frozen:
            source[mine] = mine  # missing: named as this engine would save it
    source.update({f"buffer/{n}": f"buffer/{n}" for n, _ in engine.module.named_buffers()})
    return source


def _check_matches(engine: "EngineState", names: list[str], ck: Checkpoint, source: Mapping[str, str],
                   optimizer: bool) -> None:
    """Refuses, before anything is written, a checkpoint whose entries are not the ones ``source`` reads (every
    one of them, the optimizer's aside in a load of the weights alone) at the model's shapes."""
    expected = {f"{k}/{n}": tuple(p.shape) for n, p in zip(names, engine.layout.params) for k in KINDS}
    expected.update(other_shapes(engine, frozen=True))
    found = {n: tuple(s) for n, s in ck.shapes.items() if not n.startswith("device/")
             and (optimizer or not n.startswith(tuple(f"{k}/" for k in KINDS[1:])))}
    missing = sorted(theirs for theirs in source.values() if theirs not in found)
    unexpected = sorted(set(found) - set(source.values()))
    shapes: dict[str, str] = {}  # by the model's name (an entry per Adam moment says no more)
    for mine, theirs in source.items():
        if theirs in found and found[theirs] != expected[mine]:
            shapes.setdefault(mine.split("/", 1)[1], f"checkpoint {list(found[theirs])}, model {list(expected[mine])}")
    if not (missing or unexpected or shapes):
        return
    flipped = sorted({n.split("/", 1)[1] for n in missing} & {n.split("/", 1)[1] for n in unexpected})
    hint = (f"; {flipped[:5]} are trainable in one and frozen in the other: a whole load needs the same trainable "
            "parameters (Adam's state is theirs), load_optimizer_states=False or load_module_only=True loads the "
            "weights alone, by name") if flipped else ""
    differ = "; ".join(f"{n}: {d}" for n, d in list(shapes.items())[:5]) + (" ..." if len(shapes) > 5 else "")
    raise ValueError(f"checkpoint {ck.folder} does not match the model: missing {few(missing)}, unexpected "
                     f"{few(unexpected)}, shapes differ for {len(shapes)} ({differ or 'none'}){hint}. To load the "
                     "tensors that match into this engine: python -m offload export the checkpoint, then "
                     "engine.load_state_dict(that folder, strict=False)")
