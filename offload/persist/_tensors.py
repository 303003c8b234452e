"""A live engine's tensors read out as plain host tensors: the fp32 masters of the trainable parameters (from the
optimizer state, all-gathered over ranks), frozen parameters from their homes, buffers from the device. What
``consolidated_state_dict``, the exports and a checkpoint's frozen tensors read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nvme_swapper import aligned_tensor

if TYPE_CHECKING:
    from .._state import EngineState


def consolidated_state_dict(engine: "EngineState") -> dict[str, torch.Tensor]:
    """Collective with several ranks: every rank's share of the fp32 masters is all-gathered."""
    return engine_tensors(engine, list(engine.module.state_dict(keep_vars=True)))


GATHER_CHUNK = 1 << 24  # elements each rank sends per all-gather when masters are gathered for an export


def engine_tensors(engine: "EngineState", keys: list[str], *, keep: bool = True) -> dict[str, torch.Tensor]:
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
            if id(sd[k]) not in index and read_is_collective(engine, sd[k]):
                host_value(engine, sd[k])
        return {}
    return {k: masters[index[id(sd[k])]] if id(sd[k]) in index else host_value(engine, sd[k]) for k in keys}


def read_is_collective(engine: "EngineState", t: torch.Tensor) -> bool:
    """Whether :func:`host_value` of a frozen parameter or buffer is a collective that every rank joins: stage
    3's frozen parameters are gathered from every rank's piece."""
    return engine.layout.per_param and isinstance(t, torch.nn.Parameter)


def host_value(engine: "EngineState", t: torch.Tensor) -> torch.Tensor:
    """A frozen parameter (read from its home: under parameter offload the module holds a placeholder) or a
    buffer, as a host tensor."""
    return engine.read_parameter(t) if isinstance(t, torch.nn.Parameter) else engine.copies.download(t)


def _gather_buffers(engine: "EngineState") -> tuple[torch.Tensor | None, torch.Tensor]:
    """The all-gathers' input and output chunks, on the device with NCCL (outside its budget: allocated before
    the gathers, inside the ranks' agreement). With gloo the input is the host block itself: no input chunk."""
    nccl = engine.comm.pg.backend == "nccl"
    on = engine.device if nccl else torch.device("cpu")
    chunk = min(GATHER_CHUNK, max(sg.end - sg.start for sg in engine.layout.sub_groups))
    return (torch.empty(chunk, dtype=torch.float32, device=on) if nccl else None,
            torch.empty(engine.world_size * chunk, dtype=torch.float32, device=on))


def _gather_masters(engine: "EngineState", masters: dict[int, torch.Tensor | None],
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
