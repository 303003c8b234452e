"""Checkpoints: raw tensor bytes plus JSON, written so that a crash at any moment leaves the previous one loadable.

Layout of ``save(engine, root, tag)``::

    root/latest              the tag of the newest complete checkpoint (replaced atomically, last)
    root/<tag>/meta.json     format, counters, loss scaler, hyperparameters, and an index: name -> dtype, shape, offset
    root/<tag>/tensors.bin   every tensor's bytes at a page-aligned offset

The tag directory is first written as ``root/.tmp-<tag>-<pid>``, its files fsynced, then renamed into place and
the directory fsynced; only then is ``latest`` rewritten (temp file, fsync, rename). Loading never unpickles: it
parses JSON and copies bytes into tensors of the dtypes the index names. Directories are 0700, files 0600.

Tensors are stored per parameter name (``param/``, ``exp_avg/``, ``exp_avg_sq/`` for trainable parameters, fp32;
``frozen/`` and ``buffer/`` for the rest), not per sub-group, so a checkpoint does not depend on sub_group_size or
on how state was placed, and can be re-cut for another layout when loading.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvme_swapper import aligned_tensor
from nvme_swapper._native import memory_at

if TYPE_CHECKING:
    from .engine import Engine

FORMAT = "offload-checkpoint-v1"
_KINDS = ("param", "exp_avg", "exp_avg_sq")
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _names(engine: "Engine") -> list[str]:
    """The name of each trainable parameter (its first name, for tied ones)."""
    by_id = {}
    for name, p in engine.module.named_parameters():
        by_id.setdefault(id(p), name)
    return [by_id[id(p)] for p in engine.layout.params]


def _others(engine: "Engine") -> dict[str, torch.Tensor]:
    trainable = {id(p) for p in engine.layout.params}
    out = {f"frozen/{n}": engine.read_parameter(p) for n, p in engine.module.named_parameters()
           if id(p) not in trainable}
    out.update({f"buffer/{n}": b for n, b in engine.module.named_buffers()})
    return out


def _pieces(sg, block: torch.Tensor, names: list[str]):
    """(entry name, view of ``block``, element offset in the entry) for every piece of a sub-group's state."""
    n = sg.numel
    parts = dict(zip(_KINDS, (block[:n], block[n : 2 * n], block[2 * n :])))
    for seg in sg.segments:
        lo = seg.flat_start - sg.start
        for kind, part in parts.items():
            yield f"{kind}/{names[seg.param]}", part[lo : lo + seg.numel], seg.param_start


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _TensorFile:
    """Writes or reads named tensors at fixed page-aligned offsets of one file, with pwrite/pread."""

    def __init__(self, path: Path, index: dict[str, dict[str, Any]], write: bool) -> None:
        self.index = index
        flags = (os.O_RDWR | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        self.path = path

    @staticmethod
    def plan(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, dict[str, Any]]:
        index, offset = {}, 0
        for name, dtype, shape in entries:
            numel = torch.empty(shape, dtype=dtype, device="meta").numel()
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            index[name] = {"dtype": str(dtype), "shape": list(shape), "offset": offset, "nbytes": nbytes}
            offset += -(-nbytes // 4096) * 4096
        return index

    def _io(self, name: str, t: torch.Tensor, elem_offset: int, write: bool) -> None:
        entry = self.index[name]
        t = t if t.device.type == "cpu" else t.cpu()
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
            n = (os.pwritev if write else os.preadv)(self.fd, [view[done:]], start + done)
            if n <= 0:
                raise OSError(5, f"short {'write' if write else 'read'} of {name} in {self.path}")
            done += n

    def write(self, name: str, t: torch.Tensor, elem_offset: int = 0) -> None:
        self._io(name, t, elem_offset, True)

    def read_into(self, name: str, t: torch.Tensor, elem_offset: int = 0) -> None:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"read_into({name}): needs a contiguous CPU tensor")
        self._io(name, t, elem_offset, False)

    def read(self, name: str) -> torch.Tensor:
        entry = self.index[name]
        out = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        self.read_into(name, out)
        return out

    def close(self, sync: bool = False) -> None:
        if self.fd >= 0:
            if sync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1


def save(engine: "Engine", root: Path, tag: str) -> Path:
    if not tag or "/" in tag or tag.startswith(".") or tag == "latest":
        raise ValueError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.', not 'latest')")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = root / tag
    if final.exists():
        raise ValueError(f"checkpoint {final} already exists; pass another tag or remove it")
    tmp = root / f".tmp-{tag}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    names = _names(engine)
    layout, opt = engine.layout, engine.optimizer
    others = _others(engine)
    entries = [(f"{k}/{n}", torch.float32, tuple(p.shape)) for n, p in zip(names, layout.params) for k in _KINDS]
    entries += [(n, t.dtype, tuple(t.shape)) for n, t in others.items()]
    pending = engine._apply_pending  # delayed update: the device still holds the previous parameters
    if pending:
        entries += [(f"device/{n}", engine.dtype, tuple(p.shape)) for n, p in zip(names, layout.params)]
    index = _TensorFile.plan(entries)
    f = _TensorFile(tmp / "tensors.bin", index, write=True)
    try:
        for sg in layout.sub_groups:
            for name, view, offset in _pieces(sg, opt.read_state(sg), names):
                f.write(name, view, offset)
            opt.done_state(sg, dirty=False)
        for name, t in others.items():
            f.write(name, t)
        if pending:
            for name, p in zip(names, layout.params):
                f.write(f"device/{name}", p.detach())
    finally:
        f.close(sync=True)
    meta = {
        "format": FORMAT,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "optimizer_steps": opt.step_count,
        "loss_scaler": engine.scaler.state_dict(),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "dtype": str(engine.dtype),
        "pending_update": pending,
        "tensors": index,
    }
    _write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_file(root / ".latest.tmp", tag.encode())
    os.replace(root / ".latest.tmp", root / "latest")
    _fsync_dir(root)
    return final


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _open(root: Path, tag: str | None) -> tuple[str, dict[str, Any], _TensorFile]:
    if tag is None:
        try:
            tag = (root / "latest").read_text().strip()
        except FileNotFoundError:
            raise FileNotFoundError(f"no checkpoint in {root}: {root / 'latest'} does not exist") from None
    folder = root / tag
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {folder} is missing or incomplete (no meta.json)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint {folder}/meta.json is damaged: {exc}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {folder} has format {meta.get('format')!r}; this version reads {FORMAT!r}")
    for name, e in meta["tensors"].items():
        if e.get("dtype") not in _DTYPES:
            raise ValueError(f"checkpoint {folder}: tensor {name} has unsupported dtype {e.get('dtype')!r}")
    size = os.stat(folder / "tensors.bin").st_size
    need = max((e["offset"] + e["nbytes"] for e in meta["tensors"].values()), default=0)
    if size < need:
        raise ValueError(f"checkpoint {folder}/tensors.bin is truncated: {size} bytes, the index needs {need}")
    return tag, meta, _TensorFile(folder / "tensors.bin", meta["tensors"], write=False)


def load(engine: "Engine", root: Path, tag: str | None) -> str:
    tag, meta, f = _open(root, tag)
    try:
        names = _names(engine)
        layout, opt = engine.layout, engine.optimizer
        expected = {f"{k}/{n}": tuple(p.shape) for n, p in zip(names, layout.params) for k in _KINDS}
        expected.update({n: tuple(t.shape) for n, t in _others(engine).items()})
        found = {n: tuple(e["shape"]) for n, e in meta["tensors"].items() if not n.startswith("device/")}
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
        if missing or unexpected or wrong:
            raise ValueError(f"checkpoint {root / tag} does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}, shape differs for {wrong[:5]}")
        for sg in layout.sub_groups:
            block = opt.stage_state(sg)
            block.zero_()  # padding between parameters
            for name, view, offset in _pieces(sg, block, names):
                f.read_into(name, view, offset)
            opt.done_state(sg, dirty=True)
        opt.wait()
        pending = bool(meta.get("pending_update")) and engine._delayed
        with torch.no_grad():
            for i, (name, p) in enumerate(zip(names, layout.params)):
                master = f.read(f"param/{name}")
                if pending:  # resume mid-pipeline: the device keeps the previous parameters one more step
                    p.copy_(f.read(f"device/{name}"))
                    layout.param_view(engine._next_flats[layout.param_group[i]], i).copy_(master)
                else:
                    engine.write_parameter(p, master)  # the working copy: master rounded to the training dtype
            trainable = {id(p) for p in layout.params}
            for n, p in engine.module.named_parameters():
                if id(p) not in trainable:
                    engine.write_parameter(p, f.read(f"frozen/{n}"))
            for n, b in engine.module.named_buffers():
                b.copy_(f.read(f"buffer/{n}"))
        engine._apply_pending = pending
    finally:
        f.close()
    engine.global_steps = meta["global_steps"]
    engine.micro_steps = meta["micro_steps"]
    opt.step_count = meta["optimizer_steps"]
    engine.scaler.load_state_dict(meta["loss_scaler"])
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    return tag


def consolidated_state_dict(engine: "Engine") -> dict[str, torch.Tensor]:
    layout, opt = engine.layout, engine.optimizer
    masters = [aligned_tensor(tuple(p.shape), torch.float32, pin_memory=False) for p in layout.params]
    for sg in layout.sub_groups:
        block = opt.read_state(sg)
        for seg in sg.segments:
            lo = seg.flat_start - sg.start
            masters[seg.param].view(-1)[seg.param_start : seg.param_start + seg.numel].copy_(block[lo : lo + seg.numel])
        opt.done_state(sg, dirty=False)
    by_id = {id(p): m for p, m in zip(layout.params, masters)}
    out: dict[str, torch.Tensor] = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        out[name] = by_id[id(t)] if id(t) in by_id else t.detach().cpu().clone()
    return out
