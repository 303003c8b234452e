"""offload.init: build a model whose parameters never all exist in RAM at once (DeepSpeed's ``zero.Init``).

    with offload.init(config):
        model = MyModel(...)        # or transformers.AutoModelForCausalLM.from_config(cfg)
    engine = offload.initialize(model, config)

With a placement that uses NVMe (``offload_param`` or ``offload_optimizer`` on "nvme"), every parameter a module
registers while the context is active moves into a :class:`nvme_swapper.FileArena` under that nvme_path: the
module's own initialisation writes into it as into RAM, and its pages leave RAM (the file keeps them) as soon as
the module is complete (registered into its parent) and after any later torch operation on the parameter (a
parent's re-initialisation loop, a state-dict load, the reads of ``initialize``). So building the model costs
about the largest module's parameters in RAM, not the model's. Inside ``with torch.device("cuda")`` the same holds
for the GPU: each parameter is made there and moved to the arena as it is registered (a module that initialises
its parameters after registering them, as ``nn.Linear`` does, then draws them from the CPU's random generator).
``initialize`` then streams each parameter from the arena into its homes: the fp32 value into the optimizer's
master weights (written once, exactly as the model made it), the low-precision copy into the device, host or NVMe
home; the arena's space is freed as the parameters leave it. Without NVMe in the placement the context changes
nothing: host-resident optimizer state needs more RAM than the model's fp32 values anyway, which stay where torch
puts them.

Loading weights into such a model before ``initialize`` (``offload.load_state_dict(model, path)``) streams them
into the arena tensor by tensor, so the fp32 masters start from the checkpoint's values.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from nvme_swapper import FileArena, evict_pages, in_arena

from .config import OffloadConfig, read_json, without_auto


class _EvictAfterUse(TorchFunctionMode):
    """After every torch function, the arena pages of the tensors it touched leave RAM again."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                evict_pages(value)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    if isinstance(v, torch.Tensor):
                        evict_pages(v)
        return out


def _placement(config: OffloadConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> OffloadConfig:
    """The config as ``init`` needs it, where the state lives: its placement sections, without their ``"auto"``
    values (a config written for OffloadTrainer, which fills them and the rest from the TrainingArguments)."""
    if config is None or isinstance(config, OffloadConfig):
        return OffloadConfig.load(config)
    raw = read_json(config) if isinstance(config, (str, os.PathLike)) else config
    if not isinstance(raw, Mapping):
        return OffloadConfig.load(raw)  # its error
    return OffloadConfig.load(without_auto({k: v for k, v in raw.items()
                                            if k in ("zero_optimization", "offload", "aio")}))


class init:  # noqa: N801 - used as ``with offload.init(config):``, like torch.no_grad
    """A context in which modules build their parameters in a file-backed arena on the config's NVMe path (see
    the module docstring). ``arena_path`` overrides where the arena goes; ``init.active`` says whether one is
    used (False: the placement has no NVMe, nothing changes)."""

    def __init__(self, config: OffloadConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
                 arena_path: str | os.PathLike[str] | None = None) -> None:
        cfg = _placement(config)
        zero = cfg.zero_optimization
        path = arena_path
        for section in (zero.offload_param, zero.offload_optimizer):
            if path is None and section.device == "nvme":
                path = section.nvme_path
        self.path = Path(path) if path is not None else None
        self.active = self.path is not None
        self.arena: FileArena | None = None
        self._hooks: list[Any] = []
        self._mode: _EvictAfterUse | None = None
        # a parameter registered in several modules before any registration moved it (``w = Parameter(...)``,
        # ``a.weight = w``, ``b.weight = w``): each later registration gets the arena parameter of the first. Weak
        # both ways: an arena parameter the model drops frees its range of the file at once, as without the map
        self._moved: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self.params = 0  # parameters moved into the arena
        self.bytes = 0

    def __enter__(self) -> "init":
        if not self.active:
            return self
        from .memory import prepare_nvme_path

        prepare_nvme_path(self.path, "offload.init's nvme_path")
        self.arena = FileArena(self.path)
        self._hooks = [_module.register_module_parameter_registration_hook(self._on_parameter),
                       _module.register_module_module_registration_hook(self._on_module)]
        self._mode = _EvictAfterUse()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.active:
            return
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._moved.clear()
            if self.arena is not None:
                self.arena.close()  # the tensors keep the file; its space goes with them

    def _on_parameter(self, module: torch.nn.Module, name: str, param: Any) -> torch.nn.Parameter | None:
        """A module registers ``param``: a new parameter is moved into the arena (one already there, a tied
        weight, stays as it is). One built on a GPU (inside ``with torch.device("cuda")``) moves too, so the GPU
        holds a module's parameters at a time, never the model's; one on the meta device has no values to move."""
        if type(param) is not torch.nn.Parameter or param.device.type == "meta" or in_arena(param) \
                or not param.is_floating_point():
            return None
        ref, moved_ref = self._moved.get(id(param), (None, None))
        moved = moved_ref() if moved_ref is not None else None
        if ref is not None and ref() is param and moved is not None:
            return moved  # the same parameter registered again: tied
        assert self.arena is not None
        with torch.no_grad():
            home = self.arena.tensor(param.shape, param.dtype)
            home.copy_(param.data)
        evict_pages(home)
        self.params += 1
        self.bytes += home.numel() * home.element_size()
        moved = torch.nn.Parameter(home, requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)  # its marks (transformers' _is_hf_initialized: else re-initialized)
        key = id(param)
        self._moved[key] = (weakref.ref(param, lambda _: self._moved.pop(key, None)), weakref.ref(moved))
        return moved

    def _on_module(self, parent: torch.nn.Module, name: str, child: Any) -> None:
        """``child`` is complete: its parameters' pages leave RAM."""
        if isinstance(child, torch.nn.Module):
            for p in child.parameters():
                evict_pages(p)
        return None
