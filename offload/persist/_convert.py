"""transformers' checkpoint conversions, applied while a checkpoint streams in and reverted as an export streams out.

transformers 5 keeps some layers in another layout than the checkpoints on the Hub: Mixtral's (and Qwen-MoE's,
DeepSeek's...) experts as one fused ``gate_up_proj`` / ``down_proj`` tensor each where a checkpoint holds
``block_sparse_moe.experts.{i}.w1/w2/w3.weight``, renamed keys (``LayerNorm.gamma``), and ``save_pretrained``
writes the Hub's layout back. ``from_pretrained`` converts with the model's own mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``); :class:`ConvertedSource` applies the same
mapping to a :class:`~offload.persist._load.StateSource`, so a load into a model built under ``offload.init`` (or into
an engine) sees the model's names. It reads one converted group at a time (one layer's experts), and the shapes that
loads check before writing come from running the conversion on meta tensors, so no data is read for them.

:class:`HubLayout` is the way back, as ``save_pretrained`` writes it (``revert_weight_conversion``): an export of a
transformers model holds the Hub's names and layout, which vLLM, older transformers and the Hub's tools read,
reverted one set of model tensors at a time (those one reverse converter joins).

:func:`buffers_from_pretrained_keeps` is the third convention: the buffers a model loaded in a half dtype still
holds in fp32 (RoPE's frequencies), which a bf16 or fp16 engine leaves in fp32 when it converts a model given in fp32.
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable

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


def buffers_from_pretrained_keeps(module: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """The float buffers (qualified names) that ``from_pretrained(dtype=dtype)`` builds in another dtype than
    ``dtype``: RoPE's ``inv_freq`` stays fp32 beside bf16 weights (rounded to bf16, its angles drift by radians at
    long positions). A transformers model only (or a peft model around one), read from a twin built on the meta
    device under ``dtype`` as the default, as from_pretrained builds it; empty otherwise, or where the twin cannot
    be built."""
    if "transformers" not in sys.modules or not dtype.is_floating_point or dtype == torch.float32:
        return set()
    from transformers import PreTrainedModel

    prefix, peft = "", sys.modules.get("peft")
    if peft is not None and isinstance(module, peft.PeftModel):  # LoRA: the base model's buffers, by its path
        base = module.get_base_model()
        prefix = next(name for name, m in module.named_modules() if m is base) + "."
        module = base
    if not isinstance(module, PreTrainedModel):
        return set()
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            twin = type(module)(copy.deepcopy(module.config))
    except Exception as exc:  # noqa: BLE001 - a model that cannot be rebuilt from its config: buffers convert
        log.warning("offload: %s could not be rebuilt on the meta device to read its buffers' dtypes (%s: %s); "
                    "its float buffers are converted to %s", type(module).__name__, type(exc).__name__, exc, dtype)
        return set()
    finally:
        torch.set_default_dtype(default)
    return {prefix + name for name, b in twin.named_buffers() if b.is_floating_point() and b.dtype != dtype}


def prefix_side(module: torch.nn.Module, model_names: Iterable[str],
                checkpoint_names: Iterable[str]) -> tuple[str, bool] | None:
    """Where the model's base-model prefix (``lead``, with its dot) differs between the model's names and a
    checkpoint's, decided once for the whole checkpoint as ``from_pretrained`` decides it: ``(lead, True)`` for a
    base model's checkpoint into the model with a head (the model's names carry it), ``(lead, False)`` for the
    reverse, None where both spell it alike."""
    lead = (getattr(module, "base_model_prefix", "") or "") + "."
    model_has, checkpoint_has = (any(n.startswith(lead) for n in group) for group in (model_names, checkpoint_names))
    return None if lead == "." or model_has == checkpoint_has else (lead, model_has)


def _to_model_prefix(module: torch.nn.Module, model_keys: set[str], names: list[str]) -> Callable[[str], str]:
    """The checkpoint's (renamed) names in the model's prefix (:func:`prefix_side`)."""
    side = prefix_side(module, model_keys, names)
    if side is None:
        return lambda n: n
    lead, model_has = side
    if model_has:
        return lambda n: lead + n
    return lambda n: n[len(lead):] if n.startswith(lead) else n


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
        self._plain: dict[str, str] = {}  # name as read -> checkpoint key
        self._groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}  # converter, its (pattern, key)s
        self.unused: list[str] = []  # checkpoint keys no model name reads (a failed group's; a doubled key)
        self.renames = False  # some key is read under another name, or converted (a Transpose keeps its name)
        entries = [(key, *rename_source_key(key, renamings, converters)) for key in sorted(src.names(), key=_natural)]
        prefix = _to_model_prefix(module, model_keys, [renamed for _, renamed, _ in entries])
        for key, renamed, pattern in entries:
            renamed = prefix(renamed)  # a converter looks its target up in the model by this name
            if renamed not in model_keys and key in model_keys:
                renamed, pattern = key, None  # a key the model has as it is: not one to convert
            self.renames |= renamed != key or pattern is not None
            if pattern is not None:
                self._groups.setdefault(renamed, (by_pattern[pattern], []))[1].append((pattern, key))
            elif renamed in self._plain:  # two keys for one tensor (LayerNorm.gamma beside LayerNorm.weight)
                self._keep_spelt_as_the_model(renamed, key)
            else:
                self._plain[renamed] = key
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._group_of: dict[str, str] = {}  # converted name -> its group
        self.failures: list[str] = []  # groups whose conversion failed (their keys read as they are)
        for group in list(self._groups):
            try:
                outputs = self._convert(group, meta=True)
            except ValueError as exc:
                self.failures.append(str(exc))
                self.unused += [k for _, k in self._groups.pop(group)[1]]
                continue
            if any(name in self._plain for name in outputs):  # held converted too: that one is the model's
                self.unused += [k for _, k in self._groups.pop(group)[1]]
                continue
            for name, t in outputs.items():
                self._shapes[name] = tuple(t.shape)
                self._group_of[name] = group
        self._ready: dict[str, torch.Tensor] = {}  # a group's other outputs, until asked for

    def _keep_spelt_as_the_model(self, name: str, key: str) -> None:
        """Two checkpoint keys read as ``name``: the one spelt as the model spells it is read as ``name``, the
        other is unused (a load reports it as unexpected, never drops it silently)."""
        if key == name:
            self.unused.append(self._plain[name])
            self._plain[name] = key
        else:
            self.unused.append(key)

    def _convert(self, group: str, meta: bool) -> dict[str, torch.Tensor]:
        """One group's conversion (a fresh copy of its converter: converting consumes what it collected), on meta
        tensors of the stored shapes or on the stored tensors (each shard opened once for the group)."""
        template, members = self._groups[group]
        converter = copy.deepcopy(template)
        keys = [k for _, k in members]
        stored = {k: torch.empty(self._src.shape(k), device="meta") for k in keys} if meta else \
            self._src.get_many(keys)
        for pattern, key in members:
            converter.add_tensor(group, key, pattern, stored.pop(key))
        try:
            return converter.convert(group, model=self._module, config=getattr(self._module, "config", None))
        except Exception as exc:  # noqa: BLE001 - any failure of transformers' conversion names the tensors
            counts: dict[str, int] = {}
            for pattern, _ in members:
                counts[pattern] = counts.get(pattern, 0) + 1
            held = ", ".join(f"{n} x {pattern}" for pattern, n in counts.items())
            raise ValueError(f"checkpoint tensors {keys[0]} ... {keys[-1]} could not be converted into {group} "
                             f"(transformers' conversion for {type(self._module).__name__}: {exc}); the checkpoint "
                             f"holds {held} for it: one missing or of another shape (from_pretrained refuses it "
                             "too)") from exc

    def names(self) -> list[str]:
        return list(self._plain) + list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name] if name in self._shapes else self._src.shape(self._plain[name])

    def sources(self, name: str) -> list[str]:
        """The checkpoint keys ``name`` is read from."""
        if name not in self._group_of:
            return [self._plain[name]]
        return [k for _, k in self._groups[self._group_of[name]][1]]

    def origin(self, name: str) -> str:
        """A converted name with the checkpoint keys it comes from, for errors."""
        keys = self.sources(name)
        if keys == [name]:
            return name
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        return f"{name} ({'converted' if name in self._group_of else 'renamed'} from {keys[0]}{more})"

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


def _reverse_groups(module: torch.nn.Module, keys: list[str]) -> dict[str, list[str]]:
    """The model's keys in the sets ``save_pretrained``'s reversion converts together (the keys one reverse
    converter collects: a tensor split in two at load is joined again from both), each set under its first key's
    place in ``keys``; a key no converter collects is a set of its own."""
    import transformers.core_model_loading as loading
    from transformers.conversion_mapping import get_model_conversion_mapping

    conversions = getattr(module, "_weight_conversions", None)  # what from_pretrained applied, as it reverts them
    if conversions is None:  # as revert_weight_conversion builds them for a model made otherwise
        prefix_change = getattr(loading, "PrefixChange", ())
        conversions = [c for c in get_model_conversion_mapping(module, add_legacy=False)
                       if not isinstance(c, prefix_change)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in reverse if isinstance(c, loading.WeightConverter)]
    groups: dict[str, list[str]] = {}
    for key in keys:
        renamed, pattern = _first_converter(key, converters)
        groups.setdefault(renamed if pattern is not None else key, []).append(key)
    return groups


def _first_converter(key: str, converters: list[Any]) -> tuple[str, str | None]:
    """``key`` renamed by the first converter whose pattern it matches, and that pattern (None: none matched), as
    transformers' ``apply_converters`` does; written here because releases before it (5.17) lack it."""
    for converter in converters:
        key, pattern = converter.rename_source_key(key)
        if pattern is not None:
            return key, pattern
    return key, None


