"""Every rank starts from rank 0's model: at initialize, the parameters and buffers that differ across ranks are
copied from rank 0, found by checksum so that nothing moves when none differ (DDP and DeepSpeed broadcast at start
too).

Why it matters here: each rank's optimizer takes its share of the trainable parameters from its own copy of the
model, and frozen parameters and buffers are never communicated. A model built after seeding by rank (nanoGPT
seeds ``1337 + rank`` before building it and relies on DDP's start-up broadcast) would otherwise train from a mix
of the ranks' initialisations, with replicas whose frozen weights disagree for good.

Broadcasting the whole model on every start would cost its size in network traffic in the usual case where
nothing differs (the same checkpoint loaded everywhere, the same seed). So each rank hashes its tensors' bytes
(nvme_swapper's checksum, several GB/s on one core; a tensor off the host passes through a 64 MiB host buffer; one
in ``offload.init``'s arena is read from its file and leaves RAM again), the hashes are all-gathered, and only
tensors whose hash differs from rank 0's are broadcast, in 64 MiB chunks, staged through the group's device where
a tensor lives elsewhere. A model whose structure differs across ranks (names, shapes, dtypes) is an error naming
the first difference, rather than a collective that hangs later.

The ranks must also train with the same settings (:func:`agree_on_settings`): a rank with another lr or clipping
would update its own shard with them and the run would go on, silently wrong; another stage, sub-group size or
accumulation would abort inside gloo on a buffer size, without a word about the config.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nvme_swapper import checksum_kind, evict_pages, tensor_checksum

from ..memory import fmt_bytes
from ._comm import Comm

log = logging.getLogger("offload")

CHUNK = 64 << 20  # bytes per host hash and per broadcast


@dataclass(frozen=True)
class StartSync:
    """What :func:`agree_with_rank0` found: tensors compared, and those copied from rank 0."""

    tensors: int
    copied: int = 0
    copied_bytes: int = 0
    first_copied: str | None = None  # the first copied tensor's name, for the log


def agree_with_rank0(module: torch.nn.Module, comm: Comm) -> StartSync:
    """Makes every parameter and buffer of ``module`` equal to rank 0's (a collective: every rank calls it)."""
    named = _named_state(module)
    if comm.world_size == 1:
        return StartSync(len(named))
    device = comm.pg.device
    signatures = [_signature(name, t) for name, t in named]
    kind = 1 if checksum_kind() == "swp_hash" else 2
    heads = _gather(comm, [len(named), _digest("\n".join(signatures)), kind], device)
    if (heads[:, :2] != heads[0, :2]).any():
        raise _structure_error(comm, signatures, heads, device)
    staging = _Staging(device)
    sums = _gather(comm, [_fingerprint(t, staging) for _, t in named], device)
    differ = (sums != sums[0]).any(0) if (heads[:, 2] == heads[0, 2]).all() else \
        torch.ones(len(named), dtype=bool, device="cpu")
    copied = [i for i in range(len(named)) if bool(differ[i]) and not named[i][1].is_meta]
    for i in copied:
        _broadcast(named[i][1], comm, staging)
    report = StartSync(len(named), len(copied), sum(_nbytes(named[i][1]) for i in copied),
                       named[copied[0]][0] if copied else None)
    if copied and comm.rank == 0:
        log.warning("offload: %d of the model's %d parameters and buffers differed across ranks (first: %r); every "
                    "rank now holds rank 0's values (%s broadcast). Build the model with the same seed on every "
                    "rank, or load the same weights, and nothing is copied.", report.copied, report.tensors,
                    report.first_copied, fmt_bytes(report.copied_bytes))
    return report


