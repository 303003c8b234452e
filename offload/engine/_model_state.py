"""The model's own ``state_dict()`` and ``load_state_dict()`` while an engine holds it.

After ``initialize`` the model's tensors are not the whole truth: the fp32 master weights live in the optimizer
state, and with parameter offload a module holds placeholders except while it runs. Left alone, the two calls
everybody reaches for go quietly wrong: ``model.load_state_dict(sd)`` writes only the low-precision copies, and the
next step overwrites them from the unchanged masters (stages 0-2), or fails copying into a placeholder (stage 3);
``model.state_dict()`` with parameters offloaded returns the placeholders' NaN. :class:`ModelStateHooks` routes
both through the engine, on the root and on any submodule:

* ``load_state_dict``: a pre-hook on every module with parameters in its tree takes the parameters and buffers of
  that tree out of the incoming dict and loads them with ``engine.load_state_dict`` (masters and homes, one pass
  over the optimizer state); a post-hook takes the keys it loaded out of ``missing_keys``, so ``strict`` and the
  returned keys mean what they mean in torch. ``assign=True`` changes nothing for those tensors: the engine's
  buffers stay where they are.
* ``state_dict`` (parameter offload only; otherwise the parameters are the model's tensors, already current): a
  post-hook on every module with parameters of its own replaces each placeholder with the parameter's current
  low-precision value, a new host tensor (with several ranks in stage 3 this gathers: every rank calls it, in
  the same order). ``keep_vars=True`` hands back the parameters themselves, as torch does.
"""

from __future__ import annotations

from typing import Any

import torch

from .._hooks import Hook


class ModelStateHooks:
    """Installs the hooks on ``engine.module``; the engine removes them (``handles``) with its own at close."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        root = engine.module
        self._path = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        self._loaded: dict[int, set[str]] = {}  # id(module) -> keys its pre-hook loaded, for its post-hook
        self.handles: list[Any] = []
        offloaded = engine.weights.params is not None
        for mod in root.modules():
            if next(mod.parameters(), None) is None:
                continue
            self.handles.append(mod.register_load_state_dict_pre_hook(Hook(self._load)))
            self.handles.append(mod.register_load_state_dict_post_hook(Hook(self._unmiss)))
            if offloaded and next(mod.parameters(recurse=False), None) is not None:
                self.handles.append(mod.register_state_dict_post_hook(Hook(self._values)))

    def _full(self, mod: torch.nn.Module, name: str) -> str:
        """``name`` (relative to ``mod``) as the engine's module names it."""
        path = self._path[id(mod)]
        return f"{path}.{name}" if path else name

    def _load(self, mod: torch.nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any, _strict: bool,
              _missing: list[str], unexpected: list[str], *_: Any) -> None:
        tensors = [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]
        mine = {self._full(mod, name): state_dict.pop(prefix + name) for name, _ in tensors
                if prefix + name in state_dict}
        if not mine:  # an enclosing module's pre-hook has loaded this tree already
            return
        given = {self._full(mod, name): prefix + name for name, _ in tensors if self._full(mod, name) in mine}
        self._loaded[id(mod)] = set(given.values())
        result = self._engine.load_state_dict(mine, strict=False)
        unexpected += [given.get(k, k) for k in result.unexpected]  # a tied tensor's second value, not loaded

    def _unmiss(self, mod: torch.nn.Module, incompatible: Any) -> None:
        loaded = self._loaded.pop(id(mod), None)
        if loaded:
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in loaded]

    def _values(self, mod: torch.nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
        for name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            key = prefix + name
            if key in state_dict and state_dict[key] is not p:  # keep_vars=True: the parameter itself
                state_dict[key] = self._engine.read_parameter(p).view(p.shape)
