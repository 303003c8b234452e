"""Checkpoints: raw tensor bytes plus JSON, written so that a crash at any moment leaves the previous one loadable;
one shard per rank, loadable with any number of ranks.

Layout of ``save(engine, root, tag)`` (with N ranks; N = 1 is the same)::

    root/latest                 the tag of the newest complete checkpoint (replaced atomically, last)
    root/<tag>/meta.json        format, world size, counters, loss scaler, hyperparameters, full shapes, the model's
                                state_dict keys, and the list of shards
    root/<tag>/tensors.bin      rank 0's shard (``tensors.<r>.bin`` for rank r): tensors at page-aligned offsets
    root/<tag>/index.<r>.json   rank r's index: entry name -> dtype, shape, offset, ``start``, the element
                                offset of this piece in the flattened full tensor, and ``sums``, the checksum of
                                each write (reads check them)
    root/<tag>/client_state.pt  save_checkpoint's client_state, if given (rank 0's)

Trainable parameters are stored per parameter name (``param/``, ``exp_avg/``, ``exp_avg_sq/``, fp32) as pieces:
each rank writes the part of each parameter that falls in the range of the flat buffer it owns, so a parameter may
be split between shards. ``frozen/`` and ``buffer/`` are written by rank 0 whole (a frozen parameter that stage 3
partitions is gathered from every rank's piece first).
Nothing depends on sub_group_size, placement or world size: loading re-cuts the pieces for the loading engine's
layout (N ranks save, M ranks load).

What this module reads of an engine is its state contract: ``module``, ``layout``, ``optimizer`` (``read_state``,
``stage_state``, ``done_state``, ``param_groups``), ``comm``, ``rank``, ``world_size``, ``dtype``,
``training_state()`` / ``load_training_state()`` (counters, loss scaler, hyperparameters, a pending delayed
update), ``read_parameter`` / ``write_parameter``, ``weights.write_pending`` / ``weights.finish_fetches`` and
``copies.download``; it writes
nothing else. With several ranks, ``root`` must be one filesystem that every rank sees (a
shared mount on multi-node runs): each rank writes its own shard, and a loading rank reads whichever shards hold
its range.

The tag directory is first written as ``root/.tmp-<tag>-<pid of rank 0>``, every shard fsynced, then (rank 0, once
all ranks report success) meta.json written, the directory renamed into place and fsynced; only then is
``latest`` rewritten (temp file, fsync, rename). A save that fails on any rank removes the temporary directory;
one killed midway leaves it (a checkpoint's size) until the next save into ``root``, of any tag: rank 0 records
itself as the folder's owner (nvme_swapper's owner record: host, boot, pid namespace, pid, start time) and a save
removes the folders whose owner ran on its host and is gone; a folder of another host's process (a shared
filesystem) is left, since a pid says nothing there.
A tag, saved or loaded (passed, or held by ``latest``), is a plain name (:func:`_plain_tag`): a checkpoint never
reaches outside its ``root``, nor into a save's temporary folder.
Loading never unpickles: it parses JSON and copies bytes into tensors of the dtypes the index names (the client
state is read with ``torch.load(weights_only=True)``, which builds tensors and plain containers only). Directories
are 0700, files 0600. Format v1 (one ``tensors.bin`` indexed in meta.json) still loads.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvme_swapper import aligned_tensor
from nvme_swapper import OWNER, alive, checksum, checksum_kind, left_behind, memory_at, write_owner

from .dist import CommError
from .optim._schedule import WarmupSchedule

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("offload")

FORMAT = "offload-checkpoint-v2"
_FORMAT_V1 = "offload-checkpoint-v1"
_KINDS = ("param", "exp_avg", "exp_avg_sq")
_SUM_BYTES = 64 << 20  # a checksum per this much of each write at most (the index grows by 1/2M of the tensors)
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


_TAG_RULE = "a plain name (not empty, no '/' or NUL, not starting with '.', not 'latest')"
_TMP = re.compile(r"\.tmp-(.+)-(\d{1,9})")  # a save's temporary folder: tag, pid of its rank 0


def _plain_tag(tag: str) -> bool:
    """Whether ``tag`` names a folder inside its checkpoint root: the one rule for the tags saves write and loads
    read (passed, or held by ``latest``), so neither reaches outside the root (``..``, an absolute path) nor into a
    save's temporary folder (``.tmp-*``)."""
    return bool(tag) and "/" not in tag and "\0" not in tag and not tag.startswith(".") and tag != "latest"


def _names(engine: "Engine") -> list[str]:
    """The name of each trainable parameter (its first name, for tied ones)."""
    by_id = {}
    for name, p in engine.module.named_parameters():
        by_id.setdefault(id(p), name)
    return [by_id[id(p)] for p in engine.layout.params]


