"""An engine's tensors as a checkpoint names them: ``param/``, ``exp_avg/`` and ``exp_avg_sq/`` per trainable
parameter (by its first name), ``frozen/`` and ``buffer/`` for the rest, and where each sub-group's flat block
holds their pieces. The save and the load both cut an engine's state by these rules, so they live here once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch

from ._format import KINDS

if TYPE_CHECKING:
    from .._state import EngineState


def trainable_names(engine: "EngineState") -> list[str]:
    """The name of each trainable parameter (its first name, for tied ones)."""
    by_id = {}
    for name, p in engine.module.named_parameters():
        by_id.setdefault(id(p), name)
    return [by_id[id(p)] for p in engine.layout.params]


def frozen_and_buffers(engine: "EngineState", frozen: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint names of the frozen parameters (unless not ``frozen``) and buffers -> the tensors (parameter
    offload: placeholders)."""
    trainable = {id(p) for p in engine.layout.params}
    out = {f"frozen/{n}": p for n, p in engine.module.named_parameters() if frozen and id(p) not in trainable}
    out.update({f"buffer/{n}": b for n, b in engine.module.named_buffers()})
    return out


def other_shapes(engine: "EngineState", frozen: bool = True) -> dict[str, tuple[int, ...]]:
    """Their shapes, read from nothing (a frozen base can be most of the model)."""
    return {n: tuple(t.shape) for n, t in frozen_and_buffers(engine, frozen).items()}


def pieces(sg: Any, block: torch.Tensor, names: list[str]) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(entry name, view of ``block``, element offset in the entry) for every piece of a sub-group's state."""
    n = sg.numel
    parts = dict(zip(KINDS, (block[:n], block[n : 2 * n], block[2 * n :])))
    for seg in sg.segments:
        lo = seg.flat_start - sg.start
        for kind, part in parts.items():
            yield f"{kind}/{names[seg.param]}", part[lo : lo + seg.numel], seg.param_start


def owned_piece(engine: "EngineState", i: int) -> tuple[int, int] | None:
    """(start in the flattened parameter, element count) of parameter ``i`` inside this rank's owned range."""
    layout = engine.layout
    lo, hi = layout.owned[layout.param_group[i]]
    for p0, numel, base in layout.rank_pieces(i):
        a, b = max(lo, p0), min(hi, p0 + numel)
        if a < b:
            return base + a - p0, b - a
    return None


def state_dict_entries(engine: "EngineState", names: list[str], frozen: bool) -> dict[str, str]:
    """Each key of ``module.state_dict()`` -> the checkpoint entry holding its value (tied weights share one);
    frozen parameters only if ``frozen`` (written)."""
    entry: dict[int, str] = {id(p): f"param/{n}" for n, p in zip(names, engine.layout.params)}
    if frozen:
        for n, p in engine.module.named_parameters():
            entry.setdefault(id(p), f"frozen/{n}")
    for n, b in engine.module.named_buffers():
        entry.setdefault(id(b), f"buffer/{n}")
    return {key: entry[id(t)] for key, t in engine.module.state_dict(keep_vars=True).items() if id(t) in entry}


def group_names(engine: "EngineState", names: list[str]) -> list[list[str]]:
    """The names of the parameters in each of the optimizer's param groups."""
    groups: list[list[str]] = [[] for _ in engine.optimizer.param_groups]
    for name, g in zip(names, engine.layout.param_group):
        groups[g].append(name)
    return groups
