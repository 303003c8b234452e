"""Writing the consolidated model out as safetensors, the format ``from_pretrained`` and the ecosystem load.

One file ``model.safetensors``, or, when the tensors exceed ``max_shard_size``, shards named as transformers names
them (``model-00001-of-00003.safetensors``) plus ``model.safetensors.index.json`` (``weight_map``: tensor name ->
shard, ``metadata.total_size``). Tensors are grouped into shards in state-dict order and only one shard's tensors
are in memory at a time, so a model larger than RAM exports in shard-sized pieces. Tied tensors are written once,
under their first name (``from_pretrained`` ties the others again).

Each file is written under a temporary name and renamed into place, the index last; files of an earlier export in
the same folder that the new one does not list are removed after the index is in place, so a crash leaves either
the old export or the new one readable. Sources: a live :class:`~offload.Engine` (:func:`save_engine`, the fp32
master weights) or a checkpoint folder (:func:`save_checkpoint_folder`, what ``python -m offload export`` runs).
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


def _fsync_write(path: Path, tensors: dict[str, torch.Tensor] | None, text: str | None = None) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if tensors is not None:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        else:
            tmp.write_text(text or "")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_safetensors(out: str | os.PathLike[str], sizes: list[tuple[str, int]],
                      read: Callable[[list[str]], dict[str, torch.Tensor]], max_shard_size: int | str = "5GB",
                      progress: Callable[[int], object] | None = None) -> list[Path]:
    """Writes the tensors named in ``sizes`` ((name, bytes) in order) into the folder ``out``, fetching one shard's
    worth at a time with ``read(names)``; returns the files written (the index last when sharded). ``progress``
    is called with the bytes of each shard once written."""
    limit = parse_bytes(max_shard_size, "max_shard_size")
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(sizes, limit)
    nbytes = dict(sizes)
    shard_done = progress or _ignore
    written: list[Path] = []
    if len(shards) == 1:
        _fsync_write(folder / SINGLE, read(shards[0]))
        written.append(folder / SINGLE)
        shard_done(sum(nbytes.values()))
        stale = [p for p in folder.iterdir() if _SHARD.fullmatch(p.name)] + [folder / INDEX]
    else:
        weight_map: dict[str, str] = {}
        for k, names in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            _fsync_write(folder / file, read(names))
            written.append(folder / file)
            shard_done(sum(nbytes[n] for n in names))
            weight_map.update(dict.fromkeys(names, file))
        total = sum(n for _, n in sizes)
        _fsync_write(folder / INDEX, None, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                      indent=2))
        written.append(folder / INDEX)
        keep = {p.name for p in written}
        stale = [p for p in folder.iterdir() if _SHARD.fullmatch(p.name) and p.name not in keep] + [folder / SINGLE]
    for p in stale:
        p.unlink(missing_ok=True)
    return written


def _ignore(nbytes: int) -> None:
    return None


def _unique(keys_to_entries: dict[str, object]) -> list[str]:
    """State-dict keys, keeping the first of keys that share one tensor (tied weights)."""
    seen: set[object] = set()
    out = []
    for key, entry in keys_to_entries.items():
        if entry not in seen:
            seen.add(entry)
            out.append(key)
    return out


def save_engine(engine: "Engine", out: str | os.PathLike[str], max_shard_size: int | str = "5GB") -> list[Path]:
    """The engine's model (fp32 master weights of trainable parameters, other tensors as they are) as safetensors.
    With one rank a shard at a time is read from wherever the optimizer state lives; with several every rank must
    call (the masters are gathered) and rank 0 writes."""
    from ._checkpoint import engine_tensors

    sd = engine.module.state_dict(keep_vars=True)
    keys = _unique({k: id(t) for k, t in sd.items()})
    trainable = {id(p) for p in engine.layout.params}
    sizes = [(k, sd[k].numel() * (4 if id(sd[k]) in trainable else sd[k].element_size())) for k in keys]
    if engine.world_size == 1:
        return write_safetensors(out, sizes, lambda names: engine_tensors(engine, names), max_shard_size)
    full = engine_tensors(engine, keys)  # collective: the masters are gathered on every rank
    if engine.rank != 0:
        return []
    return write_safetensors(out, sizes, lambda names: {n: full[n] for n in names}, max_shard_size)


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

