"""Engine: trains a torch model with its optimizer state offloaded (ZeRO-Offload / ZeRO-Infinity for the optimizer).

What ``initialize`` sets up, and who owns what afterwards:

* the :class:`TieredStore` (budgets of DEVICE, HOST and NVME; the swap engine; staging buffers);
* the :class:`FlatLayout` of the trainable parameters and the :class:`OffloadedAdam` holding fp32 master weights
  and moments on HOST or NVME, with gradient buffers on HOST (fp32 when micro-batches accumulate, else the
  training dtype);
* one flat low-precision buffer per param group on the DEVICE tier: the model's parameters become views into it
  (same ``nn.Parameter`` objects, so tied weights and user references keep working), and the optimizer writes new
  parameters straight into it;
* a post-accumulate-grad hook per parameter that streams each gradient to the host buffer the moment it is final
  and frees its device memory.

A step: ``engine.backward(loss)`` scales the loss (fp16 loss scale, 1/accumulation steps) and runs backward; the
hooks fill the host gradient buffers and, where the semantics allow (bf16/fp32, no clipping, last micro-batch),
hand each sub-group whose gradients are all final to the optimizer thread during the rest of backward.
``engine.step()`` at an accumulation boundary checks for overflow (fp16), computes the global gradient norm for
clipping, folds loss scale and clipping into one gradient divisor for the CPU Adam kernel, and updates the
remaining sub-groups. The model is wrapped in place: ``engine(batch)`` and ``model(batch)`` are the same call.

With several ranks (torch.distributed, or torchrun's environment: :mod:`offload.dist`) the layout gives this rank
1/N of every flat buffer; gradients are reduce-scattered to their owners (at the step in stage 1, after each
backward in stage 2, in each hook in stage 3), updated parameters all-gathered (after the step, or on demand in
stage 3). One rank runs the same code with collectives that are copies or nothing.
"""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from nvme_swapper import FileIO, aligned_tensor

from . import _checkpoint
from ._precision import LossScaler
from .config import OffloadConfig
from .dist import Comm, GradPartition, ParamShards, join
from .memory import Tier, TieredStore, default_host_budget, fmt_bytes, prepare_nvme_path
from .optim._layout import FlatLayout, Segment
from .optim.offloaded import OffloadedAdam
from .params import ParameterOffload

_PLACEMENT = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}


class Phase(Enum):
    """Where the engine is in a training step."""

    IDLE = "idle"  # between steps, or between micro-batches of an accumulation window
    BACKWARD = "backward"
    STEP = "step"
    CLOSED = "closed"