def _frozen_and_buffers(engine: "Engine", frozen: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint names of the frozen parameters (unless not ``frozen``) and buffers -> the tensors (parameter
    offload: placeholders)."""
    trainable = {id(p) for p in engine.layout.params}
    out = {f"frozen/{n}": p for n, p in engine.module.named_parameters() if frozen and id(p) not in trainable}
    out.update({f"buffer/{n}": b for n, b in engine.module.named_buffers()})
    return out


def _other_shapes(engine: "Engine", frozen: bool = True) -> dict[str, tuple[int, ...]]:
    """Their shapes, read from nothing (a frozen base can be most of the model)."""
    return {n: tuple(t.shape) for n, t in _frozen_and_buffers(engine, frozen).items()}


def _pieces(sg, block: torch.Tensor, names: list[str]):
    """(entry name, view of ``block``, element offset in the entry) for every piece of a sub-group's state."""
    n = sg.numel
    parts = dict(zip(_KINDS, (block[:n], block[n : 2 * n], block[2 * n :])))
    for seg in sg.segments:
        lo = seg.flat_start - sg.start
        for kind, part in parts.items():
            yield f"{kind}/{names[seg.param]}", part[lo : lo + seg.numel], seg.param_start


def fsync_dir(path: Path) -> None:
    """Makes ``path``'s entries (a rename, a new file) durable across a crash: what a commit relies on."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _TensorFile:
    """Writes or reads named tensors at fixed page-aligned offsets of one file, with pwrite/pread. Each write's
    checksum goes into its entry's index (``sums``: the kind, and [element offset, count, checksum] per write);
    reads check the pieces they cover, so bytes changed on disk after the save fail the read, naming the entry,
    instead of being trained on (a piece a read covers in part, as a load on another number of ranks cuts them, is
    read whole once to be checked: pieces are at most ``_SUM_BYTES``)."""

    def __init__(self, path: Path, index: dict[str, dict[str, Any]], write: bool) -> None:
        self.index = index
        flags = (os.O_RDWR | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        self.path = path
        self._checked: set[tuple[str, int]] = set()  # (entry, element offset) of the pieces a read has checked

    @staticmethod
    def plan(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, dict[str, Any]]:
        index, offset = {}, 0
        for name, dtype, shape in entries:
            numel = torch.empty(shape, dtype=dtype, device="meta").numel()
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            index[name] = {"dtype": str(dtype), "shape": list(shape), "offset": offset, "nbytes": nbytes}
            offset += -(-nbytes // 4096) * 4096
        return index

    def _io(self, name: str, t: torch.Tensor, elem_offset: int, write: bool) -> torch.Tensor:
        """Moves ``t``'s bytes; returns the contiguous tensor they moved from or to."""
        entry = self.index[name]
        if t.device.type != "cpu":
            raise ValueError(f"checkpoint entry {name}: a {t.device} tensor; bring it to the host first")
        if not t.is_contiguous():
            t = t.contiguous()
        size = t.element_size()
        nbytes = t.numel() * size
        start = entry["offset"] + elem_offset * size
        if elem_offset * size + nbytes > entry["nbytes"]:
            raise ValueError(f"checkpoint entry {name}: {nbytes} bytes at element {elem_offset} exceed its "
                             f"{entry['nbytes']} bytes")
        view = memory_at(t.data_ptr(), nbytes) if nbytes else memoryview(b"")
        done = 0
        while done < nbytes:
            try:
                n = (os.pwritev if write else os.preadv)(self.fd, [view[done:]], start + done)
            except OSError as exc:  # (the errno kept, the file and entry named)
                raise OSError(exc.errno, f"{'writing' if write else 'reading'} {name} in {self.path}: "
                                         f"{os.strerror(exc.errno or 5)}", str(self.path)) from None
            if n <= 0:
                raise OSError(5, f"short {'write' if write else 'read'} of {name} in {self.path}")
            done += n
        return t

    def write(self, name: str, t: torch.Tensor, elem_offset: int = 0) -> None:
        t = self._io(name, t, elem_offset, True)
        sums = self.index[name].setdefault("sums", {"kind": checksum_kind(), "pieces": []})
        size = t.element_size()
        step = max(1, _SUM_BYTES // size)  # a read covering a piece in part reads at most this much more to check
        for i in range(0, t.numel(), step):
            n = min(step, t.numel() - i)
            sums["pieces"].append([elem_offset + i, n, checksum(t.data_ptr() + i * size, n * size)])

    def read_into(self, name: str, t: torch.Tensor, elem_offset: int = 0) -> None:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"read_into({name}): needs a contiguous CPU tensor")
        self._io(name, t, elem_offset, False)
        self._check(name, t, elem_offset)

    def _check(self, name: str, t: torch.Tensor, elem_offset: int) -> None:
        """Checks the written pieces that elements [elem_offset, + t.numel()) of ``name``, just read into ``t``,
        overlap. Checkpoints from before checksums, or with another kind of them (a process without the C
        library: crc32), are read unchecked."""
        sums = self.index[name].get("sums")
        if sums is None or sums["kind"] != checksum_kind():
            return
        lo, hi, size = elem_offset, elem_offset + t.numel(), t.element_size()
        for start, count, expected in sums["pieces"]:
            if (name, start) in self._checked or not (start < hi and lo < start + count):
                continue
            if lo <= start and start + count <= hi:
                got = checksum(t.data_ptr() + (start - lo) * size, count * size)
            else:
                whole = self._io(name, torch.empty(count, dtype=t.dtype), start, False)
                got = checksum(whole.data_ptr(), count * size)
            if got != expected:
                raise ValueError(f"checkpoint {self.path}: {name}, elements [{start}, {start + count}), does not "
                                 "match the checksum written with it: the file was changed or damaged after the "
                                 "save. Load another checkpoint (an earlier tag)")
            self._checked.add((name, start))

    def read(self, name: str) -> torch.Tensor:
        entry = self.index[name]
        out = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]], device="cpu")
        self.read_into(name, out)
        return out

    def close(self, sync: bool = False) -> None:
        if self.fd >= 0:
            if sync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1


def _owned_piece(engine: "Engine", i: int) -> tuple[int, int] | None:
    """(start in the flattened parameter, element count) of parameter ``i`` inside this rank's owned range."""
    layout = engine.layout
    lo, hi = layout.owned[layout.param_group[i]]
    for p0, numel, base in layout.rank_pieces(i):
        a, b = max(lo, p0), min(hi, p0 + numel)
        if a < b:
            return base + a - p0, b - a
    return None


