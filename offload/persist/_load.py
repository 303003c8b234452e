"""Streaming weights in: a state dict read tensor by tensor, never a whole checkpoint in RAM.

Sources (:class:`StateSource`): a ``.safetensors`` file; a folder or ``*.index.json`` of sharded files as
transformers writes them (``model.safetensors.index.json``, or ``pytorch_model.bin.index.json``); a torch file
(``.bin``/``.pt``, loaded with ``mmap=True, weights_only=True``: nothing is unpickled but tensors); or a dict of
tensors. safetensors files are read through the ``safetensors`` library one tensor at a time, each file opened just
for that tensor, so its pages never stay mapped; a torch file's pages are dropped again after each tensor.

Targets (:func:`load_state_dict`):

* a ``torch.nn.Module`` before ``initialize`` (typically built under ``offload.init``): each parameter and buffer
  is copied into place (file-backed parameters drop their pages again), so the fp32 master weights the engine
  makes later start from the checkpoint's values;
* an :class:`offload.Engine`: the fp32 master weights are written into the optimizer state sub-group by sub-group
  (read, patched and written back where the state lives on NVMe), and each parameter's low-precision home
  (device, host or NVMe) gets its new value; Adam's moments and the step count are left as they are. A module an
  open engine holds is loaded as that engine (its tensors are the engine's).

Every tensor a load takes is checked against the model's shape, from the files' headers, before any is written:
a checkpoint of another model changes nothing. A read that fails midway (an I/O error) leaves the parameters
before it loaded whole (masters and homes) and the rest as they were.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from nvme_swapper import evict_pages

from .._hooks import unwrap_compiled
from .._state import holding, is_engine
from ._convert import ConvertedSource, converted, prefix_side

if TYPE_CHECKING:
    from .._state import EngineState

# a folder's checkpoint: transformers' names, in the order from_pretrained looks for them
_CHECKPOINT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json")


class StateSource:
    """Names and, one at a time, the tensors of a checkpoint (see the module docstring). ``close()`` releases it."""

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, torch.Tensor]) -> None:
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Path] = {}  # tensor name -> the file holding it
        self._torch: dict[Path, dict[str, torch.Tensor]] = {}  # torch files, loaded lazily with mmap
        self._headers: dict[Path, dict[str, tuple[int, ...]]] = {}  # safetensors files: each tensor's shape
        if isinstance(source, Mapping):
            self._dict = source
            return
        path = Path(source)
        if path.is_dir():
            chosen = next((path / n for n in _CHECKPOINT_NAMES if (path / n).exists()), None)
            if chosen is None:
                raise FileNotFoundError(f"{path} holds no {' / '.join(_CHECKPOINT_NAMES)}: give the checkpoint "
                                        "file or its index")
            path = chosen
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        if path.name.endswith(".index.json"):
            try:
                weight_map = json.loads(path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path} is not a sharded-checkpoint index (a JSON object with a 'weight_map'): "
                                 f"{exc}") from None
            self._files = {name: path.parent / file for name, file in weight_map.items()}
        elif path.suffix == ".safetensors":
            self._files = {name: path for name in self._safetensors_names(path)}
        else:
            self._files = {name: path for name in self._torch_file(path)}

    @staticmethod
    def _safetensors_names(path: Path) -> list[str]:
        with _safe_open(path) as f:
            return list(f.keys())

    def _torch_file(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._torch:
            try:
                loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any reason a file is not a plain tensor checkpoint
                raise ValueError(f"{path} is not a torch checkpoint of plain tensors (torch.load with "
                                 f"weights_only=True failed: {exc})") from None
            if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
                raise ValueError(f"{path} does not hold a state dict (a mapping of names to tensors)")
            self._torch[path] = dict(loaded)
        return self._torch[path]

    def names(self) -> list[str]:
        return list(self._dict) if self._dict is not None else list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape stored under ``name``, from the file's header or mapping (no data read): a load checks every
        tensor it takes before it writes any."""
        if self._dict is not None:
            return tuple(self._dict[name].shape)
        path = self._shard(name)
        if path.suffix == ".safetensors":
            if path not in self._headers:  # one parse of each file's header (a MoE's holds tens of thousands)
                with _safe_open(path) as f:
                    self._headers[path] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            if name in self._headers[path]:
                return self._headers[path][name]
        elif name in self._torch_file(path):
            return tuple(self._torch_file(path)[name].shape)
        raise ValueError(f"checkpoint shard {path} does not hold {name}, which its index names: the index and the "
                         "shards are from different saves (copy the folder again)")

    def origin(self, name: str) -> str:
        """``name`` as errors show it (a converted view names the tensors it reads)."""
        return name

    def sources(self, name: str) -> list[str]:
        """The checkpoint keys ``name`` is read from (a converted view's may be several)."""
        return [name]

    def get_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Several tensors (one converted group), each safetensors file opened once for those it holds."""
        if self._dict is not None:
            return {n: self.get(n) for n in names}
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._shard(n), []).append(n)
        out: dict[str, torch.Tensor] = {}
        for path, held in by_file.items():
            if path.suffix != ".safetensors":
                out.update((n, self.get(n)) for n in held)
                continue
            with _safe_open(path) as f:
                out.update((n, f.get_tensor(n)) for n in held)
        return {n: out[n] for n in names}

    def _shard(self, name: str) -> Path:
        path = self._files[name]
        if not path.exists():
            raise FileNotFoundError(f"checkpoint shard {path} (holding {name}) does not exist")
        return path

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name`` as a new CPU tensor of its stored dtype."""
        if self._dict is not None:
            return self._dict[name].detach().cpu()
        path = self._shard(name)
        if path.suffix == ".safetensors":
            with _safe_open(path) as f:  # mapped for this tensor only
                return f.get_tensor(name)
        stored = self._torch_file(path)[name]
        out = stored.clone()
        _drop_file_pages(stored)
        return out

    def close(self) -> None:
        self._torch.clear()
        self._headers.clear()

    def __enter__(self) -> "StateSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _safe_open(path: Path) -> Any:
    """safetensors' reader of ``path``; a damaged file (truncated, another format) is named in the error."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except OSError:
        raise  # (names the file already)
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type names no file
        raise ValueError(f"checkpoint file {path} is not a readable safetensors file ({exc}): a partial copy? "
                         "copy it again") from exc


def _drop_file_pages(t: torch.Tensor) -> None:
    """A tensor of a file loaded with ``mmap=True``: its clean pages leave RAM (read again if touched)."""
    if not hasattr(mmap, "MADV_DONTNEED") or t.numel() == 0:
        return
    start = t.data_ptr() - t.data_ptr() % mmap.PAGESIZE
    end = t.data_ptr() + t.numel() * t.element_size()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


@dataclass
class LoadResult:
    """What a load did not match: model keys the checkpoint lacks, checkpoint keys the model lacks."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def keys_by_tensor(module: torch.nn.Module) -> dict[int, list[str]]:
    """Every state_dict key of each tensor (tied weights have several)."""
    out: dict[int, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        out.setdefault(id(t), []).append(name)
    return out


def _check_shapes(found: dict[str, str], src: StateSource | ConvertedSource,
                  tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor a load takes has the model's shape and its shard exists, checked before anything is written:
    a load that fails on those fails with the model (and an engine's state) as it was."""
    for first, hit in found.items():
        shape = src.shape(hit)
        if shape != tuple(tensors[first].shape):
            raise ValueError(f"checkpoint tensor {src.origin(hit)} has shape {shape}, the model's is "
                             f"{tuple(tensors[first].shape)}; nothing was loaded")


def load_state_dict(target: "torch.nn.Module | EngineState",
                    source: str | os.PathLike[str] | Mapping[str, torch.Tensor], *, strict: bool = True) -> LoadResult:
    """Loads ``source`` into ``target`` tensor by tensor (see the module docstring). With ``strict`` (the
    default) every tensor of the model must be in the checkpoint and nothing else (tied weights count as one);
    otherwise what matches is loaded and the rest reported."""
    if is_engine(target):  # its checks: the phase, and a pending delayed update settled first
        return target.load_state_dict(source, strict=strict)
    if not isinstance(target, torch.nn.Module):
        raise ValueError(f"load_state_dict: target must be a torch.nn.Module or an offload Engine, got "
                         f"{type(target).__name__}")
    held = holding(unwrap_compiled(target))
    if held is not None:  # its tensors are the engine's: the masters must get the values too
        return held.load_state_dict(source, strict=strict)
    module = unwrap_compiled(target)
    with _open(source, module) as src:
        return _into_module(module, src, strict)


def load_into_engine(engine: "EngineState", source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
                     strict: bool) -> LoadResult:
    """``Engine.load_state_dict`` once it has checked its phase: the masters, homes and device copies."""
    with _open(source, engine.module) as src:
        return _into_engine(engine, src, strict)


def _open(source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
          module: torch.nn.Module) -> "StateSource | ConvertedSource":
    """The source as ``module`` names its tensors (transformers' conversions: :mod:`offload.persist._convert`)."""
    src = StateSource(source)
    try:
        return converted(src, module)
    except BaseException:
        src.close()
        raise


def _into_module(module: torch.nn.Module, src: StateSource | ConvertedSource, strict: bool) -> LoadResult:
    tensors = module.state_dict(keep_vars=True)
    aliases = keys_by_tensor(module)
    found, result = _match_tied(module, aliases, src, strict)
    _check_shapes(found, src, tensors)
    meta = [name for name in found if tensors[name].is_meta]
    if meta:
        raise ValueError(f"load_state_dict: {meta[:3]} are on the meta device, where nothing can be written: build "
                         "the model inside `with offload.init(config):` (or on the CPU) and load into that")
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in found or aliases[id(t)][0] != name:
                continue
            value = src.get(found[name])
            t.data.copy_(value)
            evict_pages(t)
    return result


def _match_tied(module: torch.nn.Module, aliases: dict[int, list[str]], src: StateSource | ConvertedSource,
                strict: bool) -> tuple[dict[str, str], LoadResult]:
    """Which checkpoint name fills each tensor (by its first name; any of a tied tensor's names matches), as
    ``from_pretrained`` matches them: a checkpoint of the base model into one with a head, or the reverse (one
    decision for the whole checkpoint: its names with the model's ``base_model_prefix`` stripped, added, or as
    they are: :func:`_spelling`), and leaving out of what is reported the names the model says to ignore
    (transformers' ``_keys_to_ignore_on_load_unexpected`` / ``_missing``) and those of values it computes (a
    non-persistent buffer such as ``rotary_emb.inv_freq``, which older checkpoints hold)."""
    have = set(src.names())
    spell = _spelling(module, [n for ns in aliases.values() for n in ns], have)
    first_to_found: dict[str, str] = {}
    missing = []
    for ns in aliases.values():
        hit = next((c for c in map(spell, ns) if c in have), None)
        if hit is None:
            missing.append(ns[0])
        else:
            first_to_found[ns[0]] = hit
    every = {spell(n) for ns in aliases.values() for n in ns} - {None}
    # a tensor this model ties that the checkpoint holds under several of its names with other values (saved
    # untied): the first is loaded, the others are not (transformers unties such a model instead)
    untied: dict[str, str] = {}
    for ns in aliases.values():
        hits = [c for c in map(spell, ns) if c in have]
        if len(hits) > 1:
            first = src.get(hits[0])
            untied.update({h: hits[0] for h in hits[1:] if not torch.equal(src.get(h), first)})
    if strict and untied:
        other, first_name = next(iter(untied.items()))
        raise ValueError(f"the checkpoint holds {other} apart from {first_name}, with other values (saved untied), "
                         "but this model ties them: build it untied (tie_word_embeddings=False) to load both, or "
                         f"pass strict=False to take {first_name} for both ({other} is then reported unexpected); "
                         "nothing was loaded")
    every -= set(untied)
    # buffers no state dict holds, by module and name (``rotary_emb.inv_freq``: older transformers kept one per
    # layer). The names come from the model's tree: a state_dict() call would read every offloaded parameter
    transient = {_tail(n) for n, _ in module.named_buffers()} - {_tail(n) for ns in aliases.values() for n in ns}
    unexpected = sorted({k for n in have - every
                         if not _ignored(n, module, "_keys_to_ignore_on_load_unexpected") and _tail(n) not in transient
                         for k in src.sources(n)} | set(getattr(src, "unused", ())))  # the checkpoint's own keys
    result = LoadResult([n for n in missing if not _ignored(n, module, "_keys_to_ignore_on_load_missing")],
                        unexpected)
    failures = getattr(src, "failures", [])
    if strict and failures:  # what a conversion could not make is missing: its own error says more
        raise ValueError(f"{failures[0]}; nothing was loaded (strict=False loads the rest and reports these as "
                         "missing)")
    if strict and (result.missing or result.unexpected):
        raise ValueError(f"the checkpoint does not match the model: missing {result.missing[:5]}"
                         f"{' ...' if len(result.missing) > 5 else ''}, unexpected {result.unexpected[:5]}"
                         f"{' ...' if len(result.unexpected) > 5 else ''}; pass strict=False to load what matches")
    return first_to_found, result


def _spelling(module: torch.nn.Module, names: list[str], have: set[str]) -> Callable[[str], str | None]:
    """How the checkpoint spells each of the model's names (None: it holds none), decided once for the whole
    checkpoint as ``from_pretrained`` decides it: a model whose names carry its ``base_model_prefix`` and a
    checkpoint whose names do not (the base model's) match without the prefix, the head's tensors then missing;
    the reverse (a checkpoint with a head, into the base model) with the prefix added; else as they are."""
    side = prefix_side(module, names, have)
    if side is None:
        return lambda n: n
    lead, model_has = side
    if model_has:
        return lambda n: n[len(lead):] if n.startswith(lead) else None
    return lambda n: lead + n


def _tail(name: str) -> str:
    """A tensor's name within its module and that module's own name: ``rotary_emb.inv_freq``."""
    return ".".join(name.split(".")[-2:])


def _ignored(name: str, module: torch.nn.Module, attr: str) -> bool:
    return any(re.search(pattern, name) for pattern in getattr(module, attr, None) or ())


def _into_engine(engine: "EngineState", src: StateSource | ConvertedSource, strict: bool) -> LoadResult:
    """Sub-group by sub-group: each segment's fp32 master from its parameter's tensor, and each parameter's
    low-precision home once its last segment is in; frozen tensors and buffers after. One checkpoint tensor in RAM
    at a time (the current parameter's), each read once."""
    module, layout, opt = engine.module, engine.layout, engine.optimizer
    opt.wait()
    aliases = keys_by_tensor(module)
    found, result = _match_tied(module, aliases, src, strict)
    _check_shapes(found, src, module.state_dict(keep_vars=True))
    key_of = {id(p): aliases[id(p)][0] for p in module.parameters()}
    left = [0] * len(layout.params)  # segments of each parameter on this rank not yet loaded
    for sg in layout.sub_groups:
        for seg in sg.segments:
            left[seg.param] += 1
    counted = list(left)
    given = [key_of[id(p)] in found for p in layout.params]
    trained = [key_of[id(p)] for p, g in zip(layout.params, given) if g]
    engine.refuse_writes_over_started_updates(f"engine.load_state_dict() of trainable parameters ({trained[:3]}; the "
                                               "model's load_state_dict and edits in engine.gathered() load this way)",
                                               bool(trained))
    current: tuple[int, torch.Tensor | None] = (-1, None)

    def value(i: int) -> torch.Tensor | None:
        nonlocal current
        if current[0] != i:
            key = key_of[id(layout.params[i])]
            current = (i, src.get(found[key]) if key in found else None)
        return current[1]

    def home(i: int) -> None:
        v = value(i)
        if v is not None:
            engine.write_parameter(layout.params[i], v)

    with torch.no_grad():
        for sg in layout.sub_groups:
            # only the sub-groups the source writes into are read (12 B a parameter from NVMe): an engine.gathered()
            # edit of one weight touches that weight's sub-groups, not the model's
            block = opt.read_state(sg) if any(given[seg.param] for seg in sg.segments) else None
            try:
                for seg in sg.segments:
                    if block is not None and given[seg.param]:
                        lo = seg.flat_start - sg.start
                        v = value(seg.param).reshape(-1)
                        block[lo : lo + seg.numel].copy_(v[seg.param_start : seg.param_start + seg.numel])
                    left[seg.param] -= 1
                    if left[seg.param] == 0:
                        home(seg.param)
            finally:
                # written back even when a tensor raised (a shape that differs, a missing shard): the parameters
                # before it are whole (masters and homes) and a staged NVMe buffer is never left claimed
                if block is not None:
                    opt.done_state(sg, dirty=True)
        for i, segments in enumerate(counted):
            if segments == 0:
                home(i)  # no piece of it on this rank: only its low-precision copy to set
        opt.wait()
        trainable = {id(p) for p in layout.params}
        for p in module.parameters():
            key = key_of[id(p)]
            if id(p) not in trainable and key in found:
                engine.write_parameter(p, src.get(found[key]))
        for name, b in module.named_buffers():
            if name in found:
                b.copy_(engine.copies.upload(src.get(found[name])))
    return result
