"""CPUAdam: torch.optim-compatible Adam/AdamW for fp32 parameters on the CPU, backed by the fused kernel.

It exists so that host-resident master weights (ZeRO-Offload style) can be updated at memory bandwidth while the
rest of a training script treats it as any ``torch.optim.Optimizer``: LR schedulers, per-group hyperparameters and
``state_dict`` in torch's own layout (``step`` as a tensor, ``exp_avg``, ``exp_avg_sq``), so checkpoints move freely
between this class and ``torch.optim.AdamW`` / ``torch.optim.Adam``.

Large optimizer states live in huge-page host buffers (:func:`offload.ops.host_stream_buffer`), placed so that the
parameter and its two moments do not share DRAM banks in lockstep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..ops import adam_step, host_stream_buffer

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]

# States of at least this many bytes go into huge-page buffers; smaller ones gain nothing from a 2 MiB page and
# would waste most of it.
_HUGE_STATE_BYTES = 4 << 20


def _zeros_state(param: torch.Tensor, slot: int) -> torch.Tensor:
    if param.numel() * param.element_size() < _HUGE_STATE_BYTES:
        return torch.zeros_like(param, memory_format=torch.contiguous_format)
    return host_stream_buffer(param.numel(), param.dtype, slot=slot, anchor=param).view(param.shape)


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW over fp32 CPU parameters with a single-pass SIMD update (see :func:`offload.ops.adam_step`).

    ``adamw_mode=True`` (default) applies decoupled weight decay like ``torch.optim.AdamW``; ``False`` adds
    ``weight_decay * param`` to the gradient like ``torch.optim.Adam``. ``bias_correction=False`` drops the
    ``1 - beta**step`` factors. Results match torch's implementations to within fp32 rounding.

    Not supported (rejected with ValueError): ``amsgrad=True``, sparse gradients, complex or non-fp32 parameters,
    parameters not on the CPU.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("CPUAdam: amsgrad=True is not supported; use torch.optim.AdamW(amsgrad=True) instead")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        lr = float(group["lr"])
        if not lr >= 0.0:
            raise ValueError(f"CPUAdam: invalid lr={group['lr']}; it must be >= 0")
        if not float(group["eps"]) >= 0.0:
            raise ValueError(f"CPUAdam: invalid eps={group['eps']}; it must be >= 0")
        beta1, beta2 = group["betas"]
        for index, beta in enumerate((beta1, beta2)):
            if not 0.0 <= float(beta) < 1.0:
                raise ValueError(f"CPUAdam: invalid betas[{index}]={beta}; it must be in [0, 1)")
        if not float(group["weight_decay"]) >= 0.0:
            raise ValueError(f"CPUAdam: invalid weight_decay={group['weight_decay']}; it must be >= 0")
        if group.get("amsgrad", False):
            raise ValueError("CPUAdam: amsgrad=True is not supported; use torch.optim.AdamW(amsgrad=True) instead")
        if group.get("maximize", False):
            raise ValueError("CPUAdam: maximize=True is not supported; negate the loss instead")
        for p in group["params"]:
            if p.device.type != "cpu":
                raise ValueError(
                    f"CPUAdam: a parameter of shape {tuple(p.shape)} is on {p.device}; CPUAdam updates CPU "
                    "parameters only (keep an fp32 master copy on the host, or use torch.optim.AdamW on the device)"
                )
            if p.is_complex():
                raise ValueError(
                    f"CPUAdam: complex parameter (dtype {p.dtype}) is not supported; use torch.view_as_real on it"
                )
            if p.dtype != torch.float32:
                raise ValueError(
                    f"CPUAdam: parameter dtype {p.dtype} is not supported; CPUAdam updates fp32 (master) parameters"
                )
            if p.layout != torch.strided:
                raise ValueError(f"CPUAdam: parameter layout {p.layout} is not supported; use dense parameters")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Groups loaded from torch.optim.Adam / AdamW carry their own keys; fill in ours from theirs.
        for group in self.param_groups:
            if "adamw_mode" not in group:
                group["adamw_mode"] = bool(group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", self.defaults["bias_correction"])
            self._check_group(group)

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        # torch.optim.Adam/AdamW read this key (missing means "not decoupled"), so say it for them.
        for group in state_dict["param_groups"]:
            group["decoupled_weight_decay"] = bool(group["adamw_mode"])
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Loaded moments are ordinary tensors; move large ones into huge-page buffers like freshly created state.
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                # A fresh tensor: the loaded one may still be a live optimizer's counter (state_dict() does not copy).
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device="cpu")
                for slot, key in enumerate(("exp_avg", "exp_avg_sq"), start=1):
                    loaded = state[key]
                    if loaded.shape != p.shape:
                        raise ValueError(
                            f"CPUAdam.load_state_dict: {key} has shape {tuple(loaded.shape)} but its parameter has "
                            f"{tuple(p.shape)}; the state dict belongs to a different model"
                        )
                    buffer = _zeros_state(p, slot)
                    buffer.copy_(loaded)
                    state[key] = buffer

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError(
                        "CPUAdam: sparse gradients are not supported; use torch.optim.SparseAdam for sparse "
                        "embeddings (nn.Embedding(sparse=False) makes them dense)"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
                    state["exp_avg"] = _zeros_state(p, slot=1)
                    state["exp_avg_sq"] = _zeros_state(p, slot=2)
                state["step"] += 1
                target = p if p.is_contiguous() else p.contiguous()
                adam_step(
                    target,
                    grad.contiguous(),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=int(state["step"].item()),
                    lr=float(group["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    adamw_mode=bool(group["adamw_mode"]),
                    bias_correction=bool(group["bias_correction"]),
                )
                if target is not p:
                    p.copy_(target)
        return loss
