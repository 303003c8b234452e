"""Plan: every placement and size an engine runs with, resolved once at ``initialize`` and frozen.

The engine used to decide placement piecemeal, branching on the configuration in many methods. Now one function,
:func:`resolve`, takes the configuration, the process group (ranks and the device they train on), the model's
sizes and the machine (budgets), and returns a :class:`Plan`: the device, the tier of the optimizer state and of
the parameters, how state is partitioned across ranks, the training and gradient dtypes, the budgets, the sizes
(sub-groups, staging buffers, the parameter window, prefetch and gradient buckets) and whether the optimizer
overlaps backward. Each layer is handed the values it needs; nothing below the engine reads the configuration.

Sizes the configuration leaves unset are derived here from the budgets and the model (:func:`choose_sizes`), so
that offloading pays for itself: the NVMe staging buffers hold 1/16 of the optimizer state (each request still at
the disk's knee where the model allows), the device window fits half the device budget, the gradient buckets are
large enough for full-speed copies. Values the user sets are kept. :func:`expected_bytes` is the engine's charging
rules as arithmetic: ``offload estimate`` (planner.py) calls the same two functions, so the estimate and the engine
agree by construction. ``Plan.why`` says why each derived value was chosen; ``Plan.describe()`` prints it
(``engine.plan()``, the demo's report).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

import torch

from nvme_swapper import swap_file_bytes

from .config import OffloadConfig
from .dist._buckets import pool_buffers
from .dist._zero import piece_nvme_bytes
from .memory import Tier, arena_span, default_host_budget, fmt_bytes
from .memory._heap import available as heap_trim_available
from .optim._layout import ALIGN, PAGE_ALIGN, FlatLayout

_TIER = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}

GRAD_BUCKET = 1 << 24
"""Elements per gradient bucket when ``reduce_bucket_size`` is not set: 32 MiB of bf16, far past the size at which
a PCIe copy reaches full speed, small enough that a few fit beside any model on the device."""

IO_KNEE = 16 << 20
"""Bytes per NVMe request from which the swap engine runs within 10% of its best on this kind of disk, one request
waited alone with the default AioConfig (``python bench/nvme_swapper.py --requests ...``: 4 MiB reached 0.85 of the
best, 16 MiB 0.93; docs/benchmarks.md)."""

STATE_SHARE = 16
"""The NVMe staging buffers hold at most 1/STATE_SHARE of the optimizer state they stream (and the spare extents on
disk, sized by the writes in flight, no more)."""

GRAD_SLOTS = 4
"""Sub-group slots the host gradients start with when updates run during backward (optim/_grad_buffers.py): one
filling, one spare, two queued for the optimizer thread. Backward waits for a slot only while updates are queued,
so the optimizer thread stays busy, and the pool grows when sub-groups fill out of order."""

UPDATE_BUFFERS = 3
"""Host staging buffers of a sub-group's new parameters on their way to NVMe homes: the writes of two sub-groups wait
their turn on the disk (behind the parameter prefetches) while the optimizer thread updates the next. With one,
waiting for each write took 1.07 s of the optimizer thread's 1.64 s a step on the ~100M GPT of the memory bench."""

SUB_GROUP_MAX = 100_000_000  # 1.2 GB of fp32 state per sub-group: larger requests buy nothing
PERSISTENCE = 100_000  # elements: smaller parameters stay on the device (DeepSpeed's default), budget permitting
SWAP_SLACK = 256 << 20
"""Spare swap space always allowed beside the state, whatever its size (copy-on-write writes land beside the bytes
they replace: the spare room bounds the writes in flight)."""

STAGE_ON_CPU = False
"""Tests set this to run the CUDA path on the CPU, streams aside: the gradient buckets (device staging buffers,
pinned landing buffers, the accumulation thread), the pinned staging updated parameters are uploaded from, the
staging parameters read from NVMe land in before their copy to the device, and torch's fused Adam with host copies
for checkpoints when the state stays on the device. Without it, the CPU copies and reads straight into their
destinations and updates all state with its own kernel."""


class Partition(Enum):
    """How the flat state is divided among ranks (see optim/_layout.py)."""

    NONE = "none"  # one rank owns everything
    FLAT = "flat"  # stages 0-2 on several ranks: an equal range of each flat buffer per rank
    PER_PARAM = "per_param"  # stage 3 on several ranks: every parameter cut into one piece per rank