def _state_dict_entries(engine: "Engine", names: list[str], frozen: bool) -> dict[str, str]:
    """Each key of ``module.state_dict()`` -> the checkpoint entry holding its value (tied weights share one);
    frozen parameters only if ``frozen`` (written)."""
    entry: dict[int, str] = {id(p): f"param/{n}" for n, p in zip(names, engine.layout.params)}
    if frozen:
        for n, p in engine.module.named_parameters():
            entry.setdefault(id(p), f"frozen/{n}")
    for n, b in engine.module.named_buffers():
        entry.setdefault(id(b), f"buffer/{n}")
    return {key: entry[id(t)] for key, t in engine.module.state_dict(keep_vars=True).items() if id(t) in entry}


def _shard_names(rank: int) -> tuple[str, str]:
    return ("tensors.bin" if rank == 0 else f"tensors.{rank}.bin"), f"index.{rank}.json"


CLIENT_STATE = "client_state.pt"  # in a tag's folder: save_checkpoint's client_state (rank 0's)


def save(engine: "Engine", root: Path, tag: str, frozen: bool = True, client_state: Any = None) -> Path:
    """Collective with several ranks: each writes its shard; rank 0 commits once all succeeded. ``frozen``:
    whether the frozen parameters are written (else loads keep the model's own). ``client_state``: rank 0's,
    written beside them (see :func:`client_bytes`)."""
    comm, rank = engine.comm, engine.rank
    bad = None if _plain_tag(tag) else ValueError(f"save_checkpoint: tag {tag!r} must be {_TAG_RULE}: it names "
                                                  f"the checkpoint's folder inside {root}")
    if comm.world_size > 1:  # DeepSpeed's tag validation: a rank with another tag would write another folder; every
        mine = [zlib.crc32(tag.encode())]  # rank takes part, so one refusing a tag leaves none in a collective
        if comm.rank0s(mine) != mine and bad is None:
            bad = ValueError(f"rank {rank} saves checkpoint tag {tag!r}, rank 0 another: every rank passes the same "
                             "tag (or none: step{N})")
        if comm.vote("checkpoint tag", bad):
            raise bad or ValueError(f"another rank passes another checkpoint tag than rank 0's {tag!r}, or one "
                                    "that is not a plain name: every rank passes the same tag (or none: step{N})")
    elif bad is not None:
        raise bad
    final = root / tag
    pid = int(comm.sum_float(float(os.getpid()) if rank == 0 else 0.0))
    tmp = root / f".tmp-{tag}-{pid}"
    status = 0.0  # rank 0's preparation: 0 ready, 1 the tag exists, 2 failed (``error``)
    error: BaseException | None = None
    client: bytes | None = None
    if rank == 0:
        try:  # (the client state's check too: a rank that raised before the others' collectives would hang them)
            client = client_bytes(client_state) if client_state is not None else None
            _check_schedule_state(engine)
            status = _prepare(root, tag, tmp)
        except BaseException as exc:  # noqa: BLE001 - raised below, once every rank knows
            status, error = 2.0, exc
    status = comm.sum_float(status)  # every rank waits for the folder
    if status == 1.0:
        raise ValueError(f"checkpoint {final} already exists; pass another tag or remove it")
    if error is not None:
        raise error
    if status == 2.0:
        raise RuntimeError(f"checkpoint {final}: rank 0 could not prepare its folder or client_state (see its "
                           "error); nothing was written")
    failed = 0
    try:
        try:
            index = _write_shard(engine, tmp, frozen)
        except CommError:
            raise  # the group failed (or the ranks are out of step: OutOfStep): no vote could complete
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows (GatherRefused: on all)
            error = exc
        failed = comm.vote("checkpoint shards written", error)
    except BaseException:  # a collective failed, or the ranks are out of step: nothing is committed
        failed = comm.world_size
        raise
    finally:  # every rank has closed its shard: give the space back (a full disk stays usable)
        if rank == 0 and failed:
            shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoint {final}: {failed} other rank(s) failed to write their shard (see their "
                           "errors); nothing was committed and the previous checkpoint stays the latest")
    commit_error: BaseException | None = None
    if rank == 0:
        try:
            _commit(engine, index, frozen, tmp, final, client)
        except BaseException as exc:  # noqa: BLE001 - raised below, once every rank knows
            commit_error = exc
            shutil.rmtree(tmp, ignore_errors=True)  # (gone already if it was renamed into place)
    if comm.vote("checkpoint committed", commit_error):  # no rank returns before the checkpoint is complete
        if commit_error is not None:
            raise commit_error
        raise RuntimeError(f"checkpoint {final}: rank 0 failed to commit it (see its error)")
    return final


