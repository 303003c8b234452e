"""Reading a checkpoint, whatever the number of ranks that wrote it: :class:`Checkpoint` opens a tag's folder
(its meta.json and every shard's index) and reads any range of an entry, re-cut across the pieces the shards
hold, so N ranks save and M ranks load. The tag read is the one passed, or the one ``latest`` names
(:func:`committed`: whether there is one), refused unless it is a plain name (``_format.plain_tag``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path

import torch

from ._format import DTYPES, FORMAT, FORMAT_V1, TAG_RULE, TensorFile, plain_tag

log = logging.getLogger("offload")


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
        if not plain_tag(tag):
            raise ValueError(f"checkpoint tag {tag!r} ({origin}) must be {TAG_RULE}: the name of a checkpoint's "
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
        if meta.get("format") == FORMAT_V1:
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
                             f" and {FORMAT_V1!r}")
        self.pieces: dict[str, list[tuple[int, int, int]]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._files: list[TensorFile | None] = []
        self._shards = shards
        for k, (tensors, index) in enumerate(shards):
            for name, e in index.items():
                if e.get("dtype") not in DTYPES:
                    raise ValueError(f"checkpoint {folder}: tensor {name} has unsupported dtype {e.get('dtype')!r}")
                numel = math.prod(e["shape"])
                self.pieces.setdefault(name, []).append((int(e["start"]), numel, k))
                self.dtypes[name] = DTYPES[e["dtype"]]
            size = os.stat(folder / tensors).st_size if (folder / tensors).exists() else -1
            need = max((e["offset"] + e["nbytes"] for e in index.values()), default=0)
            if size < need:
                raise ValueError(f"checkpoint {folder}/{tensors} is missing or truncated: {max(size, 0)} bytes, its "
                                 f"index needs {need}")
            self._files.append(None)

    def _file(self, k: int) -> TensorFile:
        f = self._files[k]
        if f is None:
            tensors, index = self._shards[k]
            f = self._files[k] = TensorFile(self.folder / tensors, index, write=False)
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
    if not plain_tag(tag):
        raise ValueError(f"{latest} holds {tag[:200]!r}, which is not {TAG_RULE}: latest names a checkpoint's "
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
                if plain_tag(entry.name) and (entry / "meta.json").is_file():
                    found.append(((entry / "meta.json").stat().st_mtime, entry.name))
    if not found:
        return f"{root} holds no complete checkpoint (a folder with a meta.json)"
    return f"the checkpoints in {root}, newest first: {few([name for _, name in sorted(found, reverse=True)])}"


def few(names: list[str]) -> str:
    """The first five of ``names`` and how many more, for a message."""
    return f"{names[:5]}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"