@dataclass(frozen=True)
class ModelSizes:
    """What a plan needs to know of a model: the element count of each trainable parameter (in order), of each
    frozen parameter (under parameter offload homed and fetched like a trainable one: a LoRA run's base is most of
    the window), and of the buffers together."""

    params: tuple[int, ...]
    frozen_params: tuple[int, ...] = ()
    buffers: int = 0

    @classmethod
    def of(cls, trainable: list[torch.Tensor], frozen: list[torch.Tensor] = (),
           buffers: list[torch.Tensor] = ()) -> "ModelSizes":
        return cls(tuple(p.numel() for p in trainable), tuple(p.numel() for p in frozen),
                   sum(b.numel() for b in buffers))

    @property
    def frozen(self) -> int:
        """Elements of the tensors that do not train: frozen parameters and buffers."""
        return sum(self.frozen_params) + self.buffers

    @property
    def offloaded(self) -> tuple[int, ...]:
        """Every parameter, trainable then frozen: what parameter offload gives a home off the device."""
        return self.params + self.frozen_params

    @property
    def numel(self) -> int:
        return sum(self.params)

    def layout(self, sub_group_size: int, *, world_size: int = 1, per_param: bool = False,
               align: int = ALIGN) -> FlatLayout:
        """Rank 0's layout of these sizes (the meta device: nothing allocated)."""
        fake = [torch.empty(n, device="meta") for n in self.params] or [torch.empty(1, device="meta")]
        return FlatLayout([fake], sub_group_size, world_size=world_size, per_param=per_param, align=align)


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
    max_live: int  # stage 3: elements of parameters on the device at once
    prefetch_bucket: int  # stage 3: elements of fetches in flight
    persistence_threshold: int
    grad_bucket: int  # elements of gradient per device-to-host copy
    cuda_path: bool  # the CUDA path's copies and kernels: pinned staging of uploads and of NVMe reads, torch's
    # fused Adam for state on the device (CUDA; on the CPU in tests: STAGE_ON_CPU)
    overlap: bool  # sub-groups updated during backward as their gradients become final
    overlap_forward: bool  # step() returns with updates queued; each module's forward waits for its own
    delayed: bool  # one-step delayed parameter update (ZeRO-Offload's DPU)
    grad_slots: int = 0  # host gradients in this many sub-group slots (0: whole buffers, every gradient held)
    trim_heap: bool = False  # the C heap's free pages go back to the OS during backward (offload/memory/_heap.py)
    why: Mapping[str, str] = field(default_factory=dict)

    @property
    def align(self) -> int:
        """Elements parameters and sub-groups start on: a page of parameter bytes when NVMe homes hold them in
        parts, so each part moves by O_DIRECT with no bounce copy."""
        return PAGE_ALIGN if self.param_tier is Tier.NVME and self.partition is not Partition.PER_PARAM else ALIGN

    @property
    def accumulate(self) -> bool:
        return self.gradient_accumulation_steps > 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def grad_staging(self) -> bool:
        """Gradients gather in device buckets before one copy each to the host (the CUDA path, when the optimizer
        is offloaded)."""
        return self.cuda_path and self.optimizer_tier is not Tier.DEVICE

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def frozen_pieces(self, frozen: list[torch.Tensor]) -> FlatLayout | None:
        """Stage 3 on several ranks: the per-parameter layout that cuts the frozen parameters into each rank's
        pieces, as the trainable ones are cut (``ParamShards``); None otherwise (or with nothing frozen)."""
        if self.partition is not Partition.PER_PARAM or not frozen:
            return None
        return FlatLayout([frozen], self.sub_group_size, world_size=self.world_size, rank=self.rank, per_param=True,
                          align=self.align)

    def read_staging(self, sizes: list[int]) -> int:
        """Elements of the pinned arena that NVMe reads of parameters land in (``sizes``: stage 3's pieces on
        several ranks, else the parameters homed on NVMe, read through it on the CUDA path): a prefetch bucket's
        reads in flight plus the largest, at most all of them."""
        bucket = self.prefetch_bucket // (self.world_size if self.partition is Partition.PER_PARAM else 1)
        spans = [arena_span(n, self.dtype_bytes) for n in sizes]  # each piece starts on a page
        return min(arena_span(bucket, self.dtype_bytes) + max(spans, default=0), sum(spans))

    def describe(self) -> str:
        """What was chosen and why, one line per decision."""
        budgets = ", ".join(f"{t.value} " + ("the nvme_path's free space, less 5%" if b is None and t is Tier.NVME
                                            else fmt_bytes(b)) for t, b in self.budgets.items())
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
                         f"persistent up to {self.persistence_threshold:,}")
        lines.append(f"optimizer overlaps backward: {'yes' if self.overlap else 'no'}; the next forward: "
                     f"{'yes' if self.overlap_forward else 'no'}; delayed update: "
                     f"{'yes' if self.delayed else 'no'}; host gradients: "
                     + (f"{self.grad_slots} sub-group slots" if self.grad_slots else "whole buffers")
                     + f"; host heap trimmed in backward: {'yes' if self.trim_heap else 'no'}")
        lines += [f"  {name}: {reason}" for name, reason in self.why.items()]
        return "\n".join(lines)