class HubLayout:
    """An export's names: the model's tensors (``specs``: state-dict key -> (shape, dtype), in the export's order)
    as ``save_pretrained`` writes them (a fused expert tensor as one per expert and projection), learnt by
    reverting meta tensors, set by set (:func:`_reverse_groups`). ``outputs``: set -> [(name, bytes)]."""

    def __init__(self, module: torch.nn.Module, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self._module, self._revert_fn = module, revert_weight_conversion
        meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in specs.items()}
        whole = {n: (tuple(t.shape), t.dtype) for n, t in revert_weight_conversion(module, dict(meta)).items()}
        self.groups = _reverse_groups(module, list(specs))
        self.outputs: dict[str, list[tuple[str, int]]] = {}
        for group, members in self.groups.items():
            if members == [group] and whole.get(group) == specs[group]:  # kept as it is
                out = {group: meta[group]}
            else:
                out = revert_weight_conversion(module, {k: meta[k] for k in members})
            self.outputs[group] = [(n, t.numel() * t.element_size()) for n, t in out.items()]
        made = [n for outs in self.outputs.values() for n, _ in outs]
        self.consistent = sorted(made) == sorted(whole)
        self.changes = any(self.groups[g] != [g] or outs != [(g, meta[g].numel() * meta[g].element_size())]
                           for g, outs in self.outputs.items())  # a converted set is named by a pattern: first

    def sizes(self) -> list[tuple[str, int]]:
        """(name, bytes) of every tensor the export writes, in order."""
        return [out for outs in self.outputs.values() for out in outs]

    def reader(self, read_model: Callable[[list[str]], dict[str, torch.Tensor]]
               ) -> Callable[[list[str]], dict[str, torch.Tensor]]:
        """``read_model`` (model keys -> tensors; a collective with several ranks, {} on the ranks that do not
        write) as a reader of export names. A set whose outputs straddle two shards is read once: the outputs of
        the later shard wait here. Which keys a call reads depends only on the names, the same on every rank."""
        group_of = {n: g for g, outs in self.outputs.items() for n, _ in outs}
        done: set[str] = set()
        ready: dict[str, torch.Tensor] = {}

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            groups = list(dict.fromkeys(group_of[n] for n in names if group_of[n] not in done))
            done.update(groups)
            got = read_model([k for g in groups for k in self.groups[g]])
            if got:  # this rank writes
                for g in groups:
                    ready.update(self._revert_fn(self._module, {k: got.pop(k) for k in self.groups[g]}))
            return {n: ready.pop(n) for n in names if n in ready}

        return read


def hub_layout(module: torch.nn.Module, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> HubLayout | None:
    """The export's :class:`HubLayout` where it differs from the model's names, else None (not a transformers
    model; no conversion; a reversion this code cannot follow set by set, logged: the model's names are written,
    which transformers 5 loads)."""
    if not _mapping(module):
        return None
    try:
        hub = HubLayout(module, specs)
    except Exception as exc:  # noqa: BLE001 - transformers' internals: the model's own names still export
        log.warning("export: transformers' reversion of %s's layout failed (%s: %s); writing the model's own names "
                    "(transformers 5 loads them; other readers may expect the Hub's)", type(module).__name__,
                    type(exc).__name__, exc)
        return None
    if not hub.changes:
        return None
    if not hub.consistent:
        log.warning("export: transformers' reversion of %s's layout differs set by set from the whole; writing the "
                    "model's own names (transformers 5 loads them; other readers may expect the Hub's)",
                    type(module).__name__)
        return None
    return hub
