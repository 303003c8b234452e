"""Row-sparse gradient exchange: an embedding's gradient reaches its owners as (row indices, rows), not dense.

A batch touches few rows of a large embedding, so its gradient is mostly zero rows. With ``sparse_gradients`` on,
the engine sends the gradient of every ``nn.Embedding`` weight (stages 1-2 on several ranks) this way:

1. each rank finds the rows it touched: the indices of a sparse (COO) gradient, ``nn.Embedding(sparse=True)``, or
   the non-zero rows of a dense one (one pass over it);
2. one all-reduce of the largest count decides, the same on every rank, whether rows are cheaper than dense: rows
   plus their 8-byte indices against this rank's dense share of the reduce. If not, the gradient is reduced dense
   (the caller's fallback);
3. otherwise each rank sends each owner the touched rows that overlap the owner's range of the flat buffer (a row
   cut by a range boundary goes to both): one all-to-all of counts, one of indices, one of rows;
4. each owner adds what it received into a dense zero buffer of its rows (``index_add_``, in rank order), so the
   result is the same sum as the dense reduce, and hands its owned part on like any other gradient.

The optimizer then runs dense Adam over those rows (untouched rows have a zero gradient, and their moments decay
as dense Adam's do), so the trained parameters equal a dense run's; with ``sparse_gradients: "lazy"`` it leaves the
untouched rows as they are instead (``OffloadedAdam``'s lazy rows).
"""

from __future__ import annotations

import torch

from ..optim._layout import FlatLayout
from ._comm import Comm

INDEX_BYTES = 8


def touched_rows(grad: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted row indices, their rows) of an embedding gradient, sparse COO or dense (flat or 2-D)."""
    if grad.is_sparse:
        g = grad.coalesce()
        idx, vals = g.indices()[0], g.values().reshape(-1, width)
        keep = vals.ne(0).any(1)  # coalescing may leave rows that summed to zero: harmless, but not worth sending
        return idx[keep], vals[keep]
    dense = grad.reshape(rows, width)
    idx = dense.ne(0).any(1).nonzero().reshape(-1)
    return idx, dense.index_select(0, idx)


def sparse_pays(comm: Comm, count: int, rows: int, width: int, element: int) -> bool:
    """Whether every rank's touched rows (with their indices) cost fewer bytes than the dense reduce's share of this
    gradient; the largest count over ranks decides, so all ranks agree (a collective)."""
    t = torch.tensor([count], dtype=torch.int64, device=comm.pg.device)
    comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    most = int(t.item())
    return most * (width * element + INDEX_BYTES) < rows * width * element // comm.world_size


def exchange_rows(comm: Comm, layout: FlatLayout, i: int, idx: torch.Tensor, vals: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, int] | None:
    """Sends parameter ``i``'s touched rows to the owners of their ranges and sums what this rank receives.
    Returns (this rank's part of the summed gradient, dense, and its start in the flattened parameter), or None when
    this rank owns none of the parameter."""
    world, off = comm.world_size, layout.param_offset[i]
    n = layout.params[i].numel()
    share = layout.group_numel[layout.param_group[i]] // world

    def rows_of(r: int) -> tuple[int, int, int, int] | None:
        """Rank r's flat range [lo, hi) of the parameter and the rows [first, last) overlapping it; None: none."""
        lo, hi = max(off, r * share), min(off + n, (r + 1) * share)
        return (lo, hi, (lo - off) // width, -(-(hi - off) // width)) if lo < hi else None

    sends_idx, sends_val, counts = [], [], []
    ranges = [rows_of(r) for r in range(world)]
    rows = [row for found in ranges if found is not None for row in found[2:]]  # every rank's [first, last)
    at = iter(torch.searchsorted(idx, torch.tensor(rows, dtype=idx.dtype, device=idx.device)).tolist())  # one sync
    for found in ranges:
        if found is None:
            counts.append(0)
            continue
        a, z = next(at), next(at)
        sends_idx.append(idx[a:z])
        sends_val.append(vals[a:z])
        counts.append(z - a)
    device = vals.device  # NCCL moves CUDA tensors only, gloo CPU ones: everything stays where the rows are
    send_counts = torch.tensor(counts, dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all(recv_counts, send_counts, [1] * world, [1] * world)
    got = [int(c) for c in recv_counts.tolist()]
    recv_idx = torch.empty(sum(got), dtype=torch.int64, device=device)
    send_idx = torch.cat(sends_idx).to(torch.int64) if sends_idx else torch.empty(0, dtype=torch.int64, device=device)
    comm.all_to_all(recv_idx, send_idx, got, counts)
    recv_val = torch.empty(sum(got) * width, dtype=vals.dtype, device=device)
    send_val = torch.cat(sends_val).reshape(-1) if sends_val else torch.empty(0, dtype=vals.dtype, device=device)
    comm.all_to_all(recv_val, send_val, [c * width for c in got], [c * width for c in counts])
    mine = rows_of(comm.rank)
    if mine is None:
        return None
    lo, hi, first, last = mine
    dense = torch.zeros((last - first, width), dtype=vals.dtype, device=vals.device)
    dense.index_add_(0, recv_idx - first, recv_val.reshape(-1, width))
    start = lo - off - first * width
    return dense.reshape(-1)[start : start + hi - lo], lo - off
