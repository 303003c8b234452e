"""What ``initialize`` checks and says before and while it builds an engine: the model it accepts (a module of
plain tensors that no open engine holds), the trainable parameters in their groups, the settings every rank must
share, the warnings about a slow or widened dtype, and what a failed build says it left moved."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch

from .. import _state
from .._cleanup import note_on
from .._device import fast_bf16
from .._hooks import unwrap_compiled
from ..config import OffloadConfig, flat_fields
from ..plan import Plan
from ._step import Phase

log = logging.getLogger("offload")


def accepted(model: Any, cfg: OffloadConfig) -> torch.nn.Module:
    """The module an engine of ``model`` hooks and names (the one ``torch.compile`` wraps), once checked: a module,
    with plain tensors, that no open engine holds."""
    if not cfg.optimizer_given and isinstance(model, torch.nn.Module) and any(
            p.requires_grad for p in model.parameters()):  # (a frozen model's engine has nothing to update)
        log.warning("offload: the config has no optimizer section, so the defaults train: AdamW, lr %g, betas "
                    "%s, eps %g, weight_decay %g (where a param group sets none of its own). An optimizer passed "
                    "to deepspeed.initialize has no counterpart here: give its settings in the config's "
                    "optimizer section (docs/configuration.md)",
                    cfg.optimizer.lr, list(cfg.optimizer.betas), cfg.optimizer.eps, cfg.optimizer.weight_decay)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    module = unwrap_compiled(model)
    check_tensors(module)
    left = _state.holding(module)
    if left is not None and left.phase is Phase.CLOSED:  # a close, or a failed initialize's cleanup, that a
        left.close()  # second Ctrl-C cut short: its model's parameters are handed back now
    if _state.holding(module) is not None:
        raise ValueError("initialize: this model is held by an engine that is still open (its hooks and "
                         "parameters are that engine's); close it first (engine.close(), or `with "
                         "offload.initialize(...) as engine:`), which hands the model back with its current "
                         "weights")
    return module


_warned_bf16 = False


def warn_slow_bf16(device: torch.device, dtype: torch.dtype) -> None:
    """Once per process: bf16 compute on a CPU without native bf16 is ~100x slower than fp32."""
    global _warned_bf16
    if dtype is torch.bfloat16 and not _warned_bf16 and not fast_bf16(device):
        _warned_bf16 = True
        log.warning("offload: bf16 on %s, which has no native bf16 (AVX-512 BF16 or AMX): torch's bf16 matmuls run "
                    "about 100x slower than fp32 here. The CPU device tier is for testing; train on a GPU, or set "
                    "bf16.enabled false", device)


# config keys each rank may set for itself: where its files, memory and disk are, and how it waits
_PER_RANK = ("nvme_path", "pin_memory", "buffer_count", "fast_init", "aio.", "offload.device",
             "offload.device_memory_budget", "offload.host_memory_budget", "offload.nvme_memory_budget",
             "offload.comm_timeout", "offload.trim_host_heap", "seed", "ignored", "batch_keys", "optimizer_given")
# what the plan derives that the ranks' collectives depend on (the layout of the flat buffers, the buckets, the
# stage-3 window that decides when each parameter is gathered)
_PLAN_SHARED = ("stage", "partition", "dtype", "gradient_accumulation_steps", "sub_group_size", "grad_bucket",
                "max_live", "prefetch_bucket", "persistence_threshold", "overlap", "overlap_forward", "delayed")


def shared_settings(cfg: OffloadConfig, plan: Plan) -> dict[str, Any]:
    """The settings every rank must share (see :func:`offload.dist.agree_on_settings`), by dotted name."""
    out = {name: value for name, value in flat_fields(cfg).items()
           if not any(name.startswith(key) or name.endswith("." + key) for key in _PER_RANK)}
    out.update({f"plan.{name}": getattr(plan, name) for name in _PLAN_SHARED})
    return out


def warn_widened(params: list[torch.Tensor], dtype: torch.dtype) -> None:
    """A model given in bf16 or fp16 to a config that trains in fp32 (neither bf16 nor fp16 enabled) is widened
    to fp32 on every tier: said, since a model loaded in bf16 to fit in memory would then need twice as much."""
    size = torch.empty((), dtype=dtype).element_size()
    narrow_params = [p for p in params if p.is_floating_point() and p.element_size() < size]
    narrow = sorted({str(p.dtype).removeprefix("torch.") for p in narrow_params})
    if narrow:
        log.warning("offload: the model's trainable parameters are %s and the config trains in %s (bf16.enabled and "
                    "fp16.enabled are false): initialize widens them, %dx their bytes; to train in bfloat16 with "
                    "fp32 master weights set bf16.enabled true (transformers: TrainingArguments(bf16=True))",
                    " and ".join(narrow), str(dtype).removeprefix("torch."),
                    size // min(p.element_size() for p in narrow_params))


def check_tensors(module: torch.nn.Module) -> None:
    """Refuses, before anything moves, what the engine cannot train: a tensor on the meta device (no values to
    train from), a float64 trainable parameter (the masters are fp32; rounding it silently would change the
    model, and its float64 inputs would then meet fp32 weights), and a trainable embedding whose forward writes its
    own weight (``max_norm``)."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"initialize: {kind} {name!r} is on the meta device (it has no values): build the model inside "
                    "`with offload.init(config):` and load its weights with offload.load_state_dict(model, path), "
                    "or give it values first (model.to_empty(device='cpu') and its own initialisation, or "
                    "load_state_dict(..., assign=True))")
            if kind == "parameter" and t.requires_grad and t.dtype == torch.float64:
                raise ValueError(
                    f"initialize: parameter {name!r} is float64; the engine keeps fp32 master weights and computes "
                    "in bf16, fp16 or fp32 (the config's bf16/fp16 sections): convert the model first "
                    "(model.float()), and its inputs with it")
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None \
                and m.weight.requires_grad:
            raise ValueError(
                f"initialize: {type(m).__name__} {name or '(the model)'!r} has max_norm={m.max_norm}: its forward "
                "renormalises the rows it reads in place, in the weight the forward uses, which the engine's fp32 "
                "master copy would never see (the next step writes the rows back unrenormalised: the run drifts from "
                "torch's without a word). Set max_norm=None, and renormalise in the loss if you need it, or freeze "
                "the embedding (requires_grad_(False))")