def grad_slots(overlap: bool, accumulate: bool, optimizer_tier: Tier, why: dict[str, str]) -> int:
    """Sub-group slots for the host gradients, or 0 for whole buffers: slots when each sub-group is updated during
    backward as soon as its gradients are final (one micro-batch; the optimizer offloaded)."""
    if overlap and not accumulate and optimizer_tier is not Tier.DEVICE:
        why["host gradients"] = (f"{GRAD_SLOTS} sub-group slots to start: each sub-group's gradients are held from "
                                 "their arrival until its update during backward has run")
        return GRAD_SLOTS
    if optimizer_tier is not Tier.DEVICE:
        why["host gradients"] = ("whole buffers: every gradient is held until the step"
                                 + (" (micro-batches accumulate)" if accumulate and overlap else ""))
    return 0


def spare_writes(total: int, slot: int, buffers: int) -> int:
    """How many copy-on-write writes of ``slot`` bytes may be in flight beside ``total`` bytes of swapped state:
    their spare extents stay within max(total / 10, SWAP_SLACK), and at least one is allowed."""
    return max(1, min(buffers, max(total // 10, SWAP_SLACK) // max(slot, 1)))


def _round4k(n: int) -> int:
    return -(-n // 4096) * 4096


@dataclass(frozen=True)
class Sizes:
    sub_group_size: int
    buffer_count: int
    max_live: int
    prefetch_bucket: int
    grad_bucket: int
    persistence_threshold: int
    grad_slots: int


def _persistence(model: ModelSizes, dtype_bytes: int, device: int | None, why: dict[str, str]) -> int:
    """PERSISTENCE, lowered until the persistent parameters take at most a quarter of the device budget."""
    threshold = PERSISTENCE
    if device is not None:
        small = sorted(s for s in model.offloaded if s <= threshold)
        while small and sum(small) * dtype_bytes > device // 4:
            threshold = small.pop() - 1
        if threshold < PERSISTENCE:
            why["persistence"] = (f"parameters of at most {threshold:,} elements stay on the device: larger ones "
                                  "would take over a quarter of the device budget")
    return max(threshold, 0)


def choose_sizes(model: ModelSizes, *, optimizer_tier: Tier, param_tier: Tier, dtype_bytes: int, grad_bytes: int,
                 world_size: int, budgets: Mapping[Tier, int | None], staged: bool,
                 given: Mapping[str, int | None], slots: int = 0) -> tuple[Sizes, dict[str, str]]:
    """The sizes of a plan: ``given`` (the configuration's values; None = derive) kept, the rest derived from the
    budgets and the model (see the module docstring); ``slots``: the gradient slots asked for (:func:`grad_slots`),
    kept unless the model is that few sub-groups. Returns them with the reason for each derived one."""
    why: dict[str, str] = {}
    n = -(-model.numel // world_size) if (optimizer_tier is not Tier.DEVICE or world_size > 1) else model.numel
    state = 12 * n
    buffers = given.get("buffer_count")
    sub = given.get("sub_group_size")
    if sub is None and optimizer_tier is Tier.NVME:
        knee = IO_KNEE // 12
        share = n // STATE_SHARE  # elements of state the staging buffers may hold in all
        if buffers is None:
            buffers = 4 if share >= 4 * knee else 2  # 4: reads ahead while the last write drains; 2: the minimum
        sub = max(ALIGN, min(share // buffers, SUB_GROUP_MAX))
        host = budgets.get(Tier.HOST)
        if host is not None:  # the staging buffers take at most half of what the gradients leave of the host budget
            room = (host - grad_bytes * n) // 2 // (12 * buffers) if not slots else \
                host // 2 // (12 * buffers + grad_bytes * slots)  # the gradient slots are sub-groups too
            if ALIGN <= room < sub:
                sub = room
                why["sub_group_size"] = (f"{sub:,} elements: {buffers} staging buffers of {fmt_bytes(12 * sub)} fill "
                                         "half the host budget the gradients leave")
        why.setdefault("sub_group_size", f"{sub:,} elements: {buffers} staging buffers of {fmt_bytes(12 * sub)} "
                       f"hold 1/{STATE_SHARE} of the {fmt_bytes(state)} of optimizer state (disk knee: requests of "
                       f"{fmt_bytes(IO_KNEE)})")
    elif sub is None and optimizer_tier is Tier.HOST:
        sub = max(ALIGN, min(max(n // 16, 1 << 20), SUB_GROUP_MAX))
        why["sub_group_size"] = (f"{sub:,} elements: 1/16 of the model, so updates start during backward as each "
                                 "sub-group's gradients arrive")
    elif sub is None:
        sub = SUB_GROUP_MAX
    if buffers is None:
        buffers = 4
    grad_bucket = given.get("grad_bucket")
    if grad_bucket is None:
        grad_bucket = min(GRAD_BUCKET, sub)
        if staged:
            why["gradient bucket"] = (f"{grad_bucket:,} elements per device-to-host copy (reduce_bucket_size not "
                                      "set): full-speed copies, a few buckets' room on the device")
    max_live, bucket = given.get("max_live"), given.get("prefetch_bucket")
    persistence_threshold = given.get("persistence_threshold")
    if persistence_threshold is None:
        persistence_threshold = PERSISTENCE if param_tier is Tier.DEVICE else \
            _persistence(model, dtype_bytes, budgets.get(Tier.DEVICE), why)
    if param_tier is not Tier.DEVICE:
        homed = [s for s in model.offloaded if s > persistence_threshold]
        largest, total = max(homed, default=0), sum(homed)
        persistent = sum(s for s in model.offloaded if s <= persistence_threshold) + model.buffers
        device = budgets.get(Tier.DEVICE)
        if max_live is None and not homed:
            why["window"] = (f"none: every parameter stays on the device (none has more than the persistence "
                             f"threshold's {persistence_threshold:,} elements)")
        elif max_live is None and device is None:
            max_live = min(total, max(total // 8, largest + largest // 4))
            why["window"] = (f"{max_live:,} elements: an eighth of the offloaded parameters (no device budget), at "
                             "least the largest with a quarter of it to spare for prefetch")
        elif max_live is None:
            staging = 2 * min(grad_bucket, sub) * dtype_bytes if staged else 0
            room = (device // 2 - persistent * dtype_bytes - staging - largest * dtype_bytes) // dtype_bytes
            max_live = max(min(total, room), largest)
            why["window"] = (f"{max_live:,} elements ({fmt_bytes(max_live * dtype_bytes)}): half of the device budget "
                             "for parameters, the rest for activations and gradients")
        if bucket is None:
            bucket = max_live
            why["prefetch bucket"] = "the whole window in flight: the disk's queue stays deepest (docs/benchmarks.md)"
    if slots and slots * sub >= n:  # the slots would hold as much as the whole buffer
        slots = 0
        why["host gradients"] = f"whole buffers: the model fits in {GRAD_SLOTS} sub-groups"
    return Sizes(sub, buffers, max_live or 1, bucket or 1, grad_bucket, persistence_threshold, slots), why


def expected_bytes(plan: Plan, model: ModelSizes) -> dict[Tier, int]:
    """Peak bytes per tier the engine charges for ``model`` under ``plan`` (this rank): the store's accounting as
    arithmetic (tests hold the two within 10%). Activations are not in it (the CPU device tier cannot see them;
    on CUDA the device budget keeps room for them)."""
    d, g = plan.dtype_bytes, torch.empty((), dtype=plan.grad_dtype).element_size()
    per_param = plan.partition is Partition.PER_PARAM
    layout = model.layout(plan.sub_group_size, world_size=plan.world_size, per_param=per_param, align=plan.align)
    frozen = plan.frozen_pieces([torch.empty(n, device="meta") for n in model.frozen_params])
    flat = sum(layout.group_numel)
    owned = layout.owned_numel(0)
    max_sg = layout.max_sub_group_numel
    homed = [s for s in model.offloaded if s > plan.persistence_threshold]
    persistent = sum(s for s in model.offloaded if s <= plan.persistence_threshold)
    largest = max(model.params, default=0)
    out = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.NVME: 0}
    bucket = min(plan.grad_bucket, max_sg)
    if plan.grad_staging:
        out[Tier.DEVICE] += 2 * bucket * d
        if plan.accumulate:
            out[Tier.HOST] += 3 * bucket * d
    if plan.world_size > 1 and plan.partition is Partition.FLAT:  # stages 1-2: the reduce buckets' device pool
        count, numel = pool_buffers(flat, max(layout.group_numel, default=0), plan.grad_bucket)
        out[Tier.DEVICE] += count * numel * d
    if plan.param_tier is Tier.DEVICE:
        out[Tier.DEVICE] += d * (flat + model.frozen + largest)
        if plan.cuda_path and plan.optimizer_tier is not Tier.DEVICE and not plan.delayed:
            out[Tier.HOST] += 2 * max_sg * d  # pinned staging of updated parameters
        if plan.delayed:
            out[Tier.HOST] += d * flat
    else:
        window = min(plan.max_live, sum(homed))
        out[Tier.DEVICE] += d * (window + persistent)
    if plan.optimizer_tier is Tier.DEVICE:
        out[Tier.DEVICE] += g * owned + 12 * owned
    else:
        if plan.grad_slots:
            stagger = 2 << 20 if g * max_sg >= (64 << 20) else 0  # huge-page offset of large gradient buffers
            out[Tier.HOST] += (g * max_sg + stagger) * plan.grad_slots
        else:
            stagger = 2 << 20 if g * owned >= (64 << 20) else 0
            out[Tier.HOST] += (g * owned + stagger) * (2 if plan.delayed else 1)
    if plan.optimizer_tier is Tier.HOST:
        out[Tier.HOST] += 12 * owned
    elif plan.optimizer_tier is Tier.NVME:
        buffers = min(plan.buffer_count, len(layout.sub_groups))
        slot = _round4k(12 * max_sg)
        keys = [12 * sg.numel for sg in layout.sub_groups]
        out[Tier.HOST] += buffers * slot
        out[Tier.NVME] += swap_file_bytes([[n] for n in keys], spare_writes(sum(keys), slot, buffers))
    if plan.param_tier is Tier.HOST:
        out[Tier.HOST] += d * (owned if per_param else flat) + (d * frozen.owned_numel(0) if frozen else 0)
    elif plan.param_tier is Tier.NVME:
        out[Tier.HOST] += UPDATE_BUFFERS * d * max_sg  # the optimizer's staging of updated parameters
        if per_param:
            out[Tier.HOST] += d * plan.read_staging(layout.piece + (frozen.piece if frozen else []))
            out[Tier.NVME] += piece_nvme_bytes(layout, frozen, d, UPDATE_BUFFERS)
        else:
            out[Tier.HOST] += d * persistent  # host copies (homes are written through the optimizer's staging of
            # updated parameters, one part at a time)
            updated = [[d * seg.numel for seg in sg.segments if model.params[seg.param] > plan.persistence_threshold]
                       for sg in layout.sub_groups]  # a key per part; an update rewrites its sub-group's at once
            frozen_parts = []
            for s in model.frozen_params:  # frozen ones in parts of the staging's size
                if s > plan.persistence_threshold:
                    frozen_parts += [max_sg] * (s // max_sg) + ([s % max_sg] if s % max_sg else [])
            out[Tier.NVME] += swap_file_bytes(updated, UPDATE_BUFFERS, [d * n for n in frozen_parts])
            if plan.cuda_path:  # the pinned arena reads land in
                out[Tier.HOST] += d * plan.read_staging(homed)
    if plan.param_tier is Tier.HOST and not per_param:
        out[Tier.HOST] += d * sum(model.frozen_params)  # frozen parameters' host copies
    return out


def resolve(cfg: OffloadConfig, model: ModelSizes, *, device: torch.device, world_size: int = 1, rank: int = 0,
            local_world_size: int = 1, model_in_ram: int = 0, fetched_whole: tuple[str, ...] = ()) -> Plan:
    """The plan for ``cfg`` and ``model`` on this rank. ``model_in_ram``: bytes of the trainable parameters held
    in this process's RAM (not in ``offload.init``'s arena), which ``initialize`` frees as it moves them where the
    parameters stay in layout order (see :func:`resolve_budgets`). ``fetched_whole``: the names of the modules
    whose forward reads their children's parameters itself (``nn.MultiheadAttention``). Raises ValueError naming
    the keys of a combination that cannot run."""
    zero = cfg.zero_optimization
    why: dict[str, str] = {}
    if fetched_whole and zero.offload_param.device != "none":
        why["fetched whole"] = (
            f"{len(fetched_whole)} module(s) ({', '.join(fetched_whole[:3])}{', ...' if len(fetched_whole) > 3 else ''}"
            "): nn.MultiheadAttention's forward reads out_proj's weight and bias itself, so they are fetched with "
            "it; any other read of a parameter outside its own module's forward is found in the first forward and "
            "fetched with the module that makes it from then on")
    if not model.params:
        why["forward only"] = ("no parameter trains (requires_grad=False everywhere): no optimizer state beyond one "
                               "sub-group of padding, no gradients; backward and step raise")
    optimizer_tier, param_tier = _TIER[zero.offload_optimizer.device], _TIER[zero.offload_param.device]
    delayed = zero.offload_optimizer.delayed_update
    if delayed and param_tier is not Tier.DEVICE:
        raise ValueError("offload_optimizer.delayed_update cannot be combined with offload_param yet; turn one "
                         "of them off")
    if world_size > 1 and zero.stage == 3 and param_tier is Tier.DEVICE:
        raise ValueError(f"zero_optimization.stage 3 with several ranks (world size {world_size}) "
                         "partitions parameters into host or NVMe homes: set "
                         "zero_optimization.offload_param.device to \"cpu\" or \"nvme\" (got \"none\"), "
                         "or use stage 2")
    partition = Partition.NONE if world_size == 1 else Partition.PER_PARAM if zero.stage == 3 else Partition.FLAT
    # initialize frees each parameter's RAM as it fills the masters where the parameters go to the GPU or to host
    # or NVMe homes; with a CPU device their new flat buffer takes the RAM back, and pieces are written after
    freed = model_in_ram if partition is not Partition.PER_PARAM and (
        param_tier is not Tier.DEVICE or device.type != "cpu") else 0
    budgets = resolve_budgets(cfg, device, local_world_size, why, freed=freed)
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
    beside_forward = [reason for cond, reason in (
        (not zero.offload_optimizer.overlap_forward, "offload_optimizer.overlap_forward is false"),
        (optimizer_tier is not Tier.HOST, "the optimizer state is not on the host"),
        (param_tier is not Tier.DEVICE, "parameter offload fetches from the homes the update writes"),
        (world_size > 1, "several ranks gather the updated parameters first"),
        (delayed, "the delayed update hides the whole step instead"),
    ) if cond]
    why["next forward"] = ("off: " + "; ".join(beside_forward)) if beside_forward else \
        ("step() returns once the updates are queued; each module's forward waits only for the sub-groups up to "
         "its own parameters (offload_optimizer.overlap_forward)")
    if device.type == "cuda" and not zero.offload_optimizer.pin_memory:
        why["pinned memory"] = ("off (offload_optimizer.pin_memory false): every copy between the GPU and the host "
                                "goes through the driver's staging and blocks the thread that issues it (for "
                                "gradients, backward's), so copies no longer overlap compute")
    cuda_path = device.type == "cuda" or STAGE_ON_CPU
    staged = cuda_path and optimizer_tier is not Tier.DEVICE
    dtype_bytes = torch.empty((), dtype=cfg.dtype).element_size()
    slots = grad_slots(not blockers, accumulate, optimizer_tier, why)
    sizes, chosen = choose_sizes(
        model, optimizer_tier=optimizer_tier, param_tier=param_tier, dtype_bytes=dtype_bytes,
        grad_bytes=4 if accumulate else dtype_bytes, world_size=world_size, budgets=budgets, staged=staged,
        given={"sub_group_size": zero.sub_group_size, "buffer_count": zero.offload_optimizer.buffer_count,
               "max_live": zero.stage3_max_live_parameters, "prefetch_bucket": zero.stage3_prefetch_bucket_size,
               "grad_bucket": zero.reduce_bucket_size,
               "persistence_threshold": zero.stage3_param_persistence_threshold}, slots=slots)
    why.update(chosen)
    return Plan(
        device=device, world_size=world_size, rank=rank, local_world_size=local_world_size, stage=zero.stage,
        partition=partition, dtype=cfg.dtype, grad_dtype=torch.float32 if accumulate else cfg.dtype,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, optimizer_tier=optimizer_tier,
        param_tier=param_tier, budgets=budgets,
        pin_memory=zero.offload_optimizer.pin_memory and device.type == "cuda",
        sub_group_size=sizes.sub_group_size, buffer_count=sizes.buffer_count,
        max_live=sizes.max_live, prefetch_bucket=sizes.prefetch_bucket,
        persistence_threshold=sizes.persistence_threshold, grad_bucket=sizes.grad_bucket,
        cuda_path=cuda_path, overlap=not blockers, overlap_forward=not beside_forward, delayed=delayed,
        grad_slots=sizes.grad_slots, trim_heap=trim_heap(cfg.offload.trim_host_heap, device, why), why=why)


def trim_heap(setting: bool | None, device: torch.device, why: dict[str, str]) -> bool:
    """Whether backward returns the C heap's free pages: ``offload.trim_host_heap``, or by default where the
    device is the CPU (autograd's tensors then live in that heap) and the C library can."""
    if setting is not None:
        if setting and not heap_trim_available():
            raise ValueError("offload.trim_host_heap is true but this C library has no malloc_trim (glibc only); "
                             "set it to false or \"auto\"")
        return setting
    if device.type != "cpu":
        return False
    if not heap_trim_available():
        why["host heap"] = "not trimmed: this C library has no malloc_trim (glibc only)"
        return False
    why["host heap"] = ("trimmed in backward: activations freed on the CPU device return to the OS before "
                        "backward's later allocations (offload.trim_host_heap)")
    return True


def resolve_budgets(cfg: OffloadConfig, device: torch.device, local_world_size: int = 1,
                    why: dict[str, str] | None = None, *, freed: int = 0) -> dict[Tier, int | None]:
    """Each tier's budget: the configuration's, else the device's memory (CUDA) or none (CPU), 90% of the host's
    available memory shared by the ranks on it, plus 90% of the ``freed`` bytes of this rank's model that
    initialize releases while it fills the host tier (the model was built before MemAvailable was read), the NVMe
    filesystem's free space (decided at the first claim)."""
    why = why if why is not None else {}
    device_budget = cfg.offload.device_memory_budget
    if device_budget is None and device.type == "cuda":
        device_budget = torch.cuda.get_device_properties(device).total_memory
        why["device budget"] = "the CUDA device's total memory (offload.device_memory_budget not set)"
    host_budget = cfg.offload.host_memory_budget
    if host_budget is None:  # ranks on one host share its memory
        host_budget = default_host_budget() // local_world_size + freed * 9 // 10
        why["host budget"] = ("90% of MemAvailable at initialize" +
                              (f", shared by {local_world_size} ranks" if local_world_size > 1 else "") +
                              (f", plus 90% of the {fmt_bytes(freed)} of the model in RAM that initialize frees as "
                               "it moves the parameters (a copy of them you keep is not freed: then set "
                               "offload.host_memory_budget)" if freed else ""))
    return {Tier.DEVICE: device_budget, Tier.HOST: host_budget, Tier.NVME: cfg.offload.nvme_memory_budget}
