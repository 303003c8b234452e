"""transformers' checkpoint conversions, applied while a checkpoint streams in and reverted as an export streams out.

transformers 5 keeps some layers in another layout than the checkpoints on the Hub: Mixtral's (and Qwen-MoE's,
DeepSeek's...) experts as one fused ``gate_up_proj`` / ``down_proj`` tensor each where a checkpoint holds
``block_sparse_moe.experts.{i}.w1/w2/w3.weight``, renamed keys (``LayerNorm.gamma``), and ``save_pretrained``
writes the Hub's layout back. ``from_pretrained`` converts with the model's own mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``); :class:`ConvertedSource` applies the same
mapping to a :class:`~offload._load.StateSource`, so a load into a model built under ``offload.init`` (or into an
engine) sees the model's names. It reads one converted group at a time (one layer's experts), and the shapes that
loads check before writing come from running the conversion on meta tensors, so no data is read for them.

:class:`HubLayout` is the way back, as ``save_pretrained`` writes it (``revert_weight_conversion``): an export of a
transformers model holds the Hub's names and layout, which vLLM, older transformers and the Hub's tools read, one
model tensor reverted at a time.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from ._load import StateSource

log = logging.getLogger(__name__)


def _natural(key: str) -> list[Any]:
    """``experts.10`` after ``experts.9``: the order a fused tensor stacks its parts in."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split(".")]


def _mapping(module: torch.nn.Module) -> list[Any]:
    """The model's conversions ([] for a model that is not a transformers one, or a transformers without them)."""
    if "transformers" not in sys.modules:  # a transformers model would have imported it
        return []
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        return []
    try:  # transformers 5's loading API; an older one converts nothing at load either
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import rename_source_key  # noqa: F401 - ConvertedSource's
    except ImportError:
        return []
    return list(get_model_conversion_mapping(module))


def converted(src: "StateSource", module: torch.nn.Module) -> "StateSource | ConvertedSource":
    """``src`` as ``module`` names its tensors: a :class:`ConvertedSource` where a conversion applies to some
    checkpoint key, else ``src`` itself."""
    mapping = _mapping(module)
    if not mapping:
        return src
    view = ConvertedSource(src, module, mapping)
    return view if view.renames else src


class ConvertedSource:
    """A checkpoint read through the model's conversions: ``names()``, ``shape()`` and ``get()`` in the model's
    spelling (the base-model prefix is still the loader's to match). ``close()`` releases it and the source."""

    def __init__(self, src: "StateSource", module: torch.nn.Module, mapping: list[Any]) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self._src, self._module = src, module
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        model_keys = set(module.state_dict(keep_vars=True))
        self._plain: dict[str, str] = {}  # model-side name -> checkpoint key
        self._groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}  # converter, its (pattern, key)s
        self.renames = False  # some key is read under another name
        for key in sorted(src.names(), key=_natural):
            renamed, pattern = rename_source_key(key, renamings, converters)
            if renamed not in model_keys and key in model_keys:
                renamed, pattern = key, None  # a key the model has as it is: not one to convert
            if pattern is None:
                self._plain.setdefault(renamed, key)
            else:
                self._groups.setdefault(renamed, (by_pattern[pattern], []))[1].append((pattern, key))
            self.renames |= renamed != key
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._group_of: dict[str, str] = {}  # converted name -> its group
        for group in self._groups:
            for name, t in self._convert(group, meta=True).items():
                self._shapes[name] = tuple(t.shape)
                self._group_of[name] = group
        self._ready: dict[str, torch.Tensor] = {}  # a group's other outputs, until asked for

    def _convert(self, group: str, meta: bool) -> dict[str, torch.Tensor]:
        """One group's conversion (a fresh copy of its converter: converting consumes what it collected), on meta
        tensors of the stored shapes or on the stored tensors."""
        template, members = self._groups[group]
        converter = copy.deepcopy(template)
        for pattern, key in members:
            t = torch.empty(self._src.shape(key), device="meta") if meta else self._src.get(key)
            converter.add_tensor(group, key, pattern, t)
        try:
            return converter.convert(group, model=self._module, config=getattr(self._module, "config", None))
        except Exception as exc:  # noqa: BLE001 - any failure of transformers' conversion names the tensors
            raise ValueError(f"converting checkpoint tensors {[k for _, k in members][:4]} into {group} "
                             f"(transformers' conversion for {type(self._module).__name__}) failed: {exc}") from exc

    def names(self) -> list[str]:
        return list(self._plain) + list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name] if name in self._shapes else self._src.shape(self._plain[name])

    def origin(self, name: str) -> str:
        """A converted name with the checkpoint keys it comes from, for errors."""
        if name not in self._group_of:
            return self._src.origin(self._plain[name])
        keys = [k for _, k in self._groups[self._group_of[name]][1]]
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        return f"{name} (converted from {keys[0]}{more})"

    def get(self, name: str) -> torch.Tensor:
        if name in self._plain:
            return self._src.get(self._plain[name])
        if name not in self._ready:
            self._ready.update(self._convert(self._group_of[name], meta=False))
        return self._ready.pop(name)

    def close(self) -> None:
        self._ready.clear()
        self._src.close()

    def __enter__(self) -> "ConvertedSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



