"""Plan: every placement and size an engine runs with, resolved once at ``initialize`` and frozen.

The engine used to decide placement piecemeal, branching on the configuration in many methods. Now one function,
:func:`resolve`, takes the configuration, the process group (ranks and the device they train on) and the machine
(budgets), and returns a :class:`Plan`: the device, the tier of the optimizer state and of the parameters, how
state is partitioned across ranks, the training and gradient dtypes, the budgets, the sizes (sub-groups, staging
buffers, the parameter window, prefetch and gradient buckets) and whether the optimizer overlaps backward. Each
layer is handed the values it needs; nothing below the engine reads the configuration. ``Plan.why`` records, for
every value not plainly copied from the configuration, why it was chosen, and ``Plan.describe()`` prints it
(``engine.plan()``, the demo's report).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

import torch

from .config import OffloadConfig
from .memory import Tier, default_host_budget, fmt_bytes

_TIER = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}

GRAD_BUCKET = 1 << 24
"""Elements per gradient bucket when ``reduce_bucket_size`` is not set: 32 MiB of bf16, far past the size at which
a PCIe copy reaches full speed, small enough that a few fit beside any model on the device."""


STAGE_ON_CPU = False
"""Tests set this to run the CUDA path's gradient buckets (device staging buffers, pinned landing buffers, the
optimizer thread's accumulation adds) on the CPU, where gradients otherwise go straight to the host buffers."""


class Partition(Enum):
    """How the flat state is divided among ranks (see optim/_layout.py)."""

    NONE = "none"  # one rank owns everything
    FLAT = "flat"  # stages 0-2 on several ranks: an equal range of each flat buffer per rank
    PER_PARAM = "per_param"  # stage 3 on several ranks: every parameter cut into one piece per rank


@dataclass(frozen=True)
class Plan:
    device: torch.device
    world_size: int
    rank: int
    local_world_size: int
    stage: int
    partition: Partition
    dtype: torch.dtype  # the parameters on the device, and the gradients
    grad_dtype: torch.dtype  # host gradient buffers: fp32 when micro-batches accumulate into them
    gradient_accumulation_steps: int
    optimizer_tier: Tier  # fp32 master weights and moments (DEVICE: no offload)
    param_tier: Tier  # low-precision parameters between uses (DEVICE: all on the device)
    budgets: Mapping[Tier, int | None]
    pin_memory: bool  # host buffers page-locked (CUDA only)
    sub_group_size: int
    buffer_count: int  # NVMe staging buffers of the optimizer state
    whole_param_sub_groups: bool  # sub-groups cut between parameters (NVMe parameter homes, one rank)
    max_live: int  # stage 3: elements of parameters on the device at once
    prefetch_bucket: int  # stage 3: elements of fetches in flight
    persistence_threshold: int
    grad_bucket: int  # elements of gradient per device-to-host copy
    grad_staging: bool  # gradients gather in device buckets before one copy each (CUDA)
    overlap: bool  # sub-groups updated during backward as their gradients become final
    delayed: bool  # one-step delayed parameter update (ZeRO-Offload's DPU)
    why: Mapping[str, str] = field(default_factory=dict)

    @property
    def accumulate(self) -> bool:
        return self.gradient_accumulation_steps > 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        """What was chosen and why, one line per decision."""
        budgets = ", ".join(f"{t.value} {fmt_bytes(b)}" for t, b in self.budgets.items())
        lines = [f"device {self.device}, {self.world_size} rank(s) (this is rank {self.rank}), ZeRO stage "
                 f"{self.stage}, partition {self.partition.value}, {str(self.dtype).replace('torch.', '')} "
                 f"parameters and gradients",
                 f"optimizer state on {self.optimizer_tier.value}, parameters on {self.param_tier.value}; "
                 f"budgets: {budgets}",
                 f"sub-groups of {self.sub_group_size:,} elements, {self.buffer_count} staging buffer(s), gradient "
                 f"buckets of {self.grad_bucket:,} elements" + (", staged on the device" if self.grad_staging else ""),
                 ]
        if self.param_tier is not Tier.DEVICE:
            lines.append(f"parameter window {self.max_live:,} elements, {self.prefetch_bucket:,} in flight, "
                         f"persistent below {self.persistence_threshold:,}")
        lines.append(f"optimizer overlaps backward: {'yes' if self.overlap else 'no'}; delayed update: "
                     f"{'yes' if self.delayed else 'no'}")
        lines += [f"  {name}: {reason}" for name, reason in self.why.items()]
        return "\n".join(lines)


