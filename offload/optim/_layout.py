"""FlatLayout: where every trainable parameter sits in its group's flat buffer, which part of that buffer this rank
owns, and the sub-groups the optimizer walks. The one place that answers "which part of the state do I own".

Each param group's parameters are laid end to end in one flat buffer, each starting on an ``align``-element boundary
(ALIGN, or PAGE_ALIGN when the parameters' NVMe homes are kept in parts); the buffer is padded to a multiple of
``align * world_size`` so every rank owns an equal, aligned, contiguous range.
The owned range is cut into sub-groups of at most ``sub_group_size`` elements. A parameter may straddle sub-groups
and ranks: a :class:`Segment` is its piece inside one sub-group. Padding elements have zero gradients, zero state
and stay zero under Adam, so they need no special case.

``per_param=True`` (ZeRO stage 3 on several ranks) partitions each parameter instead of the buffer: a parameter of
n elements is cut into world_size pieces of ceil(n / world_size) (rounded up to PIECE_ALIGN) elements, and the
group's buffer is rank-major: rank r's range holds piece r of every parameter, end to end. So gathering one
parameter is one all-gather of equal pieces, and reducing its gradient one reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 256  # elements: 1 KiB of fp32, so sub-group boundaries keep host buffers and I/O page-friendly
PAGE_ALIGN = 2048  # elements: 4 KiB of bf16, for parameters homed on NVMe in parts (each part's bytes start on a
# page, so the swap engine moves them by O_DIRECT straight from/to their memory, with no bounce copy)
PIECE_ALIGN = 16  # elements: per-parameter pieces (per_param) start on a 64-byte line of fp32


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class Segment:
    """``numel`` elements of parameter ``param`` from ``param_start``, at ``flat_start`` in the group's buffer."""

    param: int
    param_start: int
    flat_start: int
    numel: int


@dataclass(frozen=True)
class SubGroup:
    index: int
    group: int
    start: int  # flat range [start, end) in the group's buffer, inside the owned range
    end: int
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    def padding(self, lo: int | None = None, hi: int | None = None) -> list[tuple[int, int]]:
        """The ranges of flat [lo, hi) (default: the whole sub-group) that no parameter covers, as [a, b) from
        ``lo``: alignment padding, which must hold zeros wherever gradients are gathered."""
        lo = self.start if lo is None else lo
        hi = self.end if hi is None else hi
        gaps, pos = [], lo
        for seg in self.segments:
            a, b = max(lo, seg.flat_start), min(hi, seg.flat_start + seg.numel)
            if a < b:
                if a > pos:
                    gaps.append((pos - lo, a - lo))
                pos = b
        if pos < hi:
            gaps.append((pos - lo, hi - lo))
        return gaps


class FlatLayout:
    """Built once from the trainable parameters; immutable after."""

    def __init__(self, groups: list[list[torch.nn.Parameter]], sub_group_size: int, *, world_size: int = 1,
                 rank: int = 0, per_param: bool = False, align: int = ALIGN) -> None:
        """``per_param``: partition each parameter across ranks (see the module docstring). ``align``: the element
        boundary parameters and sub-groups start on (ALIGN, or PAGE_ALIGN when parameters move in parts)."""
        self.per_param = per_param
        if sub_group_size < ALIGN:
            raise ValueError(f"zero_optimization.sub_group_size must be at least {ALIGN} elements, got "
                             f"{sub_group_size}")
        self.world_size, self.rank = world_size, rank
        self.params: list[torch.nn.Parameter] = []
        self.param_group: list[int] = []
        self.param_offset: list[int] = []  # flat start of each parameter (per_param: of its piece in a rank's range)
        self.piece: list[int] = []  # per_param: elements of each rank's piece of each parameter (padded)
        self.group_numel: list[int] = []  # padded flat length of each group
        self.owned: list[tuple[int, int]] = []  # this rank's flat range of each group
        self.sub_groups: list[SubGroup] = []
        touching: list[list[int]] = []  # sub-groups each parameter has a segment in
        self.align = align
        sub = _round_up(sub_group_size, align)
        for g, params in enumerate(groups):
            offset = 0
            first = len(self.params)
            for p in params:
                self.params.append(p)
                self.param_group.append(g)
                self.param_offset.append(offset)
                touching.append([])
                piece = _round_up(-(-p.numel() // world_size), PIECE_ALIGN) if per_param else p.numel()
                self.piece.append(piece)
                offset += piece if per_param else _round_up(p.numel(), align)
            if per_param:
                share = _round_up(max(offset, 1), align)
                total = share * world_size
            else:
                total = _round_up(max(offset, 1), align * world_size)
                share = total // world_size
            self.group_numel.append(total)
            own = (rank * share, (rank + 1) * share)
            self.owned.append(own)
            for start, end in ((s, min(s + sub, own[1])) for s in range(own[0], own[1], sub)):
                segs = []
                for i in range(first, len(self.params)):
                    for p0, numel, base in self.rank_pieces(i, only=rank):
                        lo, hi = max(start, p0), min(end, p0 + numel)
                        if lo < hi:
                            segs.append(Segment(i, base + lo - p0, lo, hi - lo))
                            touching[i].append(len(self.sub_groups))
                self.sub_groups.append(SubGroup(len(self.sub_groups), g, start, end, tuple(segs)))
        self.param_sub_groups: list[tuple[int, ...]] = [tuple(t) for t in touching]

    def rank_pieces(self, i: int, only: int | None = None) -> list[tuple[int, int, int]]:
        """Where parameter ``i`` lies in its group's buffer: (flat start, element count, start in the flattened
        parameter) per piece; one piece unless per_param (then one per rank, or rank ``only``'s)."""
        n = self.params[i].numel()
        if not self.per_param:
            return [(self.param_offset[i], n, 0)]
        share = self.group_numel[self.param_group[i]] // self.world_size
        piece = self.piece[i]
        ranks = range(self.world_size) if only is None else (only,)
        return [(r * share + self.param_offset[i], min(piece, n - r * piece), r * piece) for r in ranks
                if n - r * piece > 0]

    def owned_numel(self, group: int) -> int:
        lo, hi = self.owned[group]
        return hi - lo

    @property
    def max_sub_group_numel(self) -> int:
        return max((sg.numel for sg in self.sub_groups), default=0)

    def param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i`` as a view of its group's full flat buffer, in the parameter's shape."""
        assert not self.per_param, "a partitioned parameter is not contiguous in the flat buffer"
        p, off = self.params[i], self.param_offset[i]
        return flat[off : off + p.numel()].view(p.shape)
