"""offload.estimate: bytes per tier for each placement, before anything is allocated.

The numbers follow the rules the engine charges its tiers by (docs/architecture.md, "Budgets"), so a plan that
fits here fits in ``initialize``; tests hold the estimate to within 10% of the peaks the engine measures. Given a
model, the layout is computed exactly (alignment padding, sub-groups, persistent parameters); given only a
parameter count, parameters are taken as large (none persistent, no padding).

Per rank with ``gpus`` > 1 (ZeRO: optimizer state and gradients split over the ranks, parameters too when they
are offloaded, i.e. stage 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .memory import fmt_bytes
from .optim._layout import FlatLayout

PLACEMENTS = [  # (name, optimizer state, parameters)
    ("no offload", "none", "none"),
    ("optimizer on cpu", "cpu", "none"),
    ("optimizer on nvme", "nvme", "none"),
    ("optimizer + parameters on cpu", "cpu", "cpu"),
    ("optimizer + parameters on nvme", "nvme", "nvme"),
]


@dataclass(frozen=True)
class Estimate:
    placement: str
    optimizer: str
    params: str
    device: int
    host: int
    nvme: int
    fits: bool | None  # None when no budget was given for any tier
    limiting: str | None  # the tier that does not fit


def _round(n: int, m: int = 4096) -> int:
    return -(-n // m) * m


def estimate(num_params: int | None = None, *, model: torch.nn.Module | None = None, dtype_bytes: int = 2,
             gradient_accumulation_steps: int = 1, sub_group_size: int = 100_000_000, buffer_count: int = 4,
             max_live_parameters: int = 1_000_000_000, persistence_threshold: int = 100_000, gpus: int = 1,
             gpu_mem: int | None = None, host_mem: int | None = None, nvme_free: int | None = None
             ) -> list[Estimate]:
    """Peak bytes per tier (per rank) for each placement of :data:`PLACEMENTS`, and whether each fits the given
    memory (``gpu_mem`` per device, ``host_mem`` and ``nvme_free`` per machine shared by ``gpus`` ranks)."""
    if (num_params is None) == (model is None):
        raise ValueError("estimate: give exactly one of num_params and model")
    if gpus < 1:
        raise ValueError(f"estimate: gpus must be at least 1, got {gpus}")
    if model is not None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        frozen = sum(t.numel() for t in model.parameters() if not t.requires_grad) + \
            sum(b.numel() for b in model.buffers())
        sizes = [p.numel() for p in trainable]
        layout = FlatLayout([trainable], sub_group_size)
        flat = sum(layout.group_numel)
        max_sg = layout.max_sub_group_numel
        n_sub, n_sub_whole = len(layout.sub_groups), None
        layout_nvme = FlatLayout([trainable], sub_group_size, whole_params=True)
        max_sg_whole = layout_nvme.max_sub_group_numel
        n_sub_whole = len(layout_nvme.sub_groups)
    else:
        sizes, frozen = [int(num_params)], 0
        flat = int(num_params)
        max_sg = max_sg_whole = min(int(num_params), sub_group_size)
        n_sub = n_sub_whole = -(-int(num_params) // sub_group_size)
    n = sum(sizes)
    persistent = sum(s for s in sizes if s <= persistence_threshold)
    homed = n - persistent
    largest = max(sizes, default=0)
    grad_bytes = 4 if gradient_accumulation_steps > 1 else dtype_bytes
    out = []
    for name, opt, par in PLACEMENTS:
        shard = gpus if (opt != "none" or par != "none") else 1
        sg = max_sg_whole if par == "nvme" else max_sg
        buffers = min(buffer_count, (n_sub_whole if par == "nvme" else n_sub) or 1)
        staging = buffers * _round(12 * min(sg, -(-flat // shard)))
        grads = grad_bytes * flat // shard
        state = 12 * flat // shard
        if par == "none":
            device = dtype_bytes * (flat + largest) + dtype_bytes * frozen
        else:
            window = min(max_live_parameters, -(-homed // shard) if shard > 1 else homed)
            device = dtype_bytes * (window + persistent)
        host = 0 if opt == "none" else grads
        nvme = 0
        if opt == "none":
            device += grads + state
        elif opt == "cpu":
            host += state
        else:
            host += staging
            nvme += state + staging
        if par == "cpu":
            host += dtype_bytes * flat // shard
        elif par == "nvme":
            host += dtype_bytes * sg + dtype_bytes * frozen
            nvme += dtype_bytes * (-(-homed // shard) + largest)
        budgets = {"device": gpu_mem, "host": host_mem // gpus if host_mem else None,
                   "nvme": nvme_free // gpus if nvme_free else None}
        used = {"device": device, "host": host, "nvme": nvme}
        over = [t for t in ("device", "host", "nvme") if budgets[t] is not None and used[t] > budgets[t]]
        given = any(b is not None for b in budgets.values())
        out.append(Estimate(name, opt, par, device, host, nvme, (not over) if given else None,
                            over[0] if over else None))
    return out


def best(estimates: list[Estimate]) -> Estimate | None:
    """The first placement that fits, in the order of :data:`PLACEMENTS` (least offload first: fastest)."""
    return next((e for e in estimates if e.fits), None)


def config_for(e: Estimate, nvme_path: str = "/local_nvme") -> dict[str, Any]:
    """A config fragment for an estimate's placement."""
    zero: dict[str, Any] = {"stage": 3 if e.params != "none" else 2,
                            "offload_optimizer": {"device": e.optimizer}}
    if e.optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme_path
    if e.params != "none":
        zero["offload_param"] = {"device": e.params, **({"nvme_path": nvme_path} if e.params == "nvme" else {})}
    return {"bf16": {"enabled": True}, "zero_optimization": zero}


def table(estimates: list[Estimate]) -> str:
    lines = [f"{'placement':32s} {'device':>12s} {'host':>12s} {'nvme':>12s}  fits"]
    for e in estimates:
        fits = "-" if e.fits is None else ("yes" if e.fits else f"no ({e.limiting})")
        lines.append(f"{e.placement:32s} {fmt_bytes(e.device):>12s} {fmt_bytes(e.host):>12s} "
                     f"{fmt_bytes(e.nvme):>12s}  {fits}")
    return "\n".join(lines)
