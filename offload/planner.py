"""offload.estimate: bytes per tier for each placement, before anything is allocated.

For each placement it builds the :class:`~offload.plan.Plan` the engine would (the same :func:`choose_sizes` for
every size not given, from the same budgets) and charges it with :func:`expected_bytes`, the engine's own rules
as arithmetic: a plan that fits here fits in ``initialize``, and tests hold the estimate to within 10% of the
peaks the engine measures. Given a model, the layout is computed exactly (alignment padding, sub-groups,
persistent parameters); given only a parameter count, parameters are taken as tensors of the largest parameter's
size (one tensor without it; :meth:`DecoderShape.typical` gives the one a decoder of that count commonly has).

Per rank with ``gpus`` > 1 (ZeRO: optimizer state and gradients split over the ranks, parameters too when they
are offloaded, i.e. stage 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .memory import Tier, fmt_bytes
from .plan import ModelSizes, Partition, Plan, choose_sizes, expected_bytes, grad_slots

PLACEMENTS = [  # (name, optimizer state, parameters)
    ("no offload", "none", "none"),
    ("optimizer on cpu", "cpu", "none"),
    ("optimizer on nvme", "nvme", "none"),
    ("optimizer + parameters on cpu", "cpu", "cpu"),
    ("optimizer + parameters on nvme", "nvme", "nvme"),
]
_TIER = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}


# Llama 3's vocabulary: among the larger of today's decoders, so the embedding it gives errs on the large side.
LLAMA_VOCAB = 128_256


@dataclass(frozen=True)
class DecoderShape:
    """The shape a decoder of ``num_params`` parameters commonly has (Llama 3's ratios: layers of width / 128, each
    of 13 x width^2 parameters with its MLP 3.5 x as wide, and untied input and output embeddings), for an estimate
    given only a count: its largest parameter, the embedding or an MLP matrix, sets the device's room for one
    parameter's gradient and the parameter window. Below about 0.85B parameters, where that vocabulary would be
    over half the model, the embeddings are taken as half of it (a smaller vocabulary)."""

    num_params: int
    width: int
    layers: int
    vocab: int
    mlp: int  # the MLP's inner width

    @classmethod
    def typical(cls, num_params: int) -> "DecoderShape":
        if num_params < 1:
            raise ValueError(f"DecoderShape.typical: num_params must be positive, got {num_params}")
        n, vocab = float(num_params), LLAMA_VOCAB
        low, high = 1.0, 1e7  # the width where layers and embeddings add up to n (they grow with it: bisect)
        for _ in range(100):
            mid = (low + high) / 2
            low, high = (mid, high) if 13 * mid**3 / 128 + 2 * vocab * mid < n else (low, mid)
        width = low
        if 2 * vocab * width > n / 2:  # a small model: embeddings take half of it
            width = (64 * n / 13) ** (1 / 3)
            vocab = max(1, round(n / (4 * width)))
        width = max(64, 64 * round(width / 64))
        layers = max(1, round((n - 2 * vocab * width) / (13 * width**2)))
        return cls(num_params, width, layers, vocab, max(64, 64 * round(3.5 * width / 64)))

    @property
    def largest_param(self) -> int:
        """Elements of the largest parameter: the embedding (vocabulary x width) or an MLP matrix."""
        return min(self.num_params, max(self.vocab * self.width, self.width * self.mlp))

    def describe(self) -> str:
        which = "the embedding, vocabulary x width" if self.vocab >= self.mlp else "an MLP matrix, width x MLP width"
        n = self.num_params
        count = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"
        return (f"{self.largest_param:,} elements ({which}) of a decoder shaped as Llama's at {count} parameters: "
                f"{self.layers} layer{'s' if self.layers > 1 else ''} of width {self.width:,}, MLP width "
                f"{self.mlp:,}, a {self.vocab:,}-token vocabulary")


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
    plan: Plan | None = None  # the plan the bytes were charged for (its sizes, and why they were chosen)


def estimate(num_params: int | None = None, *, model: torch.nn.Module | None = None, dtype_bytes: int = 2,
             gradient_accumulation_steps: int = 1, sub_group_size: int | None = None, buffer_count: int | None = None,
             max_live_parameters: int | None = None, prefetch_bucket_size: int | None = None,
             persistence_threshold: int | None = None, gpus: int = 1, gpu_mem: int | None = None,
             host_mem: int | None = None, nvme_free: int | None = None, cuda: bool = True,
             gradient_clipping: float = 0.0, largest_param: int | None = None, fp16: bool = False,
             overlap_step: bool = True, delayed_update: bool = False, activations: int = 0) -> list[Estimate]:
    """Peak bytes per tier (per rank) for each placement of :data:`PLACEMENTS`, and whether each fits the given
    memory (``gpu_mem`` per device, ``host_mem`` and ``nvme_free`` per machine shared by ``gpus`` ranks). Sizes
    left None are derived as ``initialize`` derives them; ``cuda``: the device is a GPU (False: the CPU's device
    tier, as on a machine without one, held to ``gpu_mem`` if given and counted with the host tier in its RAM);
    ``gradient_clipping`` > 0 holds every gradient until the step (as do several ranks and accumulation), else the
    host gradients take a few sub-group slots. ``largest_param``
    (with ``num_params``): elements of the model's largest parameter, which sets the device room for one
    parameter's gradient and the parameter window; without it the model counts as one parameter, which charges the
    device for a gradient of the whole model (as DeepSpeed's estimators, ask for it: a GPT's embedding,
    vocabulary x width; ``DecoderShape.typical(num_params).largest_param`` is a common decoder's). ``fp16``,
    ``overlap_step`` false and ``delayed_update`` (placements without parameter offload) hold every gradient until
    the step, as the engine's plan does. ``activations``: bytes the run's activations take on the device at their
    peak, which the engine does not charge to a tier: added to the device tier here, so a placement fits only with
    them (0: not counted). A budget of 0 is one (nothing of that tier); None is none given."""
    if activations < 0:
        raise ValueError(f"estimate: activations must be 0 or more bytes, got {activations}")
    if (num_params is None) == (model is None):
        raise ValueError("estimate: give exactly one of num_params and model")
    if gpus < 1:
        raise ValueError(f"estimate: gpus must be at least 1, got {gpus}")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"estimate: dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes}")
    if model is not None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        sizes = ModelSizes.of(trainable, frozen, list(model.buffers()))
    else:
        n = int(num_params)
        if largest_param is not None and not 1 <= largest_param <= n:
            raise ValueError(f"estimate: largest_param must be in [1, num_params={n}], got {largest_param}")
        big = n if largest_param is None else int(largest_param)
        sizes = ModelSizes((big,) * (n // big) + ((n % big,) if n % big else ()))
    budgets = {Tier.DEVICE: gpu_mem, Tier.HOST: host_mem // gpus if host_mem is not None else None,
               Tier.NVME: nvme_free // gpus if nvme_free is not None else None}
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    accumulate = gradient_accumulation_steps > 1
    out = []
    for name, opt, par in PLACEMENTS:
        optimizer_tier, param_tier = _TIER[opt], _TIER[par]
        staged = cuda and optimizer_tier is not Tier.DEVICE
        why: dict[str, str] = {}
        delayed = delayed_update and par == "none"  # (initialize refuses it with parameter offload)
        overlap = gpus == 1 and gradient_clipping <= 0 and not fp16 and overlap_step and not delayed
        slots = grad_slots(overlap, accumulate, optimizer_tier, why)
        chosen, chosen_why = choose_sizes(
            sizes, optimizer_tier=optimizer_tier, param_tier=param_tier, dtype_bytes=dtype_bytes,
            grad_bytes=4 if accumulate else dtype_bytes, world_size=gpus, budgets=budgets, staged=staged,
            given={"sub_group_size": sub_group_size, "buffer_count": buffer_count, "max_live": max_live_parameters,
                   "prefetch_bucket": prefetch_bucket_size, "grad_bucket": None,
                   "persistence_threshold": persistence_threshold}, slots=slots)
        why.update(chosen_why)
        partition = Partition.NONE if gpus == 1 else Partition.PER_PARAM if par != "none" else Partition.FLAT
        plan = Plan(device=torch.device("cuda" if cuda else "cpu"), world_size=gpus, rank=0, local_world_size=gpus,
                    stage=3 if par != "none" else 2, partition=partition, dtype=dtype,
                    grad_dtype=torch.float32 if accumulate else dtype,
                    gradient_accumulation_steps=gradient_accumulation_steps, optimizer_tier=optimizer_tier,
                    param_tier=param_tier, budgets=budgets, pin_memory=cuda,
                    sub_group_size=chosen.sub_group_size, buffer_count=chosen.buffer_count,
                    max_live=chosen.max_live,
                    prefetch_bucket=chosen.prefetch_bucket, persistence_threshold=chosen.persistence_threshold,
                    grad_bucket=chosen.grad_bucket, cuda_path=cuda, overlap=overlap,
                    overlap_forward=gpus == 1 and optimizer_tier is Tier.HOST and param_tier is Tier.DEVICE
                    and not delayed, delayed=delayed, grad_slots=chosen.grad_slots, why=why)
        used = {t.value: b for t, b in expected_bytes(plan, sizes).items()}
        used["device"] += activations
        given = {"device": gpu_mem, "host": budgets[Tier.HOST], "nvme": budgets[Tier.NVME]}
        in_ram = dict(used, host=used["host"] + (0 if cuda else used["device"]))  # the CPU's device tier is RAM
        over = [t for t in ("device", "host", "nvme") if given[t] is not None and in_ram[t] > given[t]]
        fits = (not over) if any(b is not None for b in given.values()) else None
        out.append(Estimate(name, opt, par, used["device"], used["host"], used["nvme"], fits,
                            over[0] if over else None, plan))
    return out


def best(estimates: list[Estimate]) -> Estimate | None:
    """The first placement that fits, in the order of :data:`PLACEMENTS` (least offload first: fastest)."""
    return next((e for e in estimates if e.fits), None)


def config_for(e: Estimate, nvme_path: str = "/local_nvme", precision: str = "bf16") -> dict[str, Any]:
    """A config fragment for an estimate's placement (its sizes are derived again at initialize), in the
    ``precision`` it was planned for: "bf16", "fp16" or "fp32" (no section: DeepSpeed's default)."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"config_for: precision must be bf16, fp16 or fp32, got {precision!r}")
    zero: dict[str, Any] = {"stage": 3 if e.params != "none" else 2,
                            "offload_optimizer": {"device": e.optimizer}}
    if e.optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme_path
    if e.params != "none":
        zero["offload_param"] = {"device": e.params, **({"nvme_path": nvme_path} if e.params == "nvme" else {})}
    return {**({} if precision == "fp32" else {precision: {"enabled": True}}), "zero_optimization": zero}


def table(estimates: list[Estimate]) -> str:
    lines = [f"{'placement':32s} {'device':>12s} {'host':>12s} {'nvme':>12s}  fits"]
    for e in estimates:
        fits = "-" if e.fits is None else ("yes" if e.fits else f"no ({e.limiting})")
        lines.append(f"{e.placement:32s} {fmt_bytes(e.device):>12s} {fmt_bytes(e.host):>12s} "
                     f"{fmt_bytes(e.nvme):>12s}  {fits}")
    return "\n".join(lines)