def trainable_groups(module: torch.nn.Module, param_groups: Iterable[dict[str, Any]] | None
                     ) -> tuple[list[list[torch.nn.Parameter]], list[dict[str, Any]]]:
    """The trainable parameters in groups, with per-group options, checked against the model."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if param_groups is None:
        return [trainable], [{}]
    ids = {id(p) for p in trainable}
    groups, options, seen = [], [], set()
    for i, g in enumerate(param_groups):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ValueError(f"param_groups[{i}] must be a dict with a 'params' list")
        params = list(g["params"])
        for p in params:
            if id(p) not in ids:
                raise ValueError(f"param_groups[{i}] holds a tensor that is not a trainable parameter of the model")
            if id(p) in seen:
                raise ValueError(f"param_groups[{i}] repeats a parameter already in an earlier group")
            seen.add(id(p))
        unknown = set(g) - {"params", "lr", "betas", "eps", "weight_decay", "bias_correction", "adamw_mode"}
        if unknown:
            raise ValueError(f"param_groups[{i}]: unknown option {sorted(unknown)[0]!r}; allowed: lr, betas, eps, "
                             "weight_decay, bias_correction, adamw_mode")
        groups.append(params)
        options.append({k: v for k, v in g.items() if k != "params"})
    missing = [p for p in trainable if id(p) not in seen]
    if missing:
        raise ValueError(f"param_groups leave {len(missing)} trainable parameter(s) out; add them to a group or set "
                         "requires_grad=False")
    return groups, options


def note_moved(module: torch.nn.Module, given: dict[int, tuple[torch.dtype, torch.device]],
                error: BaseException) -> None:
    """A failure after parameters began moving to their homes (a disk or device error; budgets are all checked
    before the first move) hands them back where and how the engine held them: says so on ``error``, so that nobody
    trains on, say, bf16-rounded weights believing them the fp32 ones they loaded."""
    moved = [(name, p) for name, p in module.named_parameters() if (p.dtype, p.device) != given.get(id(p))]
    if not moved:
        return
    now = sorted({f"{p.dtype} on {p.device}" for _, p in moved})
    names = ", ".join(name for name, _ in moved[:3]) + (", ..." if len(moved) > 3 else "")
    rounded = " (their values rounded to it)" if any(p.dtype != given[id(p)][0] for _, p in moved) else ""
    note_on(error, f"initialize had moved {len(moved)} of {len(given)} parameters ({names}) when it failed; they "
                   f"are left as {' and '.join(now)}{rounded}: reload the model's weights, or build it again, before "
                   "using it")