def make_folder(path: Path, what: str, mode: int = 0o777) -> None:
    """``path`` made (with its parents) for ``what`` (the call that writes there); an OSError names both and the
    fix, where pathlib's names only the first missing parent."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{what}: {path} is a file, not a folder; give a folder")
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"{what}: cannot create {path}: {os.strerror(exc.errno or 5)}; give a folder "
                      "this process can write", str(path)) from None


def _prepare(root: Path, tag: str, tmp: Path) -> float:
    """Rank 0: the checkpoint folder made and the temporary directory ``tmp`` created empty, owned by this process
    (those of killed saves removed first); 1.0 when the tag exists already, else 0.0."""
    make_folder(root, "save_checkpoint", 0o700)
    if (root / tag).exists():
        if not _uncommitted(root, tag):
            return 1.0
        log.warning("offload: %s was renamed into place but never named by %s (its process ended in between); it "
                    "is written again", root / tag, root / "latest")
        shutil.rmtree(root / tag)
    _committing(root, tag).unlink(missing_ok=True)  # (one killed before its rename)
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_killed_saves(root, tag)
    tmp.mkdir(mode=0o700)
    try:
        write_owner(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return 0.0


def _remove_killed_saves(root: Path, tag: str) -> None:
    """Rank 0, before a save: removes the temporary folders that saves of any tag left when their process was
    killed (each as large as a checkpoint): those whose owner record says the process ran on this host, since
    this boot, in this pid namespace, and is gone. One without the record (a version that wrote none; one that
    another save is making right now) only when it is this tag's and its pid has ended, as before records. A
    folder of another host's process is left: its pid says nothing here (a save from another node of a shared
    filesystem may be running)."""
    for entry in root.iterdir():
        found = _TMP.fullmatch(entry.name)
        if found is None or not entry.is_dir() or entry.is_symlink():
            continue
        if (entry / OWNER).exists():
            killed = left_behind(entry)
        else:
            killed = found.group(1) == tag and not alive(int(found.group(2)))
        if killed:
            shutil.rmtree(entry, ignore_errors=True)
            log.warning("offload: removed %s, the temporary folder of a save whose process ended before it "
                        "completed", entry)


def _committing(root: Path, tag: str) -> Path:
    """The marker a commit of ``tag`` holds from before its rename into place until ``latest`` names it."""
    return root / f".committing-{tag}"


def _uncommitted(root: Path, tag: str) -> bool:
    """Whether checkpoint ``tag`` is one whose commit a process did not finish: its marker is still there and
    ``latest`` does not name it (a marker left beside a committed tag is removed)."""
    marker = _committing(root, tag)
    if not marker.exists():
        return False
    if _names_latest(root, tag):
        marker.unlink(missing_ok=True)  # killed after latest named it: committed
        return False
    return True


def _names_latest(root: Path, tag: str) -> bool:
    try:
        return (root / "latest").read_text().strip() == tag
    except OSError:
        return False


def _check_schedule_state(engine: "Engine") -> None:
    """meta.json keeps ``engine.lr_scheduler``'s state_dict as JSON: a scheduler assigned there whose state holds
    more (tensors, functions) is named before anything is written."""
    sched = engine.lr_scheduler
    if sched is None:
        return
    try:
        json.dumps(sched.state_dict())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"save_checkpoint: engine.lr_scheduler ({type(sched).__name__}) has a state_dict() that "
                         f"is not plain JSON ({exc}); checkpoints keep a scheduler's state as numbers, strings and "
                         "lists. Step that scheduler yourself and save its state_dict() in client_state instead "
                         "(docs/getting-started.md, section 7)") from None


def client_bytes(client_state: Any) -> bytes:
    """``client_state`` as the file DeepSpeed's ``save_checkpoint(client_state=...)`` asks for: what
    ``torch.load(weights_only=True)`` reads back (tensors, numbers, strings, and dicts, lists and tuples of them;
    a checkpoint is never unpickled). Checked here, before the save writes anything."""
    if not isinstance(client_state, dict):
        raise ValueError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    try:
        return _safely_readable(client_state)
    except Exception:  # noqa: BLE001 - pickle's errors (PicklingError, AttributeError, ...) say too little
        for key, value in client_state.items():  # the first value at fault, named by its key and type
            try:
                _safely_readable(value)
            except Exception as exc:  # noqa: BLE001
                raise ValueError(f"save_checkpoint: client_state[{key!r}] holds a {type(value).__name__} that a "
                                 "safe load cannot read back (tensors, numbers, strings, None, and dicts, lists and "
                                 f"tuples of them are fine; {type(exc).__name__}: {str(exc)[:200]})") from None
        raise ValueError(f"save_checkpoint: client_state, a {type(client_state).__name__} with keys of types "
                         f"{sorted({type(k).__name__ for k in client_state})}, is something a safe load cannot read "
                         "back: pass a plain dict with str or int keys") from None


def _safely_readable(obj: Any) -> bytes:
    """``obj`` saved by torch, once ``torch.load(weights_only=True)`` has read it back (else its error)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    return buf.getvalue()


def _commit(engine: "Engine", index: dict[str, dict[str, Any]], frozen: bool, tmp: Path, final: Path,
            client: bytes | None = None) -> None:
    """Rank 0, once every shard is written: meta.json, the directory renamed into place, then ``latest``."""
    root, names = final.parent, _names(engine)
    state = engine.training_state()
    shapes = {f"{k}/{n}": list(p.shape) for n, p in zip(names, engine.layout.params) for k in _KINDS}
    shapes.update({n: e["shape"] for n, e in index.items() if n.split("/")[0] not in _KINDS})
    meta = {
        "format": FORMAT,
        "world_size": engine.world_size,
        "shards": [dict(zip(("tensors", "index"), _shard_names(r))) for r in range(engine.world_size)],
        "global_steps": state.global_steps,
        "micro_steps": state.micro_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        "optimizer_steps": state.optimizer_steps,
        "loss_scaler": state.loss_scaler,
        "param_groups": state.param_groups,
        "param_group_names": _group_names(engine, names),
        "global_samples": state.global_samples,
        "dtype": state.dtype,
        "pending_update": state.pending_update,
        "lr_scheduler": state.lr_scheduler,
        "shapes": shapes,
        "state_dict": _state_dict_entries(engine, names, frozen),
        "frozen_excluded": not frozen,
    }
    if client is not None:
        _write_file(tmp / CLIENT_STATE, client)
        meta["client_state"] = CLIENT_STATE  # every loading rank reads it from meta, not from a folder's listing
    _write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    marker = _committing(root, final.name)
    _write_file(marker, b"")  # until ``latest`` names it: a process killed in between left it uncommitted
    try:
        fsync_dir(root)
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            marker.unlink(missing_ok=True)
        raise
    try:
        (final / OWNER).unlink(missing_ok=True)  # no save's temporary folder any more: never removed as one
        fsync_dir(root)
        _write_file(root / ".latest.tmp", final.name.encode())
        os.replace(root / ".latest.tmp", root / "latest")
    except BaseException:
        if not _names_latest(root, final.name):  # an interrupt after the replace finds the save committed
            shutil.rmtree(final, ignore_errors=True)  # ``latest`` still names the previous one: nothing committed
        with contextlib.suppress(OSError):
            (root / ".latest.tmp").unlink(missing_ok=True)
            marker.unlink(missing_ok=True)
        raise
    try:
        marker.unlink()
        fsync_dir(root)
    except OSError as exc:  # committed: ``latest`` names it; only its durability across a crash is in doubt
        log.warning("offload: checkpoint %s is committed but %s could not be synced (%s): a crash before the "
                    "filesystem writes it back may lose it", final, root, exc)