def _named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (each once, tied ones under their first name) then buffers, in module order."""
    seen: set[int] = set()
    out = []
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _signature(name: str, t: torch.Tensor) -> str:
    return f"{name} {tuple(t.shape)} {t.dtype}{' meta' if t.is_meta else ''}"


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def agree_on_settings(settings: Mapping[str, Any], comm: Comm) -> None:
    """Refuses, on every rank at once, ``settings`` (name -> value, the same names on every rank) whose values
    differ from rank 0's (a collective): the error names them, the ranks that differ and this rank's values."""
    if comm.world_size == 1:
        return
    names = sorted(settings)
    digests = _gather(comm, [_digest(repr(settings[n])) for n in names], comm.pg.device)
    differ = [i for i in range(len(names)) if bool((digests[:, i] != digests[0, i]).any())]
    if not differ:
        return
    ranks = sorted({r for i in differ for r in range(comm.world_size) if digests[r, i] != digests[0, i]})
    mine = ", ".join(f"{names[i]} = {settings[names[i]]!r}" for i in differ[:6])
    raise ValueError(f"initialize: the ranks do not train with the same settings: rank(s) {ranks} differ from rank 0 "
                     f"in {[names[i] for i in differ]} (this rank, {comm.rank}, has {mine}). Give every rank the "
                     "same config; where a value is derived from this machine's memory or disk (plan.*), set it in "
                     "the config (zero_optimization.sub_group_size, stage3_max_live_parameters, "
                     "stage3_prefetch_bucket_size, stage3_param_persistence_threshold, reduce_bucket_size)")


def _digest(text: str) -> int:
    return _signed(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little"))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gather(comm: Comm, values: list[int], device: torch.device) -> torch.Tensor:
    """Every rank's ``values`` (int64, the same count on each): a (world, count) tensor on the host."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(comm.world_size * len(values), dtype=torch.int64, device=device)
    if len(values):
        comm.all_gather(out, mine)
    return out.view(comm.world_size, len(values)).cpu()


class _Staging:
    """One 64 MiB byte buffer on the host (hashing a tensor that lives elsewhere) and one on the group's device
    (broadcasting a tensor that lives elsewhere), each made on first use and dropped with this object."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device, n: int) -> torch.Tensor:
        buf = self._on.get(device)
        if buf is None:
            buf = self._on[device] = torch.empty(CHUNK, dtype=torch.uint8, device=device)
        return buf[:n]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a copy where ``t`` is not contiguous)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)  # reshape may keep a stride that view refuses


def _fingerprint(t: torch.Tensor, staging: _Staging) -> int:
    """A checksum of the bytes of ``t``: the checksum of its 64 MiB chunks' checksums, the same whichever device
    holds it."""
    if t.is_meta:
        return 0
    flat = _bytes_of(t)
    host = torch.device("cpu")
    sums = []
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK]
        if part.device != host:
            part = staging.on(host, part.numel()).copy_(part)
        sums.append(_signed(tensor_checksum(part)))
    evict_pages(t)
    return _signed(tensor_checksum(torch.tensor(sums, dtype=torch.int64, device="cpu")))


def _broadcast(t: torch.Tensor, comm: Comm, staging: _Staging) -> None:
    """Rank 0's bytes of ``t`` into every rank's ``t``, chunk by chunk."""
    flat = _bytes_of(t)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK]
        if part.device == staging.device:
            comm.broadcast(part, 0)
            continue
        buf = staging.on(staging.device, part.numel())
        if comm.rank == 0:
            buf.copy_(part)
        comm.broadcast(buf, 0)
        if comm.rank != 0:
            part.copy_(buf)
    if not t.is_contiguous():  # ``flat`` was a copy
        with torch.no_grad():
            t.copy_(flat.view(t.dtype).view(t.shape))
    evict_pages(t)


def _structure_error(comm: Comm, signatures: list[str], heads: torch.Tensor, device: torch.device) -> ValueError:
    """The error for a model whose parameters and buffers differ in count, names, shapes or dtypes across ranks.
    With equal counts, the ranks gather each entry's digest to name the first that differs (a collective that
    every rank reaches, since every rank sees the same heads)."""
    counts = heads[:, 0].tolist()
    fix = ("every rank must build the same model (the same code and configuration); initialize then makes their "
           "values agree")
    if len(set(counts)) > 1:
        return ValueError(f"initialize: the model differs across ranks: rank r has counts[r] parameters and buffers, "
                          f"counts = {counts}; {fix}")
    digests = _gather(comm, [_digest(s) for s in signatures], device)
    i = int((digests != digests[0]).any(0).nonzero()[0])
    others = [r for r in range(comm.world_size) if digests[r, i] != digests[comm.rank, i]]
    return ValueError(f"initialize: the model differs across ranks: entry {i} of its parameters and buffers is "
                      f"'{signatures[i]}' (name, shape, dtype) on rank {comm.rank} and differs on rank(s) {others}; "
                      f"{fix}")
