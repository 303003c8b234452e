"""Writing the consolidated model out as safetensors, the format ``from_pretrained`` and the ecosystem load.

One file ``model.safetensors``, or, when the tensors exceed ``max_shard_size``, shards named as transformers names
them (``model-00001-of-00003.safetensors``) plus ``model.safetensors.index.json`` (``weight_map``: tensor name ->
shard, ``metadata.total_size``). Only one shard's tensors are in memory at a time, so a model larger than RAM
exports in shard-sized pieces. Tied tensors are written once, under the name transformers keeps (not a
``_tied_weights_keys`` target; else the first), and ``from_pretrained`` ties the others again.

The files follow the umask, as ``save_pretrained``'s do (an export is the artifact others load; checkpoints stay
private). Files are written and fsynced under temporary names before any is renamed into place (see
:func:`write_safetensors`): a crash leaves the old export, the new one, or none that loads, never a mix. Sources: a
live :class:`~offload.Engine` (:func:`save_engine`, the fp32 master weights) or a checkpoint folder
(:func:`save_checkpoint_folder`, what ``python -m offload export`` runs).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from ..config import parse_bytes
from ..dist import CommError
from ._convert import hub_layout
from ._durable import fsync_dir, make_folder, replace_file, write_temp
from ._reader import Checkpoint
from ._tensors import engine_tensors

if TYPE_CHECKING:
    from .._state import EngineState

log = logging.getLogger(__name__)
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


def write_safetensors(out: str | os.PathLike[str], sizes: list[tuple[str, int]],
                      read: Callable[[list[str]], dict[str, torch.Tensor]], max_shard_size: int | str = "5GB",
                      progress: Callable[[int], object] | None = None, *, writer: bool = True,
                      vote: Callable[[str, BaseException | None], int] | None = None) -> list[Path]:
    """Writes the tensors named in ``sizes`` ((name, bytes) in order) into the folder ``out``, fetching one shard's
    worth at a time with ``read(names)``; returns the files written (the index last when sharded). ``progress``
    is called with the bytes of each shard once written. With several ranks every rank calls: ``read`` for every
    shard (a collective), ``writer`` True on the one that writes, and ``vote(site, error)`` (how many ranks
    failed: :meth:`~offload.dist.Comm.vote`) after the folder is made, after each shard's read and write and after
    the commit. A failure there (a full disk on the writer, a rank short of memory for a shard) is then raised on
    every rank at once, its own error where it happened, so no rank waits in the next shard's gathers; a read
    votes before each of its gathers too (a failed read of a sub-group's state or of a piece). A failure after a
    read's collectives had started leaves the ranks out of step: the others raise at their next vote
    (``OutOfStep``), or fail at comm_timeout naming that rank when their next collective is not a vote.

    Crash safety: every new file is written and fsynced under a temporary name first. A single file then replaces
    ``model.safetensors`` atomically (loaders prefer it to an index) before an old index goes; shards first remove
    the old index and single file (so no mix of old and new files can load), are renamed into place, and the new
    index comes last. Old shards the new export does not list are removed at the end. A crash leaves the old
    export, the new one, or none that loads (an error at load), never a mix; a failure removes the temporary files."""
    limit = parse_bytes(max_shard_size, "max_shard_size")
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    folder = Path(out)
    shards = plan_shards(sizes, limit)
    nbytes = dict(sizes)
    report = progress or _ignore
    names = [SINGLE] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    staged: list[tuple[Path, Path]] = []  # (temporary, final)

    def agree(step: Callable[[], object], what: str, everyone: bool = False) -> None:
        """``step`` on the writer (``everyone``: on every rank); then every rank learns whether it failed
        somewhere and raises if so."""
        error: BaseException | None = None
        if writer or everyone:
            try:
                step()
            except CommError:
                raise  # the group itself failed: no vote could complete
            except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
                error = exc
        failed = vote(f"save_safetensors: {what}", error) if vote is not None else int(error is not None)
        if error is not None:
            raise error
        if failed:
            who = f"{failed} other rank(s)" if everyone else "the writing rank"
            raise RuntimeError(f"save_safetensors into {folder}: {who} failed to {what} (see its error); nothing of "
                               "this export was committed")

    try:
        agree(lambda: make_folder(folder, "save_safetensors"), "create the folder")
        for name, shard in zip(names, shards):
            got: list[dict[str, torch.Tensor]] = []
            agree(lambda: got.append(read(shard)), f"read the tensors of {name}", everyone=True)
            agree(lambda: staged.append((write_temp(folder, name, got.pop()), folder / name)), f"write {name}")
            got.clear()
            report(sum(nbytes[n] for n in shard))
        agree(lambda: _commit(folder, names, shards, nbytes, staged), "commit the files")
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    if not writer:
        return []
    try:  # committed: an earlier export's shards that this one does not list, which no index names any more
        for p in folder.iterdir():
            if _SHARD.fullmatch(p.name) and p.name not in names:
                p.unlink()
    except OSError as exc:
        log.warning("save_safetensors: %s is written, but an earlier export's shards could not all be removed "
                    "(%s); nothing loads them", folder, exc)
    return [folder / n for n in names] + ([folder / INDEX] if len(shards) > 1 else [])


def _commit(folder: Path, names: list[str], shards: list[list[str]], nbytes: dict[str, int],
            staged: list[tuple[Path, Path]]) -> None:
    """The staged files renamed into place, in the order that keeps a crash from leaving a mix (see
    :func:`write_safetensors`)."""
    if len(shards) > 1:
        weight_map = {n: name for name, shard in zip(names, shards) for n in shard}
        index = json.dumps({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=2)
        staged.append((write_temp(folder, INDEX, None, index), folder / INDEX))
    if len(shards) == 1:  # model.safetensors wins over an index when both exist: replace it, then drop the index
        os.replace(*staged[0])
        fsync_dir(folder)
        (folder / INDEX).unlink(missing_ok=True)
    else:
        (folder / INDEX).unlink(missing_ok=True)  # from here until the new index is in, no export loads
        (folder / SINGLE).unlink(missing_ok=True)
        fsync_dir(folder)
        for tmp, final in staged:
            os.replace(tmp, final)
            if final.name != INDEX:
                fsync_dir(folder)  # the shards are in place before the index that names them
    fsync_dir(folder)


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


def save_engine(engine: "EngineState", out: str | os.PathLike[str], max_shard_size: int | str = "5GB") -> list[Path]:
    """The engine's model (fp32 master weights of trainable parameters, other tensors as they are) as safetensors,
    one shard in memory at a time: shards hold the trainable parameters in the optimizer's order (each shard's
    masters read, or with several ranks gathered, from as few sub-groups as hold them), then the other tensors. A
    transformers model is written in the Hub's layout, as save_pretrained writes it (:class:`_convert.HubLayout`).
    Collective with several ranks: every rank calls and takes part in the gathers, rank 0 alone holds the shard and
    writes it."""
    sd = engine.module.state_dict(keep_vars=True)
    keys = _unique({k: id(t) for k, t in sd.items()}, _tied_targets(engine.module))
    order = {id(p): i for i, p in enumerate(engine.layout.params)}
    keys.sort(key=lambda k: order.get(id(sd[k]), len(order)))  # stable: the others keep state-dict order
    dtype = {k: torch.float32 if id(sd[k]) in order else sd[k].dtype for k in keys}  # masters are fp32
    writer = engine.rank == 0
    vote = engine.comm.vote if engine.world_size > 1 else None

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        return engine_tensors(engine, names, keep=writer)

    hub = hub_layout(engine.module, {k: (tuple(sd[k].shape), dtype[k]) for k in keys})
    if hub is None:
        sizes = [(k, sd[k].numel() * dtype[k].itemsize) for k in keys]
    else:  # the layout save_pretrained writes (Mixtral's experts one tensor each), as from_pretrained expects it
        sizes, read = hub.sizes(), hub.reader(read)
    return write_safetensors(out, sizes, read, max_shard_size, writer=writer, vote=vote)


def save_16bit(engine: "EngineState", out: str | os.PathLike[str], filename: str, exclude_frozen: bool) -> Path:
    """DeepSpeed's ``save_16bit_model``: the model's state dict with the trainable parameters in the training dtype
    (the fp32 masters rounded, as the parameters on the device are once any delayed update has landed; fp32 when
    training in fp32), frozen parameters and buffers as they are, in the one file ``out/filename``: a torch state
    dict, or safetensors for a ``.safetensors`` name (tied tensors once). Built in RAM on rank 0 as DeepSpeed's is
    (``save_engine`` streams shards instead). Written under a temporary name and renamed into place. Collective
    with several ranks."""
    sd = engine.module.state_dict(keep_vars=True)
    trainable = {id(p) for p in engine.layout.params}
    frozen = {id(p) for p in engine.module.parameters()} - trainable
    keys = [k for k, t in sd.items() if not (exclude_frozen and id(t) in frozen)]
    safetensors = filename.endswith(".safetensors")
    if safetensors:
        keys = _unique({k: id(sd[k]) for k in keys}, _tied_targets(engine.module))
    writer, folder = engine.rank == 0, Path(out)
    tensors = engine_tensors(engine, keys, keep=writer)  # the masters gathered, with several ranks
    error: BaseException | None = None
    if writer:
        try:
            make_folder(folder, "save_16bit_model")
            rounded: dict[int, torch.Tensor] = {}  # tied names share one tensor, as in the model's state_dict
            low: dict[str, torch.Tensor] = {}
            for k in list(tensors):  # each fp32 master dropped as it is rounded: the model in RAM once, not twice
                v = tensors.pop(k)
                low[k] = rounded.setdefault(id(sd[k]), v.to(engine.dtype)) if id(sd[k]) in trainable else v
            replace_file(folder, filename, low, torch_file=not safetensors)
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            error = exc
    failed = engine.comm.vote("save_16bit_model: write the file", error) if engine.world_size > 1 else 0
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"save_16bit_model into {folder}: the writing rank failed (see its error)")
    return folder / filename


def save_checkpoint_folder(root: Path, out: Path, tag: str | None = None, max_shard_size: int | str = "5GB",
                           progress: Callable[[int], object] | None = None,
                           module: torch.nn.Module | None = None) -> tuple[str, list[Path]]:
    """A checkpoint written by save_checkpoint (any world size) as a safetensors folder; returns (tag, files).
    ``module``: the model it holds (on the meta device will do): a transformers model's export is then in the
    Hub's layout, as save_pretrained writes it; a module whose names are not the checkpoint's is ignored, logged."""
    ck = Checkpoint(root, tag)
    try:
        entries = ck.state_dict_entries()
        keys = _unique(entries, _tied_targets(module) if module is not None else frozenset())

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: ck.read(entries[n]) for n in names}

        sizes = [(k, math.prod(ck.shapes[entries[k]]) * ck.dtypes[entries[k]].itemsize) for k in keys]
        hub = None
        if module is not None and not set(keys) <= set(module.state_dict(keep_vars=True)):
            log.warning("export: the model given (%s) does not name the checkpoint's tensors; writing their own "
                        "names", type(module).__name__)
        elif module is not None:
            hub = hub_layout(module, {k: (tuple(ck.shapes[entries[k]]), ck.dtypes[entries[k]]) for k in keys})
        if hub is not None:
            sizes, read = hub.sizes(), hub.reader(read)
        files = write_safetensors(out, sizes, read, max_shard_size, progress)
    finally:
        ck.close()
    return ck.tag, files


def export(root: Path, out: Path, tag: str | None = None) -> tuple[str, int]:
    """The full model of a checkpoint (fp32 master weights, frozen tensors, buffers) as one file that
    ``torch.load(out, weights_only=True)`` reads into a plain state dict; returns (tag, tensors written). Works for
    any world size that wrote it, in one process, one tensor at a time in memory plus the result."""
    ck = Checkpoint(root, tag)
    try:
        entries = ck.state_dict_entries()
        cache: dict[str, torch.Tensor] = {}
        state = {}
        for key, entry in entries.items():
            if entry not in cache:
                cache[entry] = ck.read(entry)
            state[key] = cache[entry]
    finally:
        ck.close()
    make_folder(out.parent, "export")
    replace_file(out.parent, out.name, state, torch_file=True)
    return ck.tag, len(state)