def _write_shard(engine: "Engine", tmp: Path, frozen: bool) -> dict[str, dict[str, Any]]:
    """This rank's pieces of the trainable state (and, on rank 0, the replicated tensors) and its index."""
    names = _names(engine)
    layout, opt, rank = engine.layout, engine.optimizer, engine.rank
    entries, starts = [], {}
    for i, (n, p) in enumerate(zip(names, layout.params)):
        piece = _owned_piece(engine, i)
        if piece is not None:
            for k in _KINDS:
                entries.append((f"{k}/{n}", torch.float32, (piece[1],)))
                starts[f"{k}/{n}"] = piece[0]
    others = _frozen_and_buffers(engine, frozen)  # read one at a time as rank 0 writes them
    if rank == 0:
        entries += [(n, t.dtype, tuple(t.shape)) for n, t in others.items()]
    # delayed update: the device still holds the previous parameters
    pending = engine.training_state().pending_update and rank == 0
    if pending:
        entries += [(f"device/{n}", engine.dtype, tuple(p.shape)) for n, p in zip(names, layout.params)]
    index = _TensorFile.plan(entries)
    for name, entry in index.items():
        entry["start"] = starts.get(name, 0)
    tensors, index_name = _shard_names(rank)
    # A local failure (a full disk, a failed read of the optimizer state) is kept for save()'s vote, not raised at
    # once: stage 3's frozen parameters are gathered from every rank's piece below, and a rank that left early would
    # hang the others. A failed read of a piece raises on every rank at that parameter's read (they vote before its
    # gather: ParamShards.read).
    error: OSError | ValueError | None = None
    f: _TensorFile | None = None
    try:
        try:
            engine.weights.finish_fetches()  # no prefetch reads or gathers beside the checkpoint's
            f = _TensorFile(tmp / tensors, index, write=True)
            for sg in layout.sub_groups:
                block = opt.read_state(sg)
                try:
                    for name, view, offset in _pieces(sg, block, names):
                        f.write(name, view, offset - index[name]["start"])
                finally:
                    opt.done_state(sg, dirty=False)
        except (OSError, ValueError) as exc:
            error = exc
        for name, t in others.items():
            if not _read_is_collective(engine, t) and (rank != 0 or error is not None):
                continue
            value = _host_value(engine, t)  # a failed read raises here, on every rank (see above)
            if rank == 0 and error is None:
                try:
                    f.write(name, value)
                except (OSError, ValueError) as exc:
                    error = exc
        if pending and error is None:
            for name, p in zip(names, layout.params):
                f.write(f"device/{name}", engine.copies.download(p))
    finally:
        if f is not None:
            f.close(sync=error is None)
    if error is not None:
        raise error
    _write_file(tmp / index_name, json.dumps(index).encode())
    return index