def resolve(cfg: OffloadConfig, *, device: torch.device, world_size: int = 1, rank: int = 0,
            local_world_size: int = 1) -> Plan:
    """The plan for ``cfg`` on this rank. Raises ValueError naming the keys of a combination that cannot run."""
    zero = cfg.zero_optimization
    why: dict[str, str] = {}
    optimizer_tier, param_tier = _TIER[zero.offload_optimizer.device], _TIER[zero.offload_param.device]
    delayed = zero.offload_optimizer.delayed_update
    if delayed and param_tier is not Tier.DEVICE:
        raise ValueError("offload_optimizer.delayed_update cannot be combined with offload_param yet; turn one "
                         "of them off")
    if world_size > 1 and delayed:
        raise ValueError(f"offload_optimizer.delayed_update is not supported with several ranks (world size "
                         f"{world_size}) yet; turn it off")
    if world_size > 1 and zero.stage == 3 and param_tier is Tier.DEVICE:
        raise ValueError(f"zero_optimization.stage 3 with several ranks (world size {world_size}) "
                         "partitions parameters into host or NVMe homes: set "
                         "zero_optimization.offload_param.device to \"cpu\" or \"nvme\" (got \"none\"), "
                         "or use stage 2")
    partition = Partition.NONE if world_size == 1 else Partition.PER_PARAM if zero.stage == 3 else Partition.FLAT

    device_budget = cfg.offload.device_memory_budget
    if device_budget is None and device.type == "cuda":
        device_budget = torch.cuda.get_device_properties(device).total_memory
        why["device budget"] = "the CUDA device's total memory (offload.device_memory_budget not set)"
    host_budget = cfg.offload.host_memory_budget
    if host_budget is None:  # ranks on one host share its memory
        host_budget = default_host_budget() // local_world_size
        why["host budget"] = ("90% of MemAvailable at initialize" +
                              (f", shared by {local_world_size} ranks" if local_world_size > 1 else ""))
    budgets = {Tier.DEVICE: device_budget, Tier.HOST: host_budget, Tier.NVME: cfg.offload.nvme_memory_budget}

    accumulate = cfg.gradient_accumulation_steps > 1
    blockers = [reason for cond, reason in (
        (not zero.offload_optimizer.overlap_step, "offload_optimizer.overlap_step is false"),
        (delayed, "the delayed update hides the whole step instead"),
        (cfg.fp16.enabled, "fp16 must check every gradient for overflow first"),
        (cfg.gradient_clipping > 0, "gradient clipping needs the global norm first"),
        (world_size > 1, "several ranks reduce gradients first"),
    ) if cond]
    if blockers:
        why["overlap"] = "off: " + "; ".join(blockers)
    grad_bucket = zero.reduce_bucket_size if zero.reduce_bucket_size is not None else GRAD_BUCKET
    if zero.reduce_bucket_size is None:
        why["gradient bucket"] = f"{GRAD_BUCKET:,} elements (reduce_bucket_size not set): full-speed copies"
    return Plan(
        device=device, world_size=world_size, rank=rank, local_world_size=local_world_size, stage=zero.stage,
        partition=partition, dtype=cfg.dtype, grad_dtype=torch.float32 if accumulate else cfg.dtype,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, optimizer_tier=optimizer_tier,
        param_tier=param_tier, budgets=budgets,
        pin_memory=zero.offload_optimizer.pin_memory and device.type == "cuda",
        sub_group_size=zero.sub_group_size, buffer_count=zero.offload_optimizer.buffer_count,
        whole_param_sub_groups=param_tier is Tier.NVME and world_size == 1,
        max_live=zero.stage3_max_live_parameters, prefetch_bucket=zero.stage3_prefetch_bucket_size,
        persistence_threshold=zero.stage3_param_persistence_threshold, grad_bucket=grad_bucket,
        grad_staging=(device.type == "cuda" or STAGE_ON_CPU) and optimizer_tier is not Tier.DEVICE,
        overlap=not blockers, delayed=delayed, why=why)
