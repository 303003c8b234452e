"""A checkpoint's layout on disk: the files of a tag's folder, the rule for tags, and :class:`TensorFile`, the
file of raw tensor bytes each rank writes with its index.

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
partitions is gathered from every rank's piece first). Nothing depends on sub_group_size, placement or world size:
loading re-cuts the pieces for the loading engine's layout (N ranks save, M ranks load).

A tag, saved or loaded (passed, or held by ``latest``), is a plain name (:func:`plain_tag`): a checkpoint never
reaches outside its ``root``, nor into a save's temporary folder. Loading never unpickles: it parses JSON and copies
bytes into tensors of the dtypes the index names (the client state is read with ``torch.load(weights_only=True)``,
which builds tensors and plain containers only). Directories are 0700, files 0600. Format v1 (one ``tensors.bin``
indexed in meta.json) still loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from nvme_swapper import checksum, checksum_kind, memory_at

FORMAT = "offload-checkpoint-v2"
FORMAT_V1 = "offload-checkpoint-v1"
KINDS = ("param", "exp_avg", "exp_avg_sq")
CLIENT_STATE = "client_state.pt"  # in a tag's folder: save_checkpoint's client_state (rank 0's)
_SUM_BYTES = 64 << 20  # a checksum per this much of each write at most (the index grows by 1/2M of the tensors)
DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
TAG_RULE = "a plain name (not empty, no '/' or NUL, not starting with '.', not 'latest')"


def plain_tag(tag: str) -> bool:
    """Whether ``tag`` names a folder inside its checkpoint root: the one rule for the tags saves write and loads
    read (passed, or held by ``latest``), so neither reaches outside the root (``..``, an absolute path) nor into a
    save's temporary folder (``.tmp-*``)."""
    return bool(tag) and "/" not in tag and "\0" not in tag and not tag.startswith(".") and tag != "latest"


def shard_names(rank: int) -> tuple[str, str]:
    """The tensor file and the index file of rank ``rank``'s shard."""
    return ("tensors.bin" if rank == 0 else f"tensors.{rank}.bin"), f"index.{rank}.json"


class TensorFile:
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

    def close(self, sync: bool = False) -> None:
        if self.fd >= 0:
            if sync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