def _write_file(path: Path, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:  # (the errno kept, the file named)
        raise OSError(exc.errno, f"writing {path}: {os.strerror(exc.errno or 5)}", str(path)) from None


class Checkpoint:
    """A checkpoint opened for reading, whatever the world size that wrote it: each entry is a list of pieces
    (start in the flattened tensor, element count, shard) and reads are re-cut across them."""

    def __init__(self, root: Path, tag: str | None) -> None:
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(f"{root} is a file, not a checkpoint folder: save_checkpoint writes a folder "
                                     "(a `latest` file and one folder per tag); pass that folder")
        origin = "passed as tag"
        if tag is None and (root / "meta.json").exists() and not (root / "latest").exists():
            root, tag = root.parent, root.name  # the folder of one tag, given by its own path
            origin = "the name of the folder given"
        if tag is None:
            tag, origin = _latest(root), f"named by {root / 'latest'}"
        if not _plain_tag(tag):
            raise ValueError(f"checkpoint tag {tag!r} ({origin}) must be {_TAG_RULE}: the name of a checkpoint's "
                             f"folder inside {root} (a '.tmp-' folder is a save that did not complete); "
                             f"{_checkpoints_in(root)}")
        self.tag, self.folder = tag, root / tag
        folder = self.folder
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint {folder} ({origin}) is missing or incomplete (no meta.json); pass "
                                    f"tag= of one that is complete: {_checkpoints_in(root)}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"checkpoint {folder}/meta.json is damaged: {exc}") from None
        self.meta = meta
        if meta.get("format") == _FORMAT_V1:
            shards = [("tensors.bin", meta["tensors"])]
            for e in meta["tensors"].values():
                e["start"] = 0
            self.shapes = {n: e["shape"] for n, e in meta["tensors"].items()}
        elif meta.get("format") == FORMAT:
            shards = []
            for s in meta["shards"]:
                try:
                    shards.append((s["tensors"], json.loads((folder / s["index"]).read_text())))
                except (OSError, json.JSONDecodeError) as exc:
                    raise ValueError(f"checkpoint {folder}: shard index {s['index']} is missing or damaged: "
                                     f"{exc}") from None
            self.shapes = meta["shapes"]
        else:
            raise ValueError(f"checkpoint {folder} has format {meta.get('format')!r}; this version reads {FORMAT!r}"
                             f" and {_FORMAT_V1!r}")
        self.pieces: dict[str, list[tuple[int, int, int]]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._files: list[_TensorFile | None] = []
        self._shards = shards
        for k, (tensors, index) in enumerate(shards):
            for name, e in index.items():
                if e.get("dtype") not in _DTYPES:
                    raise ValueError(f"checkpoint {folder}: tensor {name} has unsupported dtype {e.get('dtype')!r}")
                numel = math.prod(e["shape"])
                self.pieces.setdefault(name, []).append((int(e["start"]), numel, k))
                self.dtypes[name] = _DTYPES[e["dtype"]]
            size = os.stat(folder / tensors).st_size if (folder / tensors).exists() else -1
            need = max((e["offset"] + e["nbytes"] for e in index.values()), default=0)
            if size < need:
                raise ValueError(f"checkpoint {folder}/{tensors} is missing or truncated: {max(size, 0)} bytes, its "
                                 f"index needs {need}")
            self._files.append(None)

    def _file(self, k: int) -> _TensorFile:
        f = self._files[k]
        if f is None:
            tensors, index = self._shards[k]
            f = self._files[k] = _TensorFile(self.folder / tensors, index, write=False)
        return f

    def read_range(self, name: str, out: torch.Tensor, start: int) -> None:
        """Elements [start, start + out.numel()) of the flattened entry ``name`` into ``out`` (flat, contiguous)."""
        n, covered = out.numel(), 0
        for s, count, k in self.pieces.get(name, ()):
            a, b = max(start, s), min(start + n, s + count)
            if a < b:
                self._file(k).read_into(name, out[a - start : b - start], a - s)
                covered += b - a
        if covered != n:
            raise ValueError(f"checkpoint {self.folder}: elements [{start}, {start + n}) of {name} are not all in "
                             "its shards (a shard is missing or does not match meta.json)")

    def read_range_as(self, name: str, out: torch.Tensor, start: int) -> None:
        """``read_range`` into ``out`` of another dtype too (a parameter frozen when saved, in the training dtype,
        trainable now: its fp32 master), converted."""
        if self.dtypes[name] == out.dtype:
            self.read_range(name, out, start)
            return
        staged = torch.empty(out.numel(), dtype=self.dtypes[name], device="cpu")
        self.read_range(name, staged, start)
        out.copy_(staged)

    def read(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=self.dtypes[name], device="cpu")
        self.read_range(name, out.view(-1), 0)
        return out

    def state_dict_entries(self) -> dict[str, str]:
        """state_dict key -> entry, for an export (format v1 did not record tied names: each entry under its own
        name). One saved with exclude_frozen_parameters is not the whole model, which is said."""
        if self.meta.get("frozen_excluded"):
            log.warning("checkpoint %s was saved with exclude_frozen_parameters: its export holds the trainable "
                        "parameters and the buffers, not the frozen ones; load it over the base model "
                        "(offload.load_state_dict(model, OUT, strict=False))", self.folder)
        if "state_dict" in self.meta:
            return self.meta["state_dict"]
        return {n.split("/", 1)[1]: n for n in self.shapes if n.split("/")[0] in ("param", "frozen", "buffer")}

    def close(self) -> None:
        for f in self._files:
            if f is not None:
                f.close()
        self._files = [None] * len(self._files)


def _latest(root: Path) -> str:
    """The tag ``root/latest`` names, refused unless it is a plain name: a ``latest`` written by hand or by
    another tool (``../elsewhere``, an absolute path) would load a folder outside ``root``."""
    latest = root / "latest"
    try:
        tag = os.fsdecode(latest.read_bytes()).strip()
    except FileNotFoundError:
        if not root.is_dir():
            raise FileNotFoundError(f"no checkpoint in {root}: that folder does not exist") from None
        hint = f"{root} is a Trainer checkpoint folder: pass {root / 'offload_state'}" \
            if (root / "offload_state" / "latest").exists() else f"pass tag=: {_checkpoints_in(root)}"
        raise FileNotFoundError(f"no checkpoint in {root}: {latest} does not exist; {hint}") from None
    if not tag:
        raise ValueError(f"{latest} is empty, so it names no checkpoint: the save that wrote it was cut short? (a "
                         "save replaces it whole, after an fsync; a crash of a filesystem that did not keep that "
                         f"order, or another tool, leaves it empty). Pass tag= of a checkpoint that exists: "
                         f"{_checkpoints_in(root)}")
    if not _plain_tag(tag):
        raise ValueError(f"{latest} holds {tag[:200]!r}, which is not {_TAG_RULE}: latest names a checkpoint's "
                         f"folder inside {root}, never a path elsewhere. Write the tag of one of them into it, or "
                         f"pass tag=: {_checkpoints_in(root)}")
    return tag


def committed(root: Path) -> bool:
    """Whether ``root`` holds a committed checkpoint: ``latest`` names, as a plain name, a folder with its
    meta.json (what a load of ``root`` reads; a save killed before its commit left none)."""
    try:
        return (root / _latest(root) / "meta.json").is_file()
    except (OSError, ValueError):  # no latest, an empty one, one naming no plain tag
        return False


def _checkpoints_in(root: Path) -> str:
    """The complete checkpoints (folders with a meta.json) in ``root``, newest first, for a message asking for
    one."""
    found = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            with contextlib.suppress(OSError):
                if _plain_tag(entry.name) and (entry / "meta.json").is_file():
                    found.append(((entry / "meta.json").stat().st_mtime, entry.name))
    if not found:
        return f"{root} holds no complete checkpoint (a folder with a meta.json)"
    return f"the checkpoints in {root}, newest first: {_few([name for _, name in sorted(found, reverse=True)])}"


def load(engine: "Engine", root: Path, tag: str | None, before_write: Any = None, *, optimizer: bool = True,
         counters: bool = True, scheduler: bool = True) -> tuple[Path, dict[str, Any]]:
    """Loads ``root/tag`` into ``engine``; returns that folder and the client_state saved with it ({} if none).
    ``before_write()`` runs once the checkpoint has been checked against the model, right before the first byte of
    the engine's state is overwritten. DeepSpeed's partial loads: without ``optimizer`` the weights go into the
    masters and Adam's moments, its step count, the param groups' hyperparameters and the loss scale stay the
    engine's; without ``counters`` the engine's step counters stay; without ``scheduler`` its LR schedule does."""
    ck = Checkpoint(root, tag)
    meta = ck.meta
    try:
        names = _names(engine)
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
                for name, view, offset in _pieces(sg, block, names):
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
                    engine.weights.write_pending(i, ck.read(f"device/{name}"), master)
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


def _group_names(engine: "Engine", names: list[str]) -> list[list[str]]:
    """The names of the parameters in each of the optimizer's param groups."""
    groups: list[list[str]] = [[] for _ in engine.optimizer.param_groups]
    for name, g in zip(names, engine.layout.param_group):
        groups[g].append(name)
    return groups


def _match_groups(engine: "Engine", names: list[str], meta: Mapping[str, Any], folder: Path) -> list[dict[str, Any]]:
    """The checkpoint's param-group hyperparameters in this engine's order of groups, matched by the parameters
    each holds: groups listed in another order keep their own decay and lr. Groups that differ are refused before
    anything is written (torch's Optimizer.load_state_dict refuses groups of other sizes)."""
    saved, ours = meta["param_groups"], _group_names(engine, names)
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


def _scaler_state(engine: "Engine", meta: Mapping[str, Any], counters: bool) -> dict[str, Any]:
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


def _sources(engine: "Engine", names: list[str], held: Mapping[str, Any], frozen: bool,
             optimizer: bool, saved_keys: Mapping[str, str]) -> dict[str, str]:
    """The entry this engine would save -> the checkpoint's entry it loads from. A whole load needs the same
    trainable set (Adam's state is per trainable parameter): each entry its own. The weights alone (DeepSpeed's
    load_module_only, load_optimizer_states=False) go by name, as DeepSpeed's ``module.load_state_dict`` does: a
    parameter trainable here and frozen in the checkpoint, or the reverse, takes the checkpoint's tensor. A frozen
    parameter the checkpoint left out (``exclude_frozen_parameters``) keeps its value. A name the checkpoint kept
    as a tie (``saved_keys``: the state_dict key -> its entry) loads from the tensor it was tied to, so a model
    untied since (a head of its own) gets the saved head."""
    if optimizer:
        ours = [f"{k}/{n}" for n in names for k in _KINDS] + list(_frozen_and_buffers(engine, frozen))
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


def _check_matches(engine: "Engine", names: list[str], ck: Checkpoint, source: Mapping[str, str],
                   optimizer: bool) -> None:
    """Refuses, before anything is written, a checkpoint whose entries are not the ones ``source`` reads (every
    one of them, the optimizer's aside in a load of the weights alone) at the model's shapes."""
    expected = {f"{k}/{n}": tuple(p.shape) for n, p in zip(names, engine.layout.params) for k in _KINDS}
    expected.update(_other_shapes(engine, frozen=True))
    found = {n: tuple(s) for n, s in ck.shapes.items() if not n.startswith("device/")
             and (optimizer or not n.startswith(tuple(f"{k}/" for k in _KINDS[1:])))}
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
    raise ValueError(f"checkpoint {ck.folder} does not match the model: missing {_few(missing)}, unexpected "
                     f"{_few(unexpected)}, shapes differ for {len(shapes)} ({differ or 'none'}){hint}. To load the "
                     "tensors that match into this engine: python -m offload export the checkpoint, then "
                     "engine.load_state_dict(that folder, strict=False)")


def _few(names: list[str]) -> str:
    return f"{names[:5]}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"


def consolidated_state_dict(engine: "Engine") -> dict[str, torch.Tensor]:
    """Collective with several ranks: every rank's share of the fp32 masters is all-gathered."""
    return engine_tensors(engine, list(engine.module.state_dict(keep_vars=True)))


GATHER_CHUNK = 1 << 24  # elements each rank sends per all-gather when masters are gathered for an export


def engine_tensors(engine: "Engine", keys: list[str], *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The state-dict entries ``keys`` as plain CPU tensors (fp32 master weights for trainable parameters). One
    rank reads only the sub-groups holding the wanted parameters. Several ranks (collective: every rank passes the
    same keys) gather only those too, sub-group by sub-group in chunks of GATHER_CHUNK elements per rank, so the
    memory is the wanted tensors plus one chunk per rank, whatever the model's size; the ranks agree that each
    could allocate what it keeps before the first gather, so a rank short of memory fails them all at once.
    ``keep`` False: this rank only takes part in the collectives (gathers of masters and of stage 3's frozen
    parameters) and returns {}."""
    layout, opt, several = engine.layout, engine.optimizer, engine.world_size > 1
    sd = engine.module.state_dict(keep_vars=True)
    unknown = [k for k in keys if k not in sd]
    if unknown:
        raise ValueError(f"consolidated_state_dict: {unknown[:5]} are not keys of the model's state_dict")
    index = {id(p): i for i, p in enumerate(layout.params)}
    wanted = sorted({index[id(sd[k])] for k in keys if id(sd[k]) in index})
    masters: dict[int, torch.Tensor | None] = dict.fromkeys(wanted)
    buffers: tuple[torch.Tensor | None, torch.Tensor] | None = None
    error: Exception | None = None
    try:
        if keep:
            masters = {i: aligned_tensor(tuple(layout.params[i].shape), torch.float32, pin_memory=False)
                       for i in wanted}
        if several and wanted:
            buffers = _gather_buffers(engine)
    except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows (before any collective)
        error = exc
    if several:
        short = engine.comm.vote("the buffers of a read of the model's tensors", error)
        if error is None and short:
            raise RuntimeError(f"reading the model's tensors: {short} other rank(s) could not allocate their "
                               "buffers (see their errors)")
    if error is not None:
        raise error
    if not several:
        for sg in layout.sub_groups:
            segments = [seg for seg in sg.segments if seg.param in masters]
            if not segments:
                continue
            block = opt.read_state(sg)
            for seg in segments:
                lo = seg.flat_start - sg.start
                masters[seg.param].view(-1)[seg.param_start : seg.param_start + seg.numel].copy_(
                    block[lo : lo + seg.numel])
            opt.done_state(sg, dirty=False)
    elif buffers is not None:
        _gather_masters(engine, masters, buffers)
        del buffers  # on the device with NCCL: gone before the frozen parameters' reads allocate theirs
    if not keep:
        for k in keys:
            if id(sd[k]) not in index and _read_is_collective(engine, sd[k]):
                _host_value(engine, sd[k])
        return {}
    return {k: masters[index[id(sd[k])]] if id(sd[k]) in index else _host_value(engine, sd[k]) for k in keys}


def _read_is_collective(engine: "Engine", t: torch.Tensor) -> bool:
    """Whether :func:`_host_value` of a frozen parameter or buffer is a collective that every rank joins: stage
    3's frozen parameters are gathered from every rank's piece."""
    return engine.layout.per_param and isinstance(t, torch.nn.Parameter)


def _host_value(engine: "Engine", t: torch.Tensor) -> torch.Tensor:
    """A frozen parameter (read from its home: under parameter offload the module holds a placeholder) or a
    buffer, as a host tensor."""
    return engine.read_parameter(t) if isinstance(t, torch.nn.Parameter) else engine.copies.download(t)


def _gather_buffers(engine: "Engine") -> tuple[torch.Tensor | None, torch.Tensor]:
    """The all-gathers' input and output chunks, on the device with NCCL (outside its budget: allocated before
    the gathers, inside the ranks' agreement). With gloo the input is the host block itself: no input chunk."""
    nccl = engine.comm.pg.backend == "nccl"
    on = engine.device if nccl else torch.device("cpu")
    chunk = min(GATHER_CHUNK, max(sg.end - sg.start for sg in engine.layout.sub_groups))
    return (torch.empty(chunk, dtype=torch.float32, device=on) if nccl else None,
            torch.empty(engine.world_size * chunk, dtype=torch.float32, device=on))


def _gather_masters(engine: "Engine", masters: dict[int, torch.Tensor | None],
                    buffers: tuple[torch.Tensor | None, torch.Tensor]) -> None:
    """Fills ``masters`` (parameter index -> fp32 tensor) from every rank's share. Sub-group k of a group covers
    the same offsets in every rank's range, so all ranks read their k-th sub-group, all-gather it in chunks
    through ``buffers`` (:func:`_gather_buffers`), and keep the pieces of the wanted parameters; a sub-group
    holding none of them on any rank is skipped by all. A None tensor: this rank takes part in the gathers and
    keeps nothing."""
    layout, opt, comm, world = engine.layout, engine.optimizer, engine.comm, engine.world_size
    chunk_in, chunk_out = buffers
    pieces: dict[int, list[tuple[int, int, int, int]]] = {}  # group -> (flat start, count, param, param start)
    for i in masters:
        for p0, numel, base in layout.rank_pieces(i):
            pieces.setdefault(layout.param_group[i], []).append((p0, numel, i, base))
    for g, own in enumerate(layout.owned):
        share = own[1] - own[0]
        mine = [sg for sg in layout.sub_groups if sg.group == g]  # in offset order, the same count on every rank
        for sg in mine:
            rel0, rel1 = sg.start - own[0], sg.end - own[0]
            hits = [(p0, n, i, b) for p0, n, i, b in pieces.get(g, ())
                    if any(p0 < r * share + rel1 and r * share + rel0 < p0 + n for r in range(world))]
            if not hits:
                continue
            kept = any(masters[i] is not None for _, _, i, _ in hits)
            error = None
            try:
                block = opt.read_state(sg)
            except Exception as exc:  # noqa: BLE001 - a failed read (an NVMe error, a checksum): raised below, once
                error = exc  # every rank knows, so none waits in this sub-group's gathers until comm_timeout
            failed = comm.vote(f"read of sub-group {sg.index}'s state", error)
            if error is not None:
                raise error
            if failed:
                opt.done_state(sg, dirty=False)
                raise RuntimeError(f"reading the model's tensors: {failed} other rank(s) failed to read their state "
                                   f"of sub-group {sg.index} (see their errors)")
            try:
                for c0 in range(rel0, rel1, GATHER_CHUNK):
                    c1 = min(c0 + GATHER_CHUNK, rel1)
                    inp, out = block[c0 - rel0 : c1 - rel0], chunk_out[: world * (c1 - c0)]
                    if chunk_in is not None:  # NCCL: the block moves to the device
                        inp = chunk_in[: c1 - c0].copy_(inp)
                    comm.all_gather(out, inp)
                    if not kept:  # this rank only takes part
                        continue
                    got = out.cpu()
                    for r in range(world):
                        lo, hi = r * share + c0, r * share + c1  # this piece of the group's flat buffer
                        for p0, n, i, b in hits:
                            a, z = max(lo, p0), min(hi, p0 + n)
                            if a < z and masters[i] is not None:
                                masters[i].view(-1)[b + a - p0 : b + z - p0].copy_(
                                    got[r * (c1 - c0) + a - lo : r * (c1 - c0) + z - lo])
            finally:
                opt.done_state(sg, dirty=False)


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
    from ._export import _write_tmp

    make_folder(out.parent, "export")
    os.replace(_write_tmp(out.parent, out.name, state, torch_file=True), out)
    return ck.tag, len(state)