class Engine:
    """Returned by :func:`offload.initialize`. See the module docstring."""

    def __init__(self, model: torch.nn.Module, config: OffloadConfig | Mapping[str, Any] | str | Path | None = None,
                 *, param_groups: Iterable[dict[str, Any]] | None = None, _file_io: FileIO | None = None) -> None:
        """``_file_io`` (tests only): the OS-call boundary of the optimizer state's swap engine, to inject faults."""
        self.config = cfg = OffloadConfig.load(config)
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
        zero = cfg.zero_optimization
        self.module = model
        self.dtype = cfg.dtype
        self.stage = zero.stage  # 0 partitions the optimizer state like 1: replicating it is never cheaper
        self.phase = Phase.IDLE
        self.global_steps = 0
        self.micro_steps = 0
        self.scaler = LossScaler(cfg.fp16)
        self._closed = False
        self._hooks: list[Any] = []
        self._delayed = zero.offload_optimizer.delayed_update
        self._param_home = zero.offload_param.device  # "none": parameters live on the device
        if self._delayed and self._param_home != "none":
            raise ValueError("offload_optimizer.delayed_update cannot be combined with offload_param yet; turn one "
                             "of them off")
        self._zero: GradPartition | None = None
        self._seen_micro: set[int] = set()  # parameters with a gradient in this micro-batch
        self._params: ParameterOffload | None = None
        self._shards: ParamShards | None = None  # stage 3 on several ranks: this rank's pieces of the parameters
        self._apply_pending = False
        self._next_flats: list[torch.Tensor] = []
        self._rank_dirs: list[Path] = []
        self.comm = Comm(join(cfg.offload.comm_timeout, torch.device("cuda" if torch.cuda.is_available() else "cpu")))
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        try:
            if self.world_size > 1 and self._delayed:
                raise ValueError(f"offload_optimizer.delayed_update is not supported with several ranks (world size "
                                 f"{self.world_size}) yet; turn it off")
            if self.world_size > 1 and self.stage == 3 and self._param_home == "none":
                raise ValueError(f"zero_optimization.stage 3 with several ranks (world size {self.world_size}) "
                                 "partitions parameters into host or NVMe homes: set "
                                 "zero_optimization.offload_param.device to \"cpu\" or \"nvme\" (got \"none\"), "
                                 "or use stage 2")
            self._nvme_paths = {name: self._prepare_nvme(name) for name in ("offload_optimizer", "offload_param")}
            groups, options = self._param_groups(param_groups)
        except BaseException:
            self._close_comm()
            raise
        placement = _PLACEMENT[zero.offload_optimizer.device]
        device_budget = cfg.offload.device_memory_budget
        if device_budget is None and self.device.type == "cuda":
            device_budget = torch.cuda.get_device_properties(self.device).total_memory
        host_budget = cfg.offload.host_memory_budget
        if host_budget is None:  # ranks on one host share its memory
            host_budget = default_host_budget() // (self.comm.pg.local_world_size if self.world_size > 1 else 1)
        self.store = TieredStore(self.device, {
            Tier.DEVICE: device_budget,
            Tier.HOST: host_budget,
            Tier.NVME: cfg.offload.nvme_memory_budget,
        }, pin_memory=zero.offload_optimizer.pin_memory, file_io=_file_io)
        try:
            self.layout = FlatLayout(groups, zero.sub_group_size, world_size=self.world_size, rank=self.rank,
                                     whole_params=self._param_home == "nvme" and self.world_size == 1,
                                     per_param=self.stage == 3 and self.world_size > 1)
            if self._param_home == "none":
                self._reserve_device()
            accumulate = cfg.gradient_accumulation_steps > 1
            self._zero = GradPartition(self.comm, self.layout, self.store, stage=self.stage, dtype=self.dtype,
                                       accumulate=accumulate)
            self.optimizer = OffloadedAdam(self.layout, self.store, cfg.optimizer, placement, group_options=options,
                                           nvme_path=self._nvme_paths["offload_optimizer"],
                                           buffer_count=zero.offload_optimizer.buffer_count, aio=cfg.aio,
                                           grad_dtype=torch.float32 if accumulate else self.dtype,
                                           grad_buffers=2 if self._delayed else 1)
            if self._param_home != "none":
                self._flats = []
                self._offload_parameters()
            elif self._delayed:
                # updates land in host buffers, copied to the device at the next step
                self._flats = self._flatten_to_device()
                self._next_flats = [self.store.allocate(Tier.HOST, f.numel(), self.dtype, "delayed-update parameters",
                                                        "raise offload.host_memory_budget or turn off "
                                                        "offload_optimizer.delayed_update") for f in self._flats]
                self.optimizer.attach_device(self._next_flats)
            else:
                self._flats = self._flatten_to_device()
                self.optimizer.attach_device(self._flats)
            self._install_hooks()
        except BaseException:
            self._teardown()
            raise
        self._overlap = (zero.offload_optimizer.overlap_step and not self._delayed and not cfg.fp16.enabled
                         and cfg.gradient_clipping == 0.0 and self.world_size == 1)  # ranks: reduce first
        self._comm_mark = self._comm_totals()
        self.last_step_comm = {"payload_bytes": 0, "wire_bytes": 0}
        self._pending = [0] * len(self.layout.sub_groups)
        self._seen: set[int] = set()
        self._start_window()

    # construction -----------------------------------------------------------------------------------------------

    def _prepare_nvme(self, name: str) -> str | None:
        """The checked swap directory of ``zero_optimization.<name>``: with several ranks, a ``rank<r>`` folder of
        its nvme_path per rank (removed at close if left empty), so ranks sharing a disk never share files."""
        section = getattr(self.config.zero_optimization, name)
        if section.device != "nvme":
            return section.nvme_path
        path = prepare_nvme_path(section.nvme_path, f"zero_optimization.{name}.nvme_path")
        if self.world_size > 1:
            sub = path / f"rank{self.rank}"
            if not sub.exists():
                self._rank_dirs.append(sub)
            path = prepare_nvme_path(sub, f"zero_optimization.{name}.nvme_path (rank {self.rank})")
        return str(path)

    def _param_groups(self, param_groups: Iterable[dict[str, Any]] | None
                      ) -> tuple[list[list[torch.nn.Parameter]], list[dict[str, Any]]]:
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("initialize: the model has no parameter with requires_grad=True")
        if param_groups is None:
            return [trainable], [{}]
        ids = {id(p) for p in trainable}
        groups, options, seen = [], [], set()
        for i, g in enumerate(param_groups):
            if not isinstance(g, Mapping) or "params" not in g:
                raise ValueError(f"param_groups[{i}] must be a dict with a 'params' list")
            params = list(g["params"])
            for p in params:
                if id(p) not in ids:
                    raise ValueError(f"param_groups[{i}] holds a tensor that is not a trainable parameter of the "
                                     "model")
                if id(p) in seen:
                    raise ValueError(f"param_groups[{i}] repeats a parameter already in an earlier group")
                seen.add(id(p))
            unknown = set(g) - {"params", "lr", "betas", "eps", "weight_decay", "bias_correction", "adamw_mode"}
            if unknown:
                raise ValueError(f"param_groups[{i}]: unknown option {sorted(unknown)[0]!r}; allowed: lr, betas, "
                                 "eps, weight_decay, bias_correction, adamw_mode")
            groups.append(params)
            options.append({k: v for k, v in g.items() if k != "params"})
        missing = [p for p in trainable if id(p) not in seen]
        if missing:
            raise ValueError(f"param_groups leave {len(missing)} trainable parameter(s) out; add them to a group "
                             "or set requires_grad=False")
        return groups, options

    def _reserve_device(self) -> None:
        """The DEVICE tier holds the flat parameters, the frozen tensors, and room for the largest gradient."""
        size = torch.empty((), dtype=self.dtype).element_size()
        flat = sum(n * size for n in self.layout.group_numel)
        frozen = sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                     for t in self._frozen_tensors())
        grad = max(p.numel() for p in self.layout.params) * size
        self._device_bytes = flat + frozen + grad
        self.store.accounts[Tier.DEVICE].reserve(
            self._device_bytes, f"the model's {fmt_bytes(flat)} of {self.dtype} parameters, {fmt_bytes(frozen)} "
            f"of frozen tensors and one {fmt_bytes(grad)} gradient",
            "raise offload.device_memory_budget (parameter offload is the other way out)")

    def _frozen_tensors(self) -> list[torch.Tensor]:
        trainable = {id(p) for p in self.layout.params}
        frozen = [p for p in self.module.parameters() if id(p) not in trainable]
        return frozen + [b for b in self.module.buffers()]

    def _flatten_to_device(self) -> list[torch.Tensor]:
        flats = []
        for g, numel in enumerate(self.layout.group_numel):
            flat = torch.zeros(numel, dtype=self.dtype, device=self.device) if self.device.type == "cuda" \
                else aligned_tensor(numel, self.dtype, pin_memory=False)
            flats.append(flat)
        with torch.no_grad():
            for i, p in enumerate(self.layout.params):
                view = self.layout.param_view(flats[self.layout.param_group[i]], i)
                view.copy_(p.detach())
                p.data = view
            trainable = {id(p) for p in self.layout.params}
            for p in self.module.parameters():
                if id(p) not in trainable:
                    p.data = p.data.to(self.device, self.dtype if p.is_floating_point() else p.dtype)
            for mod in self.module.modules():
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        mod._buffers[name] = buf.to(self.device, self.dtype if buf.is_floating_point() else buf.dtype)
        return flats

    def _offload_parameters(self) -> None:
        """Parameter offload: homes on HOST (the flat host buffers the optimizer updates in place) or NVMe (a key
        per parameter, rewritten after each sub-group's update; with several ranks in stage 3, keys of this rank's
        pieces in its own folder); the device holds a window (params/_offload.py)."""
        zero = self.config.zero_optimization
        layout = self.layout
        trainable = {id(p) for p in layout.params}
        frozen = [p for p in self.module.parameters() if id(p) not in trainable]
        homes: list[torch.Tensor | None] = [None] * len(layout.params)
        shards = None
        if layout.per_param and self._param_home == "nvme":  # pieces in this rank's NVMe folder
            shards = self._shards = ParamShards(self.comm, layout, self.device, store=self.store, dtype=self.dtype,
                                                nvme_path=self._nvme_paths["offload_param"], aio=self.config.aio)
            with torch.no_grad():
                for i, p in enumerate(layout.params):
                    shards.write(i, p.detach())
            self.optimizer.attach_device([], on_updated=shards.write_updated, dtype=self.dtype)
        elif layout.per_param:  # several ranks: each home holds this rank's piece of every parameter
            self._host_flats = [self.store.allocate(Tier.HOST, layout.owned_numel(g), self.dtype,
                                                    f"this rank's share of the parameters of param group {g}",
                                                    "raise offload.host_memory_budget or use more ranks")
                                for g in range(len(layout.group_numel))]
            shards = self._shards = ParamShards(self.comm, layout, self.device, flats=self._host_flats)
            with torch.no_grad():
                for i, p in enumerate(layout.params):
                    shards.write(i, p.detach())
            self.optimizer.attach_device(self._host_flats, owned_only=True)
        elif self._param_home == "cpu":
            self._host_flats = [self.store.allocate(Tier.HOST, n, self.dtype, f"the host home of param group {g}",
                                                    "raise offload.host_memory_budget or home the parameters on nvme")
                                for g, n in enumerate(layout.group_numel)]
            with torch.no_grad():
                for i, p in enumerate(layout.params):
                    view = layout.param_view(self._host_flats[layout.param_group[i]], i)
                    view.copy_(p.detach())
                    homes[i] = view.view(-1)
            self.optimizer.attach_device(self._host_flats)
        else:
            self.optimizer.attach_device([], on_updated=self._write_param_homes, dtype=self.dtype)
        with torch.no_grad():
            for mod in self.module.modules():
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        mod._buffers[name] = buf.to(self.device, self.dtype if buf.is_floating_point() else buf.dtype)
        self._params = ParameterOffload(
            self.module, layout.params + frozen, homes + [None] * len(frozen), self.store, self.dtype,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            max_live=zero.stage3_max_live_parameters, bucket=zero.stage3_prefetch_bucket_size,
            nvme_path=self._nvme_paths["offload_param"] if self._param_home == "nvme" else None, aio=self.config.aio,
            shards=shards)

    def _write_param_homes(self, sg: Any, values: torch.Tensor) -> None:
        """On the optimizer thread, after a sub-group's update: its parameters go to their NVMe homes."""
        assert self._params is not None
        for seg in sg.segments:
            assert seg.param_start == 0 and seg.numel == self.layout.params[seg.param].numel()
            lo = seg.flat_start - sg.start
            self._params.write_home(self._params.index_of(self.layout.params[seg.param]), values[lo : lo + seg.numel])

    def register_external_parameter(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """With parameter offload, a parameter is on the device while its own module runs; declare here one that
        ``module`` reads directly although another module owns it (a no-op without parameter offload)."""
        if self._params is not None:
            self._params.register_external(module, param)

    def read_parameter(self, p: torch.nn.Parameter) -> torch.Tensor:
        """A parameter's current low-precision value as a host tensor, wherever it lives."""
        if self._params is not None:
            return self._params.read_home(self._params.index_of(p))
        return p.detach().cpu()

    def write_parameter(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Sets a parameter's low-precision value wherever it lives (rounded to its dtype)."""
        with torch.no_grad():
            if self._params is not None:
                self._params.write_home(self._params.index_of(p), value.to(self.dtype).reshape(-1))
            else:
                p.copy_(value)

    def _install_hooks(self) -> None:
        self._segments: list[list[tuple[int, Segment]]] = [[] for _ in self.layout.params]
        for sg in self.layout.sub_groups:
            for seg in sg.segments:
                self._segments[seg.param].append((sg.index, seg))
        for i, p in enumerate(self.layout.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _make_hook(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            self._stream_grad(i, p)
        return hook

    # the training step ------------------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.micro_steps % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` scaled by the fp16 loss scale and 1/gradient_accumulation_steps."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor")
        gas = self.gradient_accumulation_steps
        self._last_micro = self.micro_steps % gas == gas - 1
        self.phase = Phase.BACKWARD
        self.optimizer.begin_backward()
        self._seen_micro.clear()
        try:
            (loss.float() * (self.scaler.scale / gas)).backward()
            if self._zero is not None and self._zero.buffered and self.stage == 2:
                # stage 2: this micro-batch's gradients go to their owners now, accumulating there
                self._zero.reduce(self.optimizer.grads, self._seen_micro, accumulate=self.micro_steps % gas != 0)
        finally:
            self.optimizer.end_backward()
            if self._params is not None:
                self._params.end_backward(step_follows=self._last_micro)
            self.phase = Phase.IDLE
        self.micro_steps += 1

    def _stream_grad(self, i: int, p: torch.Tensor) -> None:
        grad = p.grad
        assert grad is not None
        flat = grad.detach().reshape(-1)
        first = i not in self._seen
        own0 = self.layout.owned
        assert self._zero is not None
        base = 0
        if self.layout.per_param:  # stage 3: summed over ranks now, this rank's piece kept
            flat, base = self._zero.reduce_param(i, flat), self.rank * self.layout.piece[i]
        elif self._zero.buffered:  # several ranks: into the full buffer, reduced to the owners later
            self._zero.add(i, flat, first if self.stage <= 1 else i not in self._seen_micro)
        for sg_index, seg in self._segments[i] if not self._zero.buffered else ():
            sg = self.layout.sub_groups[sg_index]
            dst_start = seg.flat_start - own0[sg.group][0]
            dst = self.optimizer.grads[sg.group][dst_start : dst_start + seg.numel]
            src = flat[seg.param_start - base : seg.param_start - base + seg.numel]
            if first:
                dst.copy_(src)
            else:  # accumulating: the buffer is fp32
                dst.add_(src.to(dst.device, dst.dtype))
        self._seen.add(i)
        self._seen_micro.add(i)
        if self._params is not None:
            self._params.grad_done(p)
        if self.optimizer.placement is not Tier.DEVICE and not self._zero.buffered:
            self.store.count(Tier.DEVICE, Tier.HOST, flat.numel() * flat.element_size())
        p.grad = None  # the device copy is no longer needed
        if self._overlap and self._last_micro:
            for sg_index in self.layout.param_sub_groups[i]:
                self._pending[sg_index] -= 1
                if self._pending[sg_index] == 0:
                    self.optimizer.submit(sg_index)

    def step(self) -> None:
        """At an accumulation boundary: overflow check, clipping, the optimizer step; a no-op between micro-batches.
        Gradients are consumed (the next backward starts from zero)."""
        self._check_open()
        if self.micro_steps == 0:
            raise RuntimeError("engine.step() called before any engine.backward(loss)")
        if not self.is_gradient_accumulation_boundary():
            return
        self.phase = Phase.STEP
        try:
            if self._delayed:
                self.optimizer.finish()  # the previous step's update, which ran beside this forward/backward
                self.apply_delayed_update()
            assert self._zero is not None
            if not self._zero.buffered:
                self._zero_unseen_grads()
            elif self.stage <= 1:  # stage 1: the window's gradients go to their owners now
                self._zero.reduce(self.optimizer.grads, self._seen, accumulate=False)
            grad_scale = self.scaler.scale * self.world_size  # the kernel divides: the mean over ranks
            if self.config.fp16.enabled or self.config.gradient_clipping > 0:
                self.optimizer.wait()
                norm = self._grad_norm()
                if not math.isfinite(norm):
                    if self.config.fp16.enabled:
                        self.scaler.update(True)
                        self.optimizer.skip()
                        return
                    raise FloatingPointError(f"gradient norm is {norm} at step {self.global_steps}: the loss or "
                                             "the model produced inf/NaN")
                norm /= grad_scale
                self.last_grad_norm = norm
                clip = self.config.gradient_clipping
                if clip > 0:
                    coef = clip / (norm + 1e-6)
                    if coef < 1.0:
                        grad_scale /= coef
            if self._delayed:
                self.optimizer.launch(grad_scale=grad_scale)  # runs beside the next forward/backward
                self.optimizer.swap_grads()
                self._apply_pending = True
            else:
                self.optimizer.step(grad_scale=grad_scale)
                if self._param_home == "none":
                    self._zero.gather_params(self._flats)  # every rank's updated share, to every rank
            if self._params is not None:
                self._params.updated()
            if self.config.fp16.enabled:
                self.scaler.update(False)
            self.global_steps += 1
        finally:
            self._start_window()
            self.phase = Phase.IDLE
            totals = self._comm_totals()
            self.last_step_comm = {k: totals[k] - self._comm_mark[k] for k in totals}
            self._comm_mark = totals

    def _comm_totals(self) -> dict[str, int]:
        return {"payload_bytes": sum(self.comm.payload_bytes.values()),
                "wire_bytes": sum(self.comm.wire_bytes.values())}

    def apply_delayed_update(self) -> None:
        """Delayed update: copies the parameters of the last finished update to the device (done by ``step``)."""
        if not self._apply_pending:
            return
        self.optimizer.finish()
        for dst, src in zip(self._flats, self._next_flats):
            dst.copy_(src, non_blocking=dst.device.type == "cuda")
            self.store.count(Tier.HOST, Tier.DEVICE, src.numel() * src.element_size())
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._apply_pending = False

    def _start_window(self) -> None:
        self._seen.clear()
        counts = [0] * len(self.layout.sub_groups)
        for sgs in self.layout.param_sub_groups:
            for k in sgs:
                counts[k] += 1
        self._pending = counts

    def _zero_unseen_grads(self) -> None:
        """Parameters that got no gradient in this window (unused branches) update with a zero gradient."""
        for i in range(len(self.layout.params)):
            if i not in self._seen:
                for sg_index, seg in self._segments[i]:
                    sg = self.layout.sub_groups[sg_index]
                    start = seg.flat_start - self.layout.owned[sg.group][0]
                    self.optimizer.grads[sg.group][start : start + seg.numel].zero_()

    def _grad_norm(self) -> float:
        """The global norm: of this rank's share here, summed in squares over ranks (the same on every rank, so
        all skip an overflowing fp16 step together)."""
        total = 0.0
        for g in self.optimizer.grads:
            n = torch.linalg.vector_norm(g, dtype=torch.float32).item()
            if math.isinf(n) and bool(torch.isfinite(g).all()):  # the squares overflowed, not the gradients
                n = torch.linalg.vector_norm(g, dtype=torch.float64).item()
            total += n * n
        return math.sqrt(self.comm.sum_float(total))

    # state ------------------------------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, dict[str, int | None]]:
        """This rank's bytes per tier: current, peak and budget (None: unlimited), and of them the optimizer
        state (``optimizer_state``: this rank's share; ``optimizer_state_all_ranks``: the whole model's, padding
        included). With N ranks each holds 1/N of the state, gradients and (stage 3) parameters."""
        report = self.store.memory_report()
        mine = sum(12 * sg.numel for sg in self.layout.sub_groups)
        total = 12 * sum(self.layout.group_numel)
        for tier, r in report.items():
            on_tier = tier == self.optimizer.placement.value
            r["optimizer_state"] = mine if on_tier else 0
            r["optimizer_state_all_ranks"] = total if on_tier else 0
        return report

    def stats(self) -> dict[str, Any]:
        """Counters: bytes moved per tier pair, time stalled on I/O, time in Adam and the share hidden in backward."""
        opt = self.optimizer
        return {
            "steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.scaler.skipped,
            "loss_scale": self.scaler.scale,
            "bytes_moved": dict(self.store.moved),
            "stall_seconds": self.store.stall_seconds,
            "adam_seconds": opt.adam_seconds,
            "adam_seconds_overlapped": opt.adam_seconds_overlapped,
            "overlap_fraction": opt.adam_seconds_overlapped / opt.adam_seconds if opt.adam_seconds else 0.0,
            "sub_groups_overlapped": opt.sub_groups_overlapped,
            "nvme": self.store.swap_stats(),
            "params": self._params.stats() if self._params is not None else None,
            # collectives (none with one rank): totals since initialize, and the last optimizer step's (the
            # reduce-scatters of its micro-batches included); payload: the ZeRO paper's measure, wire: ring sends
            "comm": {**self.comm.stats(), "last_step": dict(self.last_step_comm)},
        }

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state as plain CPU tensors: fp32 master weights for trainable parameters."""
        self._check_open()
        self.optimizer.wait()
        return _checkpoint.consolidated_state_dict(self)

    def save_checkpoint(self, path: str | Path, tag: str | None = None) -> Path:
        """Writes model, optimizer state (wherever it lives), loss scaler and counters under ``path/tag`` and then
        points ``path/latest`` at it; a crash mid-save leaves the previous checkpoint loadable."""
        self._check_open()
        self.optimizer.wait()
        return _checkpoint.save(self, Path(path), tag or f"step{self.global_steps}")

    def load_checkpoint(self, path: str | Path, tag: str | None = None) -> str:
        """Restores a checkpoint written by save_checkpoint (``latest`` unless ``tag``); returns the tag."""
        self._check_open()
        self.optimizer.wait()
        return _checkpoint.load(self, Path(path), tag)

    # lifetime ---------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Joins the optimizer thread, closes the swap engine (removing its files) and frees the tiers' buffers.
        The model keeps working with its current parameters."""
        if self._closed:
            return
        try:
            if hasattr(self, "optimizer"):
                self.apply_delayed_update()  # the model keeps every update it was given
        finally:
            self._closed = True
            self.phase = Phase.CLOSED
            self._teardown()

    def _teardown(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        try:
            try:
                if self._params is not None:
                    self.optimizer.wait()
                    self._params.close()  # the model gets its current parameters back as plain tensors
                    self._params = None
                if self._shards is not None:
                    self._shards.close()
                    self._shards = None
                if hasattr(self, "optimizer"):
                    self.optimizer.close()
                if self._zero is not None:
                    self._zero.close()
                for f in self._next_flats + getattr(self, "_host_flats", []):
                    self.store.free(Tier.HOST, f)
                self._next_flats, self._host_flats = [], []
            finally:
                self.store.close()
        finally:
            self._close_comm()

    def _close_comm(self) -> None:
        """Stops the heartbeat, destroys the process group if the engine created it, and removes the per-rank
        NVMe folders it made (when empty: the swap engines have removed their files)."""
        try:
            self.comm.close()
        finally:
            for d in self._rank_dirs:
                try:
                    d.rmdir()
                except OSError:
                    pass
            self._rank_dirs = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def initialize(model: torch.nn.Module, config: OffloadConfig | Mapping[str, Any] | str | Path | None = None, *,
               param_groups: Iterable[dict[str, Any]] | None = None, _file_io: FileIO | None = None) -> Engine:
    """Wraps ``model`` (in place) for offloaded training under ``config`` (a dict, a JSON path, or OffloadConfig).
    Fails here, with the numbers, if the configuration cannot fit its tier budgets or an nvme_path is unusable.
    ``_file_io`` is for fault-injection tests (see :class:`Engine`)."""
    return Engine(model, config, param_groups=param_groups, _file_io=_file_io)
