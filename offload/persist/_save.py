"""The collective save and its commit protocol: every rank writes its shard, rank 0 commits once all succeeded,
so a crash at any moment leaves the previous checkpoint loadable (the layout: ``_format``).

The tag directory is first written as ``root/.tmp-<tag>-<pid of rank 0>``, every shard fsynced, then (rank 0, once
all ranks report success) meta.json written, the directory renamed into place and fsynced; only then is
``latest`` rewritten (temp file, fsync, rename). A save that fails on any rank removes the temporary directory;
one killed midway leaves it (a checkpoint's size) until the next save into ``root``, of any tag: rank 0 records
itself as the folder's owner (nvme_swapper's owner record: host, boot, pid namespace, pid, start time) and a save
removes the folders whose owner ran on its host and is gone; a folder of another host's process (a shared
filesystem) is left, since a pid says nothing there. With several ranks, ``root`` must be one filesystem that every
rank sees (a shared mount on multi-node runs).

What a save reads of an engine is its state contract (:class:`offload._state.EngineState`); it writes nothing of
it. The client state is checked to be what ``torch.load(weights_only=True)`` reads back before anything is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvme_swapper import OWNER, alive, left_behind

from ..dist import CommError
from ._durable import claim_folder, fsync_dir, make_folder, write_file
from ._entries import frozen_and_buffers, group_names, owned_piece, pieces, state_dict_entries, trainable_names
from ._format import CLIENT_STATE, FORMAT, KINDS, TAG_RULE, TensorFile, plain_tag, shard_names
from ._tensors import host_value, read_is_collective

if TYPE_CHECKING:
    from .._state import EngineState

log = logging.getLogger("offload")

_TMP = re.compile(r"\.tmp-(.+)-(\d{1,9})")  # a save's temporary folder: tag, pid of its rank 0


def save(engine: "EngineState", root: Path, tag: str, frozen: bool = True, client_state: Any = None) -> Path:
    """Collective with several ranks: each writes its shard; rank 0 commits once all succeeded. ``frozen``:
    whether the frozen parameters are written (else loads keep the model's own). ``client_state``: rank 0's,
    written beside them (see :func:`client_bytes`)."""
    comm, rank = engine.comm, engine.rank
    bad = None if plain_tag(tag) else ValueError(f"save_checkpoint: tag {tag!r} must be {TAG_RULE}: it names "
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
    claim_folder(tmp)
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


def _check_schedule_state(engine: "EngineState") -> None:
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


def _commit(engine: "EngineState", index: dict[str, dict[str, Any]], frozen: bool, tmp: Path, final: Path,
            client: bytes | None = None) -> None:
    """Rank 0, once every shard is written: meta.json, the directory renamed into place, then ``latest``."""
    root, names = final.parent, trainable_names(engine)
    state = engine.training_state()
    shapes = {f"{k}/{n}": list(p.shape) for n, p in zip(names, engine.layout.params) for k in KINDS}
    shapes.update({n: e["shape"] for n, e in index.items() if n.split("/")[0] not in KINDS})
    meta = {
        "format": FORMAT,
        "world_size": engine.world_size,
        "shards": [dict(zip(("tensors", "index"), shard_names(r))) for r in range(engine.world_size)],
        "global_steps": state.global_steps,
        "micro_steps": state.micro_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        "optimizer_steps": state.optimizer_steps,
        "loss_scaler": state.loss_scaler,
        "param_groups": state.param_groups,
        "param_group_names": group_names(engine, names),
        "global_samples": state.global_samples,
        "dtype": state.dtype,
        "pending_update": state.pending_update,
        "lr_scheduler": state.lr_scheduler,
        "shapes": shapes,
        "state_dict": state_dict_entries(engine, names, frozen),
        "frozen_excluded": not frozen,
    }
    if client is not None:
        write_file(tmp / CLIENT_STATE, client)
        meta["client_state"] = CLIENT_STATE  # every loading rank reads it from meta, not from a folder's listing
    write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    marker = _committing(root, final.name)
    write_file(marker, b"")  # until ``latest`` names it: a process killed in between left it uncommitted
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
        write_file(root / ".latest.tmp", final.name.encode())
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


def _write_shard(engine: "EngineState", tmp: Path, frozen: bool) -> dict[str, dict[str, Any]]:
    """This rank's pieces of the trainable state (and, on rank 0, the replicated tensors) and its index."""
    names = trainable_names(engine)
    layout, opt, rank = engine.layout, engine.optimizer, engine.rank
    entries, starts = [], {}
    for i, (n, p) in enumerate(zip(names, layout.params)):
        piece = owned_piece(engine, i)
        if piece is not None:
            for k in KINDS:
                entries.append((f"{k}/{n}", torch.float32, (piece[1],)))
                starts[f"{k}/{n}"] = piece[0]
    others = frozen_and_buffers(engine, frozen)  # read one at a time as rank 0 writes them
    if rank == 0:
        entries += [(n, t.dtype, tuple(t.shape)) for n, t in others.items()]
    # delayed update: the device still holds the previous parameters
    pending = engine.training_state().pending_update and rank == 0
    if pending:
        entries += [(f"device/{n}", engine.dtype, tuple(p.shape)) for n, p in zip(names, layout.params)]
    index = TensorFile.plan(entries)
    for name, entry in index.items():
        entry["start"] = starts.get(name, 0)
    tensors, index_name = shard_names(rank)
    # A local failure (a full disk, a failed read of the optimizer state) is kept for save()'s vote, not raised at
    # once: stage 3's frozen parameters are gathered from every rank's piece below, and a rank that left early would
    # hang the others. A failed read of a piece raises on every rank at that parameter's read (they vote before its
    # gather: ParamShards.read).
    error: OSError | ValueError | None = None
    f: TensorFile | None = None
    try:
        try:
            engine.finish_fetches()  # no prefetch reads or gathers beside the checkpoint's
            f = TensorFile(tmp / tensors, index, write=True)
            for sg in layout.sub_groups:
                block = opt.read_state(sg)
                try:
                    for name, view, offset in pieces(sg, block, names):
                        f.write(name, view, offset - index[name]["start"])
                finally:
                    opt.done_state(sg, dirty=False)
        except (OSError, ValueError) as exc:
            error = exc
        for name, t in others.items():
            if not read_is_collective(engine, t) and (rank != 0 or error is not None):
                continue
            value = host_value(engine, t)  # a failed read raises here, on every rank (see above)
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
    write_file(tmp / index_name, json.dumps(index).encode())
    return index
