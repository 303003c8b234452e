"""Writing the consolidated model out as safetensors, the format ``from_pretrained`` and the ecosystem load.

One file ``model.safetensors``, or, when the tensors exceed ``max_shard_size``, shards named as transformers names
them (``model-00001-of-00003.safetensors``) plus ``model.safetensors.index.json`` (``weight_map``: tensor name ->
shard, ``metadata.total_size``). Only one shard's tensors are in memory at a time, so a model larger than RAM
exports in shard-sized pieces. Tied tensors are written once, under the name transformers keeps (not a
``_tied_weights_keys`` target; else the first), and ``from_pretrained`` ties the others again.

Files are written and fsynced under temporary names before any is renamed into place (see
:func:`write_safetensors`): a crash leaves the old export, the new one, or none that loads, never a mix. Sources: a
live :class:`~offload.Engine` (:func:`save_engine`, the fp32 master weights) or a checkpoint folder
(:func:`save_checkpoint_folder`, what ``python -m offload export`` runs).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from .config import parse_bytes

if TYPE_CHECKING:
    from .engine import Engine

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_shard_bytes`` (a larger single tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _write_tmp(folder: Path, name: str, tensors: dict[str, torch.Tensor] | None, text: str = "") -> Path:
    """``name`` written and fsynced under a temporary name in ``folder``; returns that path."""
    from safetensors.torch import save_file

    tmp = folder / f".{name}.tmp-{os.getpid()}"
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    else:
        tmp.write_text(text)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(out: str | os.PathLike[str], sizes: list[tuple[str, int]],
                      read: Callable[[list[str]], dict[str, torch.Tensor]], max_shard_size: int | str = "5GB",
                      progress: Callable[[int], object] | None = None, *, writer: bool = True) -> list[Path]:
    """Writes the tensors named in ``sizes`` ((name, bytes) in order) into the folder ``out``, fetching one shard's
    worth at a time with ``read(names)``; returns the files written (the index last when sharded). ``progress``
    is called with the bytes of each shard once written. ``writer`` False: ``read`` is still called for every
    shard (a collective, with several ranks) but nothing is written.

    Crash safety: every new file is written and fsynced under a temporary name first. A single file then replaces
    ``model.safetensors`` atomically (loaders prefer it to an index) before an old index goes; shards first remove
    the old index and single file (so no mix of old and new files can load), are renamed into place, and the new
    index comes last. Old shards the new export does not list are removed at the end. A crash leaves the old
    export, the new one, or none that loads (an error at load), never a mix."""
    limit = parse_bytes(max_shard_size, "max_shard_size")
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    folder = Path(out)
    shards = plan_shards(sizes, limit)
    nbytes = dict(sizes)
    report = progress or _ignore
    names = [SINGLE] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    if not writer:
        for shard in shards:
            read(shard)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []  # (temporary, final)
    try:
        for name, shard in zip(names, shards):
            staged.append((_write_tmp(folder, name, read(shard)), folder / name))
            report(sum(nbytes[n] for n in shard))
        if len(shards) > 1:
            weight_map = {n: name for name, shard in zip(names, shards) for n in shard}
            index = json.dumps({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map},
                               indent=2)
            staged.append((_write_tmp(folder, INDEX, None, index), folder / INDEX))
        if len(shards) == 1:  # model.safetensors wins over an index when both exist: replace it, then drop the index
            os.replace(*staged[0])
            _fsync_dir(folder)
            (folder / INDEX).unlink(missing_ok=True)
        else:
            (folder / INDEX).unlink(missing_ok=True)  # from here until the new index is in, no export loads
            (folder / SINGLE).unlink(missing_ok=True)
            _fsync_dir(folder)
            for tmp, final in staged:
                os.replace(tmp, final)
                if final.name != INDEX:
                    _fsync_dir(folder)  # the shards are in place before the index that names them
        _fsync_dir(folder)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    keep = set(names)
    for p in folder.iterdir():
        if _SHARD.fullmatch(p.name) and p.name not in keep:
            p.unlink()
    return [folder / n for n in names] + ([folder / INDEX] if len(shards) > 1 else [])


def _ignore(nbytes: int) -> None:
    return None


def _unique(keys_to_entries: dict[str, object], avoid: frozenset[str] = frozenset()) -> list[str]:
    """State-dict keys, one per shared tensor (tied weights): the first name not in ``avoid`` (transformers'
    tied targets, which ``from_pretrained`` ties to their source), else the first."""
    names: dict[object, list[str]] = {}
    for key, entry in keys_to_entries.items():
        names.setdefault(entry, []).append(key)
    keep = {next((k for k in ks if k not in avoid), ks[0]) for ks in names.values()}
    return [k for k in keys_to_entries if k in keep]


def _tied_targets(module: torch.nn.Module) -> frozenset[str]:
    """The names transformers re-ties on load (``_tied_weights_keys``: a {target: source} dict, or a list)."""
    tied = getattr(module, "_tied_weights_keys", None) or ()
    return frozenset(tied if isinstance(tied, (dict, list, tuple, set)) else ())


def save_engine(engine: "Engine", out: str | os.PathLike[str], max_shard_size: int | str = "5GB") -> list[Path]:
    """The engine's model (fp32 master weights of trainable parameters, other tensors as they are) as safetensors,
    one shard in memory at a time: shards hold the trainable parameters in the optimizer's order (each shard's
    masters read, or with several ranks gathered, from as few sub-groups as hold them), then the other tensors.
    Collective with several ranks: every rank calls, rank 0 writes."""
    from ._checkpoint import engine_tensors

    sd = engine.module.state_dict(keep_vars=True)
    keys = _unique({k: id(t) for k, t in sd.items()}, _tied_targets(engine.module))
    order = {id(p): i for i, p in enumerate(engine.layout.params)}
    keys.sort(key=lambda k: order.get(id(sd[k]), len(order)))  # stable: the others keep state-dict order
    sizes = [(k, sd[k].numel() * (4 if id(sd[k]) in order else sd[k].element_size())) for k in keys]
    return write_safetensors(out, sizes, lambda names: engine_tensors(engine, names), max_shard_size,
                             writer=engine.rank == 0)


def save_checkpoint_folder(root: Path, out: Path, tag: str | None = None, max_shard_size: int | str = "5GB",
                           progress: Callable[[int], object] | None = None) -> tuple[str, list[Path]]:
    """A checkpoint written by save_checkpoint (any world size) as a safetensors folder; returns (tag, files)."""
    from ._checkpoint import Checkpoint

    ck = Checkpoint(root, tag)
    try:
        entries = ck.state_dict_entries()
        keys = _unique(entries)
        sizes = [(k, math.prod(ck.shapes[entries[k]]) * ck.dtypes[entries[k]].itemsize) for k in keys]
        files = write_safetensors(out, sizes, lambda names: {n: ck.read(entries[n]) for n in names}, max_shard_size,
                                  progress)
    finally:
        ck.close()
    return ck.tag, files