class HubLayout:
    """An export's names: each of the model's tensors (``shapes``: state-dict key -> shape, in the export's order)
    as the tensors ``save_pretrained`` writes for it (a fused expert tensor as one per expert and projection),
    learnt by reverting meta tensors. ``outputs``: key -> [(name, shape)]."""

    def __init__(self, module: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self._module, self._revert_fn = module, revert_weight_conversion
        meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
        whole = {n: tuple(t.shape) for n, t in revert_weight_conversion(module, dict(meta)).items()}
        self.outputs: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for key, shape in shapes.items():
            if whole.get(key) == shape:  # kept as it is
                self.outputs[key] = [(key, shape)]
            else:
                out = revert_weight_conversion(module, {key: meta[key]})
                self.outputs[key] = [(n, tuple(t.shape)) for n, t in out.items()]
        self.consistent = {n: s for outs in self.outputs.values() for n, s in outs} == whole
        self.changes = any(outs != [(k, shapes[k])] for k, outs in self.outputs.items())

    def sizes(self, itemsize: dict[str, int]) -> list[tuple[str, int]]:
        """(name, bytes) of every tensor the export writes, in order; ``itemsize``: each model key's."""
        return [(n, math.prod(s) * itemsize[k]) for k, outs in self.outputs.items() for n, s in outs]

    def reader(self, read_model: Callable[[list[str]], dict[str, torch.Tensor]]
               ) -> Callable[[list[str]], dict[str, torch.Tensor]]:
        """``read_model`` (model keys -> tensors; a collective with several ranks, {} on the ranks that do not
        write) as a reader of export names. A model tensor whose outputs straddle two shards is read once: the
        outputs of the later shard wait here. Which keys a call reads depends only on the names, the same on
        every rank."""
        source = {n: k for k, outs in self.outputs.items() for n, _ in outs}
        done: set[str] = set()
        ready: dict[str, torch.Tensor] = {}

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            keys = list(dict.fromkeys(source[n] for n in names if source[n] not in done))
            done.update(keys)
            for key, t in read_model(keys).items():
                ready.update(self._revert_fn(self._module, {key: t}))
            return {n: ready.pop(n) for n in names if n in ready}

        return read


def hub_layout(module: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> HubLayout | None:
    """The export's :class:`HubLayout` where it differs from the model's names, else None (not a transformers
    model; no conversion; one this code cannot revert tensor by tensor, logged: the model's names are written, which
    transformers 5 loads)."""
    if not _mapping(module):
        return None
    hub = HubLayout(module, shapes)
    if not hub.changes:
        return None
    if not hub.consistent:
        log.warning("export: transformers' reversion of %s's layout needs several tensors at once; writing the "
                    "model's own names (transformers 5 loads them; other readers may expect the Hub's)",
                    type(module).__name__)
        return None
    return hub
