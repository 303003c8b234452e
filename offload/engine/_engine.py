"""Engine: wires the layers a :class:`~offload.plan.Plan` asks for and runs the training step.

What ``initialize`` builds, in order, and who owns what afterwards (``close()`` stops it all, in reverse):

* the process group and this rank's device (:func:`offload.dist.join`); every rank's parameters and buffers made
  rank 0's where they differ (:func:`offload.dist.agree_with_rank0`); then the frozen :class:`Plan`;
* the :class:`TieredStore` (budgets of DEVICE, HOST and NVME, the swap engine, staging buffers) and the
  :class:`CopyStreams` every device<->host copy goes through;
* the :class:`FlatLayout` of the trainable parameters and the :class:`OffloadedAdam` holding fp32 master weights
  and moments on HOST or NVME, with gradient buffers on HOST;
* :class:`Weights`: where the low-precision parameters live (device flats, host or NVMe homes with a device
  window) and how the optimizer's new values reach them;
* :class:`GradientStream`: gradients from the device to the host buffers, bucketed, as they become final;
* :class:`UpdateGate` (``plan.overlap_forward``): ``step()`` returns with the updates queued, and each module's
  forward waits only for the sub-groups it reads (traced in the first forward), so the next forward runs beside
  Adam;
* the engine's own hooks: a post-accumulate-grad hook per trainable parameter, and a forward pre-hook on the root
  module, the one place inputs are moved to the device (tensors in args and kwargs, nested in lists, tuples and
  dicts; asynchronously from pinned memory); and :class:`ModelStateHooks`, through which the model's own
  ``load_state_dict()`` reaches the fp32 masters and its ``state_dict()`` the offloaded parameters' values.

``torch.compile(model)`` may be handed over: the engine's ``module`` is the model it wraps (hooks, names,
checkpoints and exports as without compile) and its forward runs the compiled one (the hooks run eagerly between
the compiled graphs, see offload/_hooks.py).

A step: ``engine.backward(loss)`` scales the loss (fp16 loss scale, 1/accumulation steps) and runs backward; the
hooks hand each final gradient to the gradient stream and, where the plan allows (bf16/fp32, no clipping, last
micro-batch), each sub-group whose gradients have all been sent to the optimizer thread during the rest of
backward. ``engine.step()`` at an accumulation boundary checks for overflow (fp16), computes the global gradient
norm for clipping, folds loss scale and clipping into one gradient divisor for the CPU Adam kernel, and updates
the remaining sub-groups; without clipping the kernel sums the norm as it updates (``last_grad_norm``). Where the
engine is in a step is :class:`Phase`, checked at every call.

With several ranks the layout gives this rank 1/N of every flat buffer; gradients are reduce-scattered to their
owners (at the step in stage 1, after each backward in stage 2, in each hook in stage 3), updated parameters
all-gathered (after the step, or on demand in stage 3). One rank runs the same code with collectives that are
copies or nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import os
import signal
import threading
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from nvme_swapper import FileIO, arena_device, pinned_bytes

from .. import _checkpoint
from .._cleanup import close_after_failure, note_on, run_all
from .._device import fast_bf16
from .._hooks import Hook, unwrap_compiled, weakly
from .._load import WriteRefused
from .._precision import LossScaler
from ..config import OffloadConfig, flat_fields
from ..dist import Comm, CommError, GradPartition, ReduceBuckets, StartSync, agree_on_settings, agree_with_rank0, join
from ..dist._group import release_store, report_failed_start
from ..memory import CopyStreams, HeapTrim, TieredStore, prepare_nvme_path
from ..ops import squared_norm
from ..optim._layout import FlatLayout
from ..optim._schedule import WarmupSchedule, after_engine_update, build_scheduler
from ..optim.offloaded import OffloadedAdam
from ..plan import ModelSizes, Partition, Plan, resolve
from ._gate import UpdateGate
from ._gathered import Gathered
from ._grads import GradientStream
from ._interrupts import FORCED, HeldInterrupts
from ._model_state import ModelStateHooks
from ._weights import Weights

log = logging.getLogger("offload")


class Phase(Enum):
    """Where the engine is in a training step; every public call checks it."""

    IDLE = "idle"  # no gradients held: before the first backward, or after a step
    BACKWARD = "backward"  # engine.backward is running
    ACCUMULATING = "accumulating"  # gradients of this accumulation window are held; backward or step comes next
    STEP = "step"  # engine.step is running
    FAILED = "failed"  # a backward, step or load raised: state may be half updated; every call but a whole load
    # and close is refused, forwards too (engine(x) and model(x)), until a load_checkpoint succeeds
    CLOSED = "closed"


@dataclass
class TrainingState:
    """Everything a checkpoint holds besides tensors: the contract between the engine and ``_checkpoint``."""

    global_steps: int
    micro_steps: int
    optimizer_steps: int
    loss_scaler: dict[str, Any]
    param_groups: list[dict[str, Any]]
    pending_update: bool  # delayed update: the device holds the previous parameters, the newest wait on the host
    dtype: str = ""
    lr_scheduler: dict[str, Any] | None = None  # the config's scheduler (its state_dict: plain numbers)
    global_samples: int | None = None  # None: global_steps x this engine's train_batch_size()
    extra: dict[str, Any] = field(default_factory=dict)


def _squares(g: torch.Tensor) -> float:
    """The sum of the squares of a gradient buffer: on the host in one native read of it (torch's norm would first
    widen a bf16 buffer into an fp32 copy); on a GPU torch's norm, which widens as it reads."""
    if g.device.type == "cpu":
        return squared_norm(g)
    n = torch.linalg.vector_norm(g, dtype=torch.float32).item()
    if math.isinf(n) and bool(torch.isfinite(g).all()):  # the squares overflowed, not the gradients
        n = torch.linalg.vector_norm(g, dtype=torch.float64).item()
    return n * n


def _held(call: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Runs an engine method with Ctrl-C held off until it returns (see ``_interrupts``); a second Ctrl-C cuts it
    short, and from then on every such method but ``close`` is refused, naming the call cut short."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def held(self: "Engine", *args: Any, **kwargs: Any) -> Any:
            if self._cut_short is not None and call != "engine.close":
                raise self._cut_short_error(call)
            with self._holding(call):
                return method(self, *args, **kwargs)
        return held
    return wrap


class Engine:
    """Returned by :func:`offload.initialize`. See the module docstring."""

    def __init__(self, model: torch.nn.Module, config: OffloadConfig | Mapping[str, Any] | str | Path | None = None,
                 *, param_groups: Iterable[dict[str, Any]] | None = None, _file_io: FileIO | None = None) -> None:
        """``_file_io`` (tests only): the OS-call boundary of the optimizer state's swap engine, to inject faults."""
        try:  # a failure before the ranks' group exists is this rank's word in their start vote (dist/_group.py)
            self.config = cfg = OffloadConfig.load(config)
            self.module = _accepted(model, cfg)  # what hooks, names and checkpoints see
        except BaseException as exc:
            report_failed_start(exc)
            raise
        self._call = model  # what a forward runs: torch.compile(model) stays compiled
        self.phase = Phase.IDLE
        self._failure = ""  # what put the engine in Phase.FAILED
        self._cut_short: str | None = None  # the call a second Ctrl-C cut short: from then on only close() works
        self.global_steps = 0
        self.micro_steps = 0
        self._samples_at = (0, 0)  # (global_steps, global_samples) where a load set them: see global_samples
        self._grad_norm_value: float | torch.Tensor | None = None  # last_grad_norm once known (a tensor: on the GPU)
        self._norm_step: int | None = None  # a step whose norm its updates (still running) are summing
        self._applied = False  # the last step() updated the parameters (was_step_applied)
        self.scaler = LossScaler(cfg.fp16)
        self._hooks: list[Any] = []
        self._forward_holds: list[HeldInterrupts] = []  # Ctrl-C held over the root forwards running (see _hold_forward)
        self._teardown_left: list[Callable[[], object]] | None = None  # close's steps an interrupt cut short
        self._rank_dirs: list[Path] = []
        self._seen_micro: set[int] = set()  # parameters with a gradient in this micro-batch
        self._last_micro = True
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._window_start = (0, 0)  # micro_steps and sub_groups_overlapped when the open window began
        self._backward_done = False  # a backward ran since the last step() (its micro-batch is counted)
        self._refused = False  # the last backward refused its non-finite loss (a step() after it counts the batch)
        self._gathered_open = 0  # engine.gathered() blocks open
        self.lr_scheduler: WarmupSchedule | None = None
        self.store: TieredStore | None = None
        self.copies: CopyStreams | None = None
        self.optimizer: OffloadedAdam | None = None  # type: ignore[assignment]
        self.weights: Weights | None = None
        self.grads: GradientStream | None = None
        self._zero: GradPartition | None = None
        self._reduce: ReduceBuckets | None = None  # stages 1-2 on several ranks
        self._heap: HeapTrim | None = None  # the CPU device's free heap pages returned during backward
        self._gate: UpdateGate | None = None  # plan.overlap_forward: the step's updates finish beside the forward
        self.start_sync: StartSync | None = None  # the parameters and buffers copied from rank 0 at start
        self._stop_reason: str | None = None  # why initialize failed: the other ranks' errors quote it
        try:
            group = join(cfg.offload.comm_timeout, cfg.offload.device)
        except BaseException:
            self.phase = Phase.CLOSED  # (nothing to close: __del__ passes it over)
            raise
        try:
            self.comm = Comm(group)
        except BaseException:
            self.phase = Phase.CLOSED
            group.close()
            raise
        self.world_size = group.world_size
        given = {id(p): (p.dtype, p.device) for p in self.module.parameters()}
        # Ctrl-C held, as over every engine call: a press stops the build between its parts (never inside one,
        # where threads, files or parameters would be half set up), and the cleanup runs whole
        try:
            with self._holding("offload.initialize") as hold:
                def stop_point() -> None:  # between the build's parts: Ctrl-C, or another rank failed to build
                    hold.raise_if_pressed()
                    self.comm.raise_if_stopped()

                self.config = cfg.for_world(group.world_size)  # train_batch_size: the accumulation it implies
                self._build(param_groups, _file_io, stop_point)
                stop_point()
                # no rank leaves before every rank has built: one that failed has closed its group, and the
                # others' barrier fails at once, quoting its error (Comm's diagnosis), not at their first step
                self.comm.barrier()
        except BaseException as exc:
            self.phase = Phase.CLOSED  # (a cleanup cut short is finished at exit, or by the next initialize)
            if not isinstance(exc, CommError):  # (one caused by another rank's failure quotes that one already)
                self._stop_reason = f"offload.initialize raised {type(exc).__name__}: {' '.join(str(exc).split())}"
            with self._holding("offload.initialize (its cleanup)"):
                close_after_failure(self._teardown, exc)
                _note_moved(self.module, given, exc)
            raise
        self._comm_mark = self._comm_totals()
        _unclosed.add(self)
        _take_sigterm()
        self.last_step_comm = {"payload_bytes": 0, "wire_bytes": 0}

    # construction -----------------------------------------------------------------------------------------------

    def _build(self, param_groups: Iterable[dict[str, Any]] | None, file_io: FileIO | None,
               stop_point: Callable[[], None]) -> None:
        cfg, pg = self.config, self.comm.pg
        self.world_size, self.rank = pg.world_size, pg.rank
        # the swap folders first, before any collective: a rank whose nvme_path is unusable fails while the others
        # wait in the first one, which fails at once, quoting its error (they would otherwise build on, for seconds)
        nvme = {name: self._prepare_nvme(name) for name in ("offload_optimizer", "offload_param")}
        groups, options = _param_groups(self.module, param_groups)
        self.start_sync = agree_with_rank0(self.module, self.comm)  # before any rank reads its copy of the model
        trainable = {id(p) for g in groups for p in g}
        sizes = ModelSizes.of([p for g in groups for p in g],
                              [p for p in self.module.parameters() if id(p) not in trainable],
                              list(self.module.buffers()))
        in_ram = sum(p.numel() * p.element_size() for g in groups for p in g
                     if p.device.type == "cpu" and arena_device(p) is None)
        whole = tuple(name or type(m).__name__ for name, m in self.module.named_modules()
                      if isinstance(m, torch.nn.MultiheadAttention))
        self._plan = plan = resolve(cfg, sizes, device=pg.device, world_size=pg.world_size, rank=pg.rank,
                                    local_world_size=pg.local_world_size, model_in_ram=in_ram, fetched_whole=whole)
        self.device, self.dtype, self.stage = plan.device, plan.dtype, plan.stage
        agree_on_settings(_shared_settings(cfg, plan), self.comm)
        _warn_slow_bf16(plan.device, plan.dtype)
        _warn_widened([p for g in groups for p in g], plan.dtype)
        self.store = TieredStore(plan.device, dict(plan.budgets), pin_memory=plan.pin_memory, file_io=file_io)
        for p in {id(p): p for p in self.module.parameters()}.values():  # built in offload.init's arena: its disk
            dev = arena_device(p)  # space comes back as the parameters move to their homes
            if dev is not None:
                self.store.reclaimable[dev] += p.numel() * p.element_size()
        self.copies = CopyStreams(plan.device, self.store.count)
        stop_point()
        self.layout = FlatLayout(groups, plan.sub_group_size, world_size=plan.world_size, rank=plan.rank,
                                 per_param=plan.partition is Partition.PER_PARAM, align=plan.align)
        embeddings = {id(m.weight): m.weight.shape[-1] for m in self.module.modules()
                      if isinstance(m, torch.nn.Embedding)}
        sparse = {i: embeddings[id(p)] for i, p in enumerate(self.layout.params) if id(p) in embeddings} \
            if cfg.sparse_gradients else {}
        self.optimizer = OffloadedAdam(self.layout, self.store, self.copies, cfg.optimizer, plan.optimizer_tier,
                                       group_options=options, nvme_path=nvme["offload_optimizer"],
                                       buffer_count=plan.buffer_count, aio=cfg.aio, grad_dtype=plan.grad_dtype,
                                       grad_sets=2 if plan.delayed else 1, grad_slots=plan.grad_slots,
                                       lazy_rows=sparse if cfg.sparse_gradients == "lazy" else None,
                                       cuda_path=plan.cuda_path, overlap_forward=plan.overlap_forward)
        self.lr_scheduler = build_scheduler(cfg.scheduler, self.optimizer)
        stop_point()
        if plan.trim_heap:
            self._heap = HeapTrim(sizes.numel * plan.dtype_bytes)
        self._zero = GradPartition(self.comm, self.layout)
        # reads each parameter into the optimizer's masters just before it moves it to its home
        self.weights = Weights(plan, self.module, self.layout, self.store, self.copies, self.comm, self.optimizer,
                               aio=cfg.aio, nvme_path=nvme["offload_param"])
        stop_point()
        self.optimizer.fill_masters()
        stop_point()
        self.grads = GradientStream(plan, self.layout, self.store, self.copies, dest=self.optimizer.grads.of,
                                    on_ready=self._sub_group_ready)
        self.optimizer.grad_handles = self.grads.handles
        if plan.world_size > 1 and not self.layout.per_param:
            self._reduce = ReduceBuckets(self.comm, self.layout, self.store, self.copies, bucket=plan.grad_bucket,
                                         dtype=plan.dtype, overlap=cfg.zero_optimization.overlap_comm,
                                         deliver=self.grads.receive, sparse=frozenset(sparse))
        self._install_hooks()
        if plan.overlap_forward:
            self._gate = UpdateGate(self.module, self.layout, self.optimizer, self.copies,
                                    on_error=self._updates_failed)
        # the model still holds the engine's tensors: checked first of all the root's pre-hooks, outside the gate's
        # trace of what each module reads (the check touches every parameter, as a read the trace would record)
        self._hooks.append(self.module.register_forward_pre_hook(Hook(self._check_held),
                                                                 prepend=True))
        # Ctrl-C held over every forward, a plain model(x) too (engine(x) holds it already): first of the root's
        # pre-hooks to last of its hooks, which runs when the forward raises too
        self._hooks.append(self.module.register_forward_pre_hook(Hook(self._hold_forward), prepend=True))
        self._hooks.append(self.module.register_forward_hook(Hook(self._release_forward), always_call=True))

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

    def _install_hooks(self) -> None:
        self._hooks.append(self.module.register_forward_pre_hook(Hook(self._move_inputs), with_kwargs=True,
                                                                 prepend=True))
        for i, p in enumerate(self.layout.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(Hook(self._grad_hook(i))))
        self._hooks.extend(ModelStateHooks(self).handles)  # model.state_dict() / load_state_dict() through here

    def _grad_hook(self, i: int) -> Any:
        on_grad = weakly(self._on_grad)

        def hook(p: torch.Tensor) -> None:
            on_grad(i, p)
        return hook

    def _check_held(self, *_: Any) -> None:
        self.weights.check_held()

    def _updates_failed(self, exc: BaseException) -> None:
        self._fail("engine.step (its updates, finishing beside the next forward)", exc)

    def plan(self) -> Plan:
        """What this engine runs with (device, placements, sizes) and why: ``print(engine.plan().describe())``."""
        return self._plan

    # the training step ------------------------------------------------------------------------------------------

    @_held("the forward")
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    forward = __call__

    def _move_inputs(self, module: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The root module's forward pre-hook: tensors in the inputs go to the device (non-blocking from pinned
        memory), so a batch built on the CPU works unchanged on a GPU."""
        cast = torch.float16 if self.config.fp16.enabled and self.config.fp16.auto_cast else None
        return _to_device(args, self.device, cast), _to_device(kwargs, self.device, cast)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch at hand ends its window, so that the ``step()`` after its backward updates
        (DeepSpeed's meaning, before that backward or after it): every gradient_accumulation_steps micro-batches,
        or as set by :meth:`set_gradient_accumulation_boundary`."""
        if self._boundary is not None:
            return self._boundary
        ahead = 0 if self._backward_done else 1  # before its backward, the micro-batch is not counted yet
        return (self.micro_steps + ahead) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Says, before a micro-batch's backward, whether the step after it updates (True) or accumulates (False),
        overriding the count of gradient_accumulation_steps until set to None: for loops that decide the
        boundary themselves, such as transformers' Trainer with an epoch that is not a multiple of the
        accumulation steps (DeepSpeed's method of the same name)."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ValueError(f"set_gradient_accumulation_boundary expects True, False or None, got {is_boundary!r}")
        if is_boundary is False and self.gradient_accumulation_steps == 1:
            raise ValueError("set_gradient_accumulation_boundary(False) adds the next micro-batch to a window, but "
                             "gradient_accumulation_steps is 1, so the engine was built without room to add "
                             "gradients up; set gradient_accumulation_steps to the longest window you use")
        self._boundary = is_boundary

    @_held("engine.backward")
    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` scaled by the fp16 loss scale and, unless ``scale_wrt_gas`` is False (a loss the
        caller already normalised over the accumulation window), by 1/gradient_accumulation_steps; returns ``loss``
        (as DeepSpeed's does).

        If it raises in a window's first micro-batch before any update started, the window is dropped and the
        engine is idle again; otherwise (earlier micro-batches, or updates already running) it is FAILED until a
        checkpoint is loaded."""
        self._expect_trainable("engine.backward(loss)")
        self._expect("engine.backward(loss)", Phase.IDLE, Phase.ACCUMULATING)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor")
        self._refused = False
        self._check_finite(loss)
        self.weights.check_trainable()
        self._settle()  # parameters no forward hook reached, and the gradient slots the updates read
        gas = self.gradient_accumulation_steps
        self._last_micro = self._boundary if self._boundary is not None else self.micro_steps % gas == gas - 1
        divisor = gas if scale_wrt_gas else 1
        first, queued = self.phase is Phase.IDLE, self.optimizer.sub_groups_overlapped
        if first:
            self._window_start = (self.micro_steps, queued)
        self.phase = Phase.BACKWARD
        self.optimizer.begin_backward()
        self.grads.begin_micro_batch()
        if self._reduce is not None:
            self._reduce.begin_micro_batch()
        self._seen_micro.clear()
        if self._heap is not None:
            self._heap.begin_backward()
        if self.weights.params is not None:
            self.weights.params.begin_backward(step_follows=self._last_micro)
        # a reentrant activation checkpoint re-runs forwards inside backward: what they save of a parameter is a
        # reference too, fetched again if the window evicted the parameter before the inner backward reads it
        recompute = self.weights.params.saved_tensors() if self.weights.params is not None else \
            contextlib.nullcontext()
        try:
            with recompute:
                (loss.float() * (self.scaler.scale / divisor)).backward()
            if self._reduce is not None:
                self._reduce.end_backward()  # the last buckets reach their owners
            self.grads.end_backward()
        except BaseException as exc:
            self._fail("engine.backward", exc)
            raise
        finally:
            self.optimizer.end_backward()
            if self.weights.params is not None:
                self.weights.params.end_backward(step_follows=self._last_micro)
            if self.phase is Phase.FAILED and first and self.optimizer.sub_groups_overlapped == queued and \
                    self._cut_short is None:
                self._discard_window()  # nothing was updated and no earlier micro-batch is lost: start afresh
                self.phase = Phase.IDLE
        self.phase = Phase.ACCUMULATING
        self.micro_steps += 1
        self._backward_done = True
        return loss

    @_held("engine.zero_grad")
    def zero_grad(self) -> None:
        """Drops the gradients of an unfinished accumulation window (a loop interrupted between backward and
        step), as ``model.zero_grad()`` does for a plain model, so the next window starts afresh; nothing to do
        after a step. Refused once the window's updates have started (its last micro-batch's backward starts them
        unless clipping or fp16 must see every gradient first): ``step()`` finishes them."""
        self._expect("engine.zero_grad()", Phase.IDLE, Phase.ACCUMULATING)
        if self.phase is Phase.IDLE:
            return
        if self._window_updates_started():
            raise RuntimeError("engine.zero_grad(): this window's updates have started (its last micro-batch's "
                               "backward ran them beside backward), so its gradients are partly applied; call "
                               "engine.step() to finish the step, or load a checkpoint")
        self._discard_window()
        self.micro_steps, self._backward_done, self._refused = self._window_start[0], False, False
        self.phase = Phase.IDLE

    def _window_updates_started(self) -> bool:
        """The open window's last backward has started its updates (they run beside backward): its gradients are
        partly applied, and dropping the window would leave Adam's state holding a step that never completes."""
        return self.optimizer.sub_groups_overlapped != self._window_start[1]

    def _refuse_writes_over_started_updates(self, what: str, trainable: bool) -> None:
        """Weights of ``trainable`` parameters written once the window's updates have started would be overwritten
        by them, all or some (as each sub-group's update ends), so the step would be lost where torch applies it
        to the weights written (a frozen parameter's write stands)."""
        if trainable and self.phase is Phase.ACCUMULATING and self._window_updates_started():
            raise WriteRefused(f"{what} between the backward that started this window's updates (they run beside "
                               "backward) and engine.step(): the updates would overwrite the weights written; call "
                               "engine.step() first, or write them before that backward")

    def _check_finite(self, loss: torch.Tensor) -> None:
        """bf16/fp32: a non-finite loss would make every gradient NaN and Adam would write NaN into the masters and
        moments; refused before its backward runs, so nothing changes (fp16 leaves it to the loss scaler, which
        skips the step). With several ranks every rank refuses together (a MIN over ranks), so none is left in a
        backward's collectives alone. Costs one host wait for the forward's result before backward is launched.
        Stage 3 on several ranks (fp16 too): the same all-reduce compares the parameters each rank used, gathered
        and reduced since the last backward (``Comm.trace``), as ranks that ran different modules of the same
        shapes computed with each other's pieces of different parameters, without any error."""
        fp16, traced = self.config.fp16.enabled, self.world_size > 1 and self.layout.per_param
        if fp16 and not traced:
            return
        if not traced:
            flag = torch.isfinite(loss.detach()).reshape(1).to(self.comm.pg.device, torch.int32)
            if self.world_size > 1:
                self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            finite = int(flag.item())
        else:
            (finite,), same = self.comm.min_and_trace([1 if fp16 else int(bool(torch.isfinite(loss.detach())))])
            if not same:
                raise RuntimeError(
                    f"engine.backward at micro-batch {self.micro_steps} (step {self.global_steps}): the ranks "
                    "used different parameters since the last backward (stage 3 on several ranks: a module "
                    "run on some ranks only, such as an MoE expert the router chose on one rank, or a branch taken "
                    "on one), so each computed with another parameter's pieces; this backward was not run and "
                    "nothing changed. Under stage 3 every rank must run the same modules in the same order: call "
                    "each expert on every rank, in one order (an empty batch will do), or train with stage 1 or 2")
        if finite:
            return
        self._refused = True
        value = loss.item()
        where = f"the loss is {value}" if not math.isfinite(value) else \
            "the loss is finite here but not on another rank"
        cause = (" With parameters offloaded, a parameter read outside any forward of the model (or, in a later "
                 "forward, on a path the first forwards did not take) holds NaN there (released, it is a "
                 "placeholder): run that code inside `with engine.gathered(param):`, or declare the read with "
                 "engine.register_external_parameter(module, param) for the module whose forward makes it.") \
            if self.weights.params is not None else ""
        raise FloatingPointError(
            f"{where} at micro-batch {self.micro_steps} (step {self.global_steps}): its backward would train NaN into "
            "the optimizer state, so it was not run and nothing changed (earlier micro-batches of the window keep "
            "their gradients: catch the error to skip this batch, on every rank; a step() after it counts the "
            "batch, with no gradient, as DeepSpeed counts micro-batches by step()). Check the data (a batch whose "
            "labels are all ignored gives 0/0) and the learning rate." + cause)

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s gradient is final: to its owner's host buffer (through a reduce bucket with stages
        1-2 on several ranks), then freed."""
        grad = p.grad
        assert grad is not None
        if self.phase is not Phase.BACKWARD:
            p.grad = None  # the next engine.backward must not add to it
            raise RuntimeError("a gradient arrived outside engine.backward(loss): call engine.backward(loss) "
                               "instead of loss.backward() (it scales the loss for accumulation and fp16, and "
                               "hands each gradient to the offloaded optimizer as backward produces it)")
        if i in self._seen_micro:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(p.shape)}) got its gradient twice in one backward: reentrant "
                "activation checkpointing over a parameter also used outside the checkpointed segment; use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
        grad = grad.detach()
        if self.weights.params is not None:  # before the update can start: a parameter set to land is marked so
            self.weights.params.grad_done(p)
        if self._reduce is not None:  # several ranks, stages 0-2: summed onto the owners bucket by bucket
            self._reduce.add(i, grad)
        else:
            flat = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)  # nn.Embedding(sparse=True)
            if self.layout.per_param:  # stage 3 on several ranks: summed over ranks now, this rank's piece kept
                self.grads.receive(i, self._zero.reduce_param(i, flat), base=self.rank * self.layout.piece[i])
            else:
                self.grads.receive(i, flat)
        self._seen_micro.add(i)
        if self._heap is not None:
            self._heap.add(grad.numel() * grad.element_size())
        p.grad = None  # the device copy is no longer needed (a copy in flight holds it until it has run)

    def _sub_group_ready(self, k: int) -> None:
        """Every gradient of sub-group ``k`` has been sent in this micro-batch: start its update now if allowed."""
        if self._plan.overlap and self._last_micro and self.phase is Phase.BACKWARD:
            self.optimizer.submit(k)

    @_held("engine.step")
    def step(self) -> None:
        """At an accumulation boundary: overflow check, clipping, the optimizer step; a no-op between micro-batches.
        Gradients are consumed (the next backward starts from zero)."""
        self._applied = False  # first: a step() that raises, in its checks too, applied nothing (DeepSpeed's too)
        self._expect_trainable("engine.step()")
        if self._gathered_open:
            raise RuntimeError("engine.step() inside an engine.gathered() block: the update would change the "
                               "parameters the block holds; step after the block")
        if self._refused and not self._backward_done:  # the loop stepped past a refused batch: it counts, with
            self._expect("engine.step()", Phase.IDLE, Phase.ACCUMULATING)  # no gradient, so the windows keep
            self.micro_steps, self._backward_done = self.micro_steps + 1, True  # ending every gas step()s
        elif self.phase is Phase.IDLE:
            raise RuntimeError("engine.step() called before engine.backward(loss)" if self.micro_steps == 0 else
                               "engine.step() called twice without an engine.backward(loss) in between")
        else:
            self._expect("engine.step()", Phase.ACCUMULATING)
        self._refused = False
        boundary = self.is_gradient_accumulation_boundary()
        self._backward_done = False
        if not boundary:
            return
        if self.phase is Phase.IDLE:  # a window of refused batches only: nothing to update, a skipped step
            self.global_steps += 1
            self.scaler.update(True)
            return
        self.phase = Phase.STEP
        try:
            self._step()
        except FloatingPointError:  # raised before any update: the window's gradients are dropped, state is intact
            self.phase = Phase.IDLE
            raise
        except BaseException as exc:
            self._fail("engine.step", exc)
            raise
        else:
            self.phase = Phase.IDLE
        finally:
            self.grads.new_window()
            totals = self._comm_totals()
            self.last_step_comm = {k: totals[k] - self._comm_mark[k] for k in totals}
            self._comm_mark = totals

    def _step(self) -> None:
        plan, opt = self._plan, self.optimizer
        uploads: list[Any] = []
        self.grads.wait()  # every gradient of the window has landed (and an error of its thread surfaces here)
        if plan.delayed:
            opt.finish()  # the previous step's update, which ran beside this forward/backward
            uploads = self.weights.apply_update(self._zero)
        grad_scale = self.scaler.scale * self.world_size  # the kernel divides: the mean over ranks
        self._norm_step = None
        # the norm before any update: fp16's overflow check and clipping need it; a delayed update on several ranks
        # would have it only inside the next step's collectives. Otherwise the updates sum it as they run.
        before = self.config.fp16.enabled or self.config.gradient_clipping > 0 or (
            plan.delayed and self.world_size > 1)
        if before:
            opt.wait()
            norm = self._grad_norm()
            if not math.isfinite(norm):
                self._grad_norm_value = norm
                if self.config.fp16.enabled:
                    opt.skip()
                    self.global_steps += 1  # as DeepSpeed (and the Trainer) count a skipped step: see skipped_steps
                    self._grad_norm_value = math.inf  # DeepSpeed's norm of an overflowed step
                    self.scaler.update(True)  # last: at the scale's floor it raises, the step skipped
                    return
                if self.config.gradient_clipping > 0:  # else (a delayed update on several ranks) as the updates would
                    raise FloatingPointError(f"gradient norm is {norm} at step {self.global_steps}: the loss or "
                                             "the model produced inf/NaN")
            norm /= grad_scale
            self._grad_norm_value = norm
            clip = self.config.gradient_clipping
            if clip > 0:
                coef = clip / (norm + 1e-6)
                if coef < 1.0:
                    grad_scale /= coef
        if plan.delayed:
            opt.launch(grad_scale, wait_first=tuple(uploads))  # runs beside the next forward/backward
            opt.grads.swap()
            self.weights.pending = True
        elif self._gate is not None:
            opt.launch(grad_scale)  # the next forward waits for each sub-group as it reaches it
            self._gate.arm()
        else:
            opt.step(grad_scale=grad_scale)
        if not before:
            self._norm_step, self._grad_norm_value = opt.step_count, None
            if self.world_size > 1:  # the updates are done (they end inside the step there): reduced on every rank
                self._take_norm()
        if self._gate is None:
            self.weights.after_step(self._zero)
        if self.config.fp16.enabled:
            self.scaler.update(False)
        if self.lr_scheduler is not None:  # the next update's lr (the one launched above took its own already)
            with after_engine_update():
                self.lr_scheduler.step()
        self.global_steps += 1
        self._applied = True

    @property
    def skipped_steps(self) -> int:
        """DeepSpeed's: the steps fp16's loss scaler skipped on overflow (``global_steps`` counts them too)."""
        return self.scaler.skipped

    def was_step_applied(self) -> bool:
        """DeepSpeed's: whether the last ``step()`` updated the parameters (False between accumulation boundaries,
        for a step fp16's loss scaler skipped on overflow, and for one that raised). With the updates finishing
        beside the next forward, "updated" means launched: they are in before any module reads them."""
        return self._applied

    def get_lr(self) -> list[float]:
        """DeepSpeed's: each param group's learning rate, as the next update will take it (after the config's
        scheduler or the caller's has stepped)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    # DeepSpeed's accessors, for scripts that call them --------------------------------------------------------

    def get_mom(self) -> list[tuple[float, float]]:
        """DeepSpeed's: each param group's Adam betas."""
        return [tuple(group["betas"]) for group in self.optimizer.param_groups]

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks: micro-batch x accumulation steps x world size."""
        return self.config.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.world_size

    @property
    def global_samples(self) -> int:
        """Samples trained on over all ranks: train_batch_size() a step, from the count a checkpoint restored (a run
        resumed under another batch size counts on from where it was, as DeepSpeed's does)."""
        steps, samples = self._samples_at
        return samples + (self.global_steps - steps) * self.train_batch_size()

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.stage

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @property
    def local_rank(self) -> int:
        return self.comm.pg.local_rank

    def __iter__(self) -> Any:
        raise TypeError("offload.initialize returns the engine alone, not DeepSpeed's (engine, optimizer, "
                        "dataloader, lr_scheduler): write `engine = offload.initialize(model, config)`; the others "
                        "are engine.optimizer, your own DataLoader and engine.lr_scheduler")

    def _comm_totals(self) -> dict[str, int]:
        return {"payload_bytes": sum(self.comm.payload_bytes.values()),
                "wire_bytes": sum(self.comm.wire_bytes.values())}

    @_held("engine.finish_step")
    def finish_step(self) -> None:
        """Waits until the last step's update is in every parameter. ``step()`` returns before (the next forward
        waits for each parameter as it reaches it: ``plan().overlap_forward``), so call this to read parameters
        directly in between, as an EMA of the weights does; the engine's own calls and ``state_dict()`` do it
        themselves."""
        self._check_open()
        self._settle()

    def _settle(self) -> None:
        if self._gate is not None:
            self._gate.settle()

    def _finish_updates(self) -> None:
        """Every update queued or running is done: the last step's (``_settle``) and those queued during a
        backward before its ``step()``. An error of one leaves the engine FAILED: its sub-group is not updated."""
        self._settle()
        try:
            self.optimizer.wait()
        except BaseException as exc:
            self._fail("engine.backward (its updates, run during backward)", exc)
            raise
        self.copies.use_uploads()  # on a GPU their new values may still be on the way to the device

    def _parameters_current(self) -> None:
        """Every value the engine has computed is in the parameters: the updates queued or running, and a delayed
        update's (``engine.gathered`` and code that reads parameters between steps)."""
        self._finish_updates()
        if self._plan.delayed:
            self.apply_delayed_update()

    @_held("engine.apply_delayed_update")
    def apply_delayed_update(self) -> None:
        """Delayed update: waits for the update in flight and puts its parameters on the device now (``step``
        does this itself; call it to see the newest parameters before the next step)."""
        self._check_open()
        self.optimizer.finish()
        for copy in self.weights.apply_update(self._zero):
            copy.wait()

    @property
    def last_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's gradients (unscaled, before clipping; inf or nan where they
        overflowed), the same on every rank; None before the first step. Without clipping or fp16 the updates sum
        it as they run (the CPU Adam kernel squares each gradient it reads), so where ``step()`` returns before its
        updates end (``plan().overlap_forward``, the delayed update) reading it waits for them: read it when you log,
        not every step."""
        if self._norm_step is not None:
            # a failed or closed engine does not wait (its updates may never end): what they summed, if whole
            if self.phase not in (Phase.FAILED, Phase.CLOSED) and not self.optimizer.squares_ready(self._norm_step):
                self._finish_updates()
            self._take_norm()
        if isinstance(self._grad_norm_value, torch.Tensor):  # the state is on the GPU: read it now, once
            self._grad_norm_value = float(self._grad_norm_value)
        return self._grad_norm_value

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's name for :attr:`last_grad_norm`."""
        return self.last_grad_norm

    def _take_norm(self) -> None:
        """The norm of step ``_norm_step`` from what its updates summed, all-reduced over ranks (every rank is
        here: at the end of a step whose updates ran inside it); None if some update of it never ran. One rank
        takes it when it is read, so a step never waits for the device for it."""
        squares = self.optimizer.grad_squares(self._norm_step)
        if isinstance(squares, torch.Tensor):  # on the GPU: all-reduced and rooted there, read on demand
            if self.world_size > 1:
                squares = squares.reshape(1)
                self.comm.all_reduce(squares)
            self._grad_norm_value = squares.reshape(()).sqrt()
        else:
            if self.world_size > 1:
                assert squares is not None, "with several ranks a step's updates end inside it"
                squares = self.comm.sum_float(squares)
            self._grad_norm_value = None if squares is None else math.sqrt(squares)
        self._norm_step = None  # last: a read cut short (an interrupt in the all-reduce) takes it again

    def _grad_norm(self) -> float:
        """The global norm: of this rank's share here, summed in squares over ranks (the same on every rank, so
        all skip an overflowing fp16 step together)."""
        whole = self.optimizer.grads.whole
        assert whole is not None, "the gradient norm needs every gradient: the plan holds them whole"
        return math.sqrt(self.comm.sum_float(math.fsum(_squares(g) for g in whole)))

    # parameters -------------------------------------------------------------------------------------------------

    def register_external_parameter(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """With parameter offload, a parameter is on the device while its own module runs; declare here one that
        ``module`` reads directly although another module owns it. Without parameter offload it matters only
        while the step's updates finish beside the next forward, for a read the first forward's trace missed."""
        self.weights.register_external(module, param)
        if self._gate is not None:
            self._gate.register_external(module, param)

    @contextlib.contextmanager
    def gathered(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter] | None = None) -> Iterator[None]:
        """For the block, ``params`` (default: all the model's) are whole on the device, for code that uses them
        outside the forwards of their modules: a loss that multiplies by the output embedding itself, a generation
        loop, an initialisation or a norm you log. What autograd saves of them in the block is fetched again by
        backward, inside the block or after it. What the block writes into them is kept: their new values become
        their fp32 masters and homes at its end. ``engine.step()`` belongs after the block. With several ranks a
        collective (every rank passes the same parameters), and rank 0's changes are kept. DeepSpeed's
        ``zero.GatheredParameters``; see ``engine/_gathered.py``."""
        self._expect("engine.gathered()", Phase.IDLE, Phase.ACCUMULATING)
        given = [params] if isinstance(params, torch.Tensor) else list(self.module.parameters() if params is None
                                                                        else params)
        owned = {id(p) for p in self.module.parameters()}
        strays = [i for i, p in enumerate(given) if id(p) not in owned]
        if strays:
            raise ValueError(f"engine.gathered: entry {strays[0]} of params is not a parameter of the engine's model")
        self._parameters_current()  # the values the block reads are the newest
        block = Gathered(self, list({id(p): p for p in given}.values()))
        with self._holding("engine.gathered"):  # the block's own code is the user's: Ctrl-C lands there at once
            block.enter()
        self._gathered_open += 1
        try:
            yield
        finally:
            self._gathered_open -= 1
            with self._holding("engine.gathered"):
                block.exit()

    @_held("engine.read_parameter")
    def read_parameter(self, p: torch.nn.Parameter) -> torch.Tensor:
        """A parameter's current low-precision value as a host tensor, wherever it lives."""
        self._finish_updates()
        return self.weights.read(p)

    @_held("engine.write_parameter")
    def write_parameter(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Sets a parameter's low-precision value wherever it lives (rounded to its dtype)."""
        self._finish_updates()
        self.weights.write(p, value)

    # state ------------------------------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, dict[str, int | None]]:
        """This rank's bytes per tier: current, peak and budget (None: unlimited), and of them the optimizer
        state (``optimizer_state``: this rank's share; ``optimizer_state_all_ranks``: the whole model's, padding
        included). With N ranks each holds 1/N of the state, gradients and (stage 3) parameters. ``host`` also
        says how many bytes are page-locked for CUDA (``pinned``: exactly what was asked, rounded to pages)."""
        report = self.store.memory_report()
        mine = sum(12 * sg.numel for sg in self.layout.sub_groups)
        total = 12 * sum(self.layout.group_numel)
        for tier, r in report.items():
            on_tier = tier == self.optimizer.placement.value
            r["optimizer_state"] = mine if on_tier else 0
            r["optimizer_state_all_ranks"] = total if on_tier else 0
        report["host"]["pinned"] = pinned_bytes()
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
            # plan.overlap_forward: steps whose updates finished beside the next forward, and the time readers
            # (forward hooks, backward, checkpoints) waited for them
            "update_beside_forward": self._gate.stats() if self._gate is not None else None,
            "gradient_copies": dict(self.grads.sends),
            "gradient_buffers": opt.grads.stats(),
            "nvme": self.store.swap_stats(),
            "params": self.weights.stats(),
            "reduce": self._reduce.stats() if self._reduce is not None else None,  # stages 1-2 on several ranks
            "heap_trims": self._heap.stats() if self._heap is not None else None,  # CPU device only
            # collectives (none with one rank): totals since initialize, and the last optimizer step's (the
            # reduce-scatters of its micro-batches included); payload: the ZeRO paper's measure, wire: ring sends
            "comm": {**self.comm.stats(), "last_step": dict(self.last_step_comm)},
            # parameters and buffers compared across ranks at initialize, and those copied from rank 0
            "start_sync": asdict(self.start_sync) if self.start_sync is not None else None,
        }

    def training_state(self) -> TrainingState:
        """The counters and settings a checkpoint stores beside the tensors."""
        self._settle()
        opt = self.optimizer
        return TrainingState(self.global_steps, self.micro_steps, opt.step_count, self.scaler.state_dict(),
                             [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                             self.weights.pending, str(self.dtype),
                             self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                             self.global_samples)

    @_held("engine.load_training_state")
    def load_training_state(self, state: TrainingState) -> None:
        self.global_steps, self.micro_steps = state.global_steps, state.micro_steps
        samples = self.global_steps * self.train_batch_size() if state.global_samples is None else state.global_samples
        self._samples_at = (self.global_steps, samples)
        self._backward_done = self._refused = False
        self.optimizer.restart_at(state.optimizer_steps)
        self._norm_step = self._grad_norm_value = None  # the norm of a step the checkpoint does not hold
        self.scaler.load_state_dict(state.loss_scaler)
        for group, saved in zip(self.optimizer.param_groups, state.param_groups):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self.weights.pending = state.pending_update and self._plan.delayed
        if self.lr_scheduler is not None and state.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state.lr_scheduler)

    @_held("engine.load_state_dict")
    def load_state_dict(self, source: str | Path | Mapping[str, torch.Tensor], *, strict: bool = True) -> Any:
        """Loads model weights (a safetensors file, a sharded checkpoint folder or index, a torch file, or a dict)
        tensor by tensor into the fp32 master weights and each parameter's home; Adam's moments and the counters
        stay. Returns what did not match (``missing``, ``unexpected``); ``strict`` makes either an error."""
        self._expect("engine.load_state_dict()", Phase.IDLE, Phase.ACCUMULATING)
        self._parameters_current()  # a pending delayed update would overwrite the loaded values at the next step
        from .._load import load_into_engine

        return load_into_engine(self, source, strict)

    @_held("engine.consolidated_state_dict")
    def consolidated_state_dict(self, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The model state as plain CPU tensors: fp32 master weights for trainable parameters. ``keys``: only
        those entries of ``module.state_dict()`` (a LoRA adapter's, say), read from the sub-groups holding them.
        Collective with several ranks (every rank passes the same keys)."""
        self._expect("engine.consolidated_state_dict()", Phase.IDLE, Phase.ACCUMULATING)
        self._finish_updates()
        if keys is None:
            return _checkpoint.consolidated_state_dict(self)
        return _checkpoint.engine_tensors(self, list(keys))

    @_held("engine.save_safetensors")
    def save_safetensors(self, path: str | Path, *, max_shard_size: int | str = "5GB") -> list[Path]:
        """Writes the model (fp32 master weights) into the folder ``path`` as ``model.safetensors``, or as shards of
        at most ``max_shard_size`` with ``model.safetensors.index.json``: what ``from_pretrained`` and
        :func:`offload.load_state_dict` read. One shard is in memory at a time. Collective with several ranks
        (rank 0 writes). Returns the files written."""
        self._expect("engine.save_safetensors()", Phase.IDLE, Phase.ACCUMULATING)
        self._finish_updates()
        from .._export import save_engine

        return save_engine(self, path, max_shard_size)

    @_held("engine.save_16bit_model")
    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> Path:
        """DeepSpeed's: the model in the training dtype in one file, ``save_dir/save_filename`` (a torch state
        dict; safetensors for a ``.safetensors`` name), built in RAM on rank 0 as DeepSpeed builds it; returns
        the file (DeepSpeed returns True; a path is true too). With the delayed update it holds the newest
        weights, which the device gets at the next step. ``save_safetensors`` writes the fp32 masters in shards,
        one in RAM at a time. Collective with several ranks."""
        if not save_filename or os.sep in save_filename or save_filename in (".", ".."):
            raise ValueError(f"engine.save_16bit_model: save_filename must be a file name inside save_dir, got "
                             f"{save_filename!r} (put folders in save_dir)")
        self._expect("engine.save_16bit_model()", Phase.IDLE, Phase.ACCUMULATING)
        self._finish_updates()
        from .._export import save_16bit

        return save_16bit(self, save_dir, save_filename, exclude_frozen_parameters)

    @_held("engine.save_checkpoint")
    def save_checkpoint(self, path: str | Path, tag: str | int | None = None, client_state: dict | None = None, *,
                        exclude_frozen_parameters: bool = False) -> Path:
        """Writes model, optimizer state (wherever it lives), loss scaler and counters under ``path/tag`` and then
        points ``path/latest`` at it; a crash mid-save leaves the previous checkpoint loadable; returns that folder.
        ``client_state`` (DeepSpeed's): a dict of the loop's own (epoch, data position), rank 0's saved beside it
        and given back by load_checkpoint; tensors, numbers, strings and containers of them (never unpickled).
        ``exclude_frozen_parameters`` (DeepSpeed's name): leaves the parameters that do not train out (a LoRA run's
        base model, which the training script builds again); loading it keeps the model's own."""
        self._expect("engine.save_checkpoint()", Phase.IDLE, Phase.ACCUMULATING)
        if self.phase is Phase.ACCUMULATING:  # a checkpoint holds no gradients: a resume would lose these
            gas = self.gradient_accumulation_steps
            raise RuntimeError(
                f"engine.save_checkpoint() with the gradients of an unfinished accumulation window held (after "
                f"micro-batch {self.micro_steps % gas or gas} of {gas}, or a backward not yet stepped): a checkpoint "
                "holds no gradients, so a resume would lose them. Save after the engine.step() that ends the window")
        self._finish_updates()
        return _checkpoint.save(self, Path(path), f"step{self.global_steps}" if tag is None else str(tag),
                                frozen=not exclude_frozen_parameters, client_state=client_state)

    @_held("engine.load_checkpoint")
    def load_checkpoint(self, path: str | Path, tag: str | int | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Path, dict[str, Any]]:
        """Restores a checkpoint written by save_checkpoint (``latest`` unless ``tag``); returns, as DeepSpeed's,
        the folder it loaded and the client_state saved with it ({} if none). DeepSpeed's partial loads (a run
        fine-tuned from another's checkpoint): ``load_optimizer_states=False`` loads the weights and the step
        counters, keeping this engine's Adam moments, optimizer step count, hyperparameters and loss scale;
        ``load_lr_scheduler_states=False`` keeps its LR schedule; ``load_module_only`` loads the weights alone."""
        if not load_module_strict:
            raise ValueError("engine.load_checkpoint(load_module_strict=False): a checkpoint of this engine loads "
                             "whole; for the weights of another model, export it (python -m offload export CKPT "
                             "OUT) and load what matches with engine.load_state_dict(OUT, strict=False)")
        if custom_load_fn is not None:
            raise ValueError("engine.load_checkpoint(custom_load_fn=...): DeepSpeed's hook for its own module "
                             "format; here load the weights with engine.load_state_dict(source) after the load")
        self._expect("engine.load_checkpoint()", Phase.IDLE, Phase.ACCUMULATING, Phase.FAILED)
        partial = "load_module_only=True" if load_module_only else \
            "load_optimizer_states=False" if not load_optimizer_states else None
        if partial and self.phase is Phase.FAILED:
            raise RuntimeError(f"engine.load_checkpoint({partial}) after a failed step ({self._failure}) would keep "
                               "the Adam state that step half updated: load a checkpoint whole first (this run's "
                               "last one), then the weights of the other")
        if partial and self.phase is Phase.ACCUMULATING and self._window_updates_started():
            raise RuntimeError(f"engine.load_checkpoint({partial}): this window's updates have started (its last "
                               "micro-batch's backward ran them), so the Adam state it would keep holds a step "
                               "that never completes; call engine.step() first, or load the checkpoint whole")
        window = self._window_start[0] if self.phase is Phase.ACCUMULATING else None
        try:
            self._settle()
        except Exception as exc:  # noqa: BLE001 - the engine is FAILED now, which a load is for
            log.warning("offload: loading a checkpoint over a failed step (%s: %s)", type(exc).__name__, exc)
        writing = []

        def before_write() -> None:  # the checkpoint matches the model: from here a failure leaves a half load
            self._discard_window()
            writing.append(True)

        try:
            loaded = _checkpoint.load(self, Path(path), None if tag is None else str(tag), before_write,
                                      optimizer=load_optimizer_states and not load_module_only,
                                      counters=not load_module_only,
                                      scheduler=load_lr_scheduler_states and not load_module_only)
        except BaseException as exc:
            if writing:
                self._fail("engine.load_checkpoint", exc)
            raise
        if load_module_only and window is not None:  # the counters stay: the dropped window's micro-batches go
            self.micro_steps = window
        self.phase = Phase.IDLE
        return loaded

    def _discard_window(self) -> None:
        """Before a load replaces the state: drops what the accumulation window held, or what a backward or step
        that failed left behind (updates queued, gradients half sent, the error they already raised)."""
        for _ in range(3):  # a pending error of the stepper first, then the write-backs its failure left
            try:
                self.optimizer.finish()
                self.grads.wait()
                break
            except Exception as exc:  # noqa: BLE001 - raised once already; the load overwrites what it touched
                log.warning("offload: loading a checkpoint over a failed step (%s: %s)", type(exc).__name__, exc)
        self.optimizer.skip()
        self.optimizer.grads.drop()
        self.grads.new_window()
        self.grads.begin_micro_batch()
        for p in self.layout.params:  # an interrupted backward leaves some: the next would add to them
            p.grad = None

    # lifetime ---------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.phase is Phase.CLOSED:
            raise RuntimeError("the engine is closed")

    def _holding(self, call: str) -> HeldInterrupts:
        """Ctrl-C held off for ``call`` (see ``_held``), for code that runs an engine call's work itself."""
        return HeldInterrupts(lambda: self._interrupted(call))

    def _hold_forward(self, *_: Any) -> None:
        """The root's first forward pre-hook: Ctrl-C held until its last forward hook (``_release_forward``), so that
        a plain ``model(x)`` fetches and places parameters as whole as ``engine(x)`` does."""
        if self._cut_short is not None:
            raise self._cut_short_error("the forward")
        hold = self._holding("the forward")
        hold.__enter__()
        self._forward_holds.append(hold)
        if self.phase is Phase.FAILED:  # (after the hold: the always-called last hook releases it)
            raise self._failed_error("the forward")

    def _release_forward(self, *_: Any) -> None:
        """The root's last forward hook, run when the forward raised too: a Ctrl-C held over it lands now. (A second
        Ctrl-C leaves the forward without it: that hold's recorder has already given SIGINT back.)"""
        if self._forward_holds:
            self._forward_holds.pop().__exit__(None, None, None)

    def _interrupted(self, call: str) -> None:
        """A second Ctrl-C cut ``call`` short (see ``_held``). Not only the training state may be half changed but
        the engine's own records (which buffer holds which parameter, which transfer is in flight), which a load
        does not rebuild: only ``close()`` is allowed from here, and a new engine loads the checkpoint."""
        if self.phase is not Phase.CLOSED:
            self._fail(call, KeyboardInterrupt(FORCED))
            self._cut_short = call

    def _cut_short_error(self, call: str) -> RuntimeError:
        return RuntimeError(f"{call}: a second Ctrl-C cut {self._cut_short} short, which may have left the engine's "
                            "own records (which buffer holds which parameter, which transfers are in flight) half "
                            "changed, so it cannot go on: close() it (again, if that close is cut short too) and "
                            "build a new engine, whose load_checkpoint restores a saved state")

    def _fail(self, call: str, exc: BaseException) -> None:
        self.phase = Phase.FAILED  # the last step's norm stays readable where its updates all ran (last_grad_norm)
        if self._cut_short is None:  # (what follows a cut-short call, e.g. a hook that finds the phase changed)
            self._failure = f"{call} raised {type(exc).__name__}: {exc}"

    def _expect_trainable(self, call: str) -> None:
        if not self.layout.params:
            raise RuntimeError(f"{call}: this engine trains nothing (no parameter of the model had "
                               "requires_grad=True at offload.initialize): it runs forwards only, as a reference or "
                               "teacher model does. Compute its outputs under torch.no_grad() and call backward and "
                               "step on the engine of the model you train; to train this model, set requires_grad "
                               "on the parameters to train before offload.initialize")

    def _expect(self, call: str, *allowed: Phase) -> None:
        self._check_open()
        if self._cut_short is not None:
            raise self._cut_short_error(call)
        if self.phase is Phase.FAILED and Phase.FAILED not in allowed:
            raise self._failed_error(call)
        if self.phase not in allowed:
            raise RuntimeError(f"{call} called while the engine is in phase {self.phase.value!r} (allowed: "
                               f"{', '.join(p.value for p in allowed)}); calls from hooks or other threads during "
                               "a step are not supported")

    def _failed_error(self, call: str) -> RuntimeError:
        return RuntimeError(f"{call}: {self._failure}, which may have left gradients, parameters or optimizer "
                            "state half updated; load a checkpoint (engine.load_checkpoint: one that succeeds ends "
                            "this) or close the engine")

    @_held("engine.close")
    def close(self) -> None:
        """Joins the optimizer thread, closes the swap engines (removing their files) and frees the tiers' buffers.
        The model keeps working with its current parameters. A close cut short (a second Ctrl-C) is finished by
        the next call, or at exit."""
        if self.phase is Phase.CLOSED:
            if self._teardown_left is None or self._teardown_left:  # cut short before its steps, or in them
                self._teardown()
            return
        try:
            if self._cut_short is None:  # (else the records the updates would go by may be half changed)
                failed = self.phase is Phase.FAILED
                try:
                    self._settle()
                    self.optimizer.finish()
                    if self._norm_step is not None:  # readable after close
                        self._take_norm()
                except Exception:  # noqa: BLE001 - a failed step's error, raised already
                    if not failed:
                        raise
                for copy in self.weights.apply_update(self._zero):  # the model keeps every update it was given
                    copy.wait()
        finally:
            self.phase = Phase.CLOSED
            try:
                self._teardown()
            except Exception as exc:
                if self._cut_short is not None:
                    note_on(exc, f"(a second Ctrl-C had cut {self._cut_short} short, so the model's parameters may "
                                 "not all be handed back: load them from a checkpoint)")
                raise

    def _teardown(self) -> None:
        """Stops and frees whatever was built, in reverse order; safe on a half-built engine. Steps an interrupt
        cut short are kept in ``_teardown_left`` (and the engine among those closed at exit) to run again."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        sync = self.copies.synchronize if self.copies is not None else None
        steps = self._teardown_left if self._teardown_left is not None else [
            self._gate.close if self._gate is not None else None,
            sync,  # no copy may still touch the buffers freed below
            self.grads.close if self.grads is not None else None,
            self.optimizer.wait if self.optimizer is not None else None,
            self.weights.close if self.weights is not None else None,  # the model gets its parameters back
            self.optimizer.close if self.optimizer is not None else None,
            self._reduce.close if self._reduce is not None else None,
            sync,
            self.store.close if self.store is not None else None,
            self._close_comm,
        ]
        self._teardown_left = []
        try:  # every step runs even after one fails (a GPU in a sticky error state fails each synchronize)
            run_all(steps, cut_short=self._teardown_left)
        finally:
            if not self._teardown_left:
                _unclosed.discard(self)
                _unfinished.discard(self)
            else:  # kept alive (a failed initialize returned no engine) to be finished at exit
                _unclosed.add(self)
                _unfinished.add(self)

    def _close_comm(self) -> None:
        """Stops the heartbeat, destroys the process group if the engine created it, and removes the per-rank
        NVMe folders it made (when empty: the swap engines have removed their files)."""
        try:
            self.comm.close(self._stop_reason)
        finally:
            for d in self._rank_dirs:
                try:
                    d.rmdir()
                except OSError:
                    pass
            self._rank_dirs = []

    def _close_alone(self) -> None:
        """Closes without the other ranks (at exit): the process group first, so that no collective of the close
        waits on ranks that may be gone (they fail at once instead, and are passed over); the rest is local
        (threads, buffers, swap files). The updates of a step still running are dropped: nothing trains on."""
        with contextlib.suppress(Exception):
            self.comm.close(self._stop_reason)
        self.phase = Phase.CLOSED
        try:
            self._teardown()
        except Exception as exc:  # noqa: BLE001 - a collective of the teardown, refused once the group is gone
            log.debug("offload: closing an engine alone at exit: %s", exc)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        """An engine dropped without ``close()`` (its model dropped too, or handed to a new one) is closed when it
        is collected, with a ResourceWarning: its threads, buffers and swap files would otherwise stay until exit."""
        if getattr(self, "phase", Phase.CLOSED) is Phase.CLOSED:  # (closed, or its construction failed)
            return
        warnings.warn(f"offload: an engine (world rank {self.rank} of {self.world_size}) was garbage collected "
                      "without close(): closing it now. Call engine.close(), or use `with offload.initialize(...) "
                      "as engine:`", ResourceWarning, stacklevel=2)
        try:
            self.close() if self.world_size == 1 else self._close_alone()
        except Exception as exc:  # noqa: BLE001 - nobody to raise to in a finalizer
            log.warning("offload: closing a collected engine failed: %s", exc)


_unclosed: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_unfinished: set[Engine] = set()  # engines whose teardown a second Ctrl-C cut short, held until it is finished


def holding(module: torch.nn.Module) -> Engine | None:
    """The open engine that holds ``module``, if any."""
    return next((e for e in list(_unclosed) if e.module is module), None)


@atexit.register
def _close_at_exit() -> None:
    """Engines still open when the interpreter exits (a script that did not close its engine, an uncaught
    exception, SIGTERM: see :func:`_on_sigterm`) are closed while their threads still run, so their swap files are
    removed and no thread is killed inside a torch op. With several ranks each closes alone
    (:meth:`Engine._close_alone`), its process group first, before the interpreter's shutdown, where its gloo
    threads could abort the process (SIGABRT, "terminate called without an active exception": 3 of 12 runs of a
    2-rank script that did not close its engine, 2 of 52 since)."""
    for engine in list(_unclosed):
        try:
            if engine.world_size == 1:
                engine.close()
            else:
                engine._close_alone()
        except Exception as exc:  # noqa: BLE001 - exiting anyway: say so, close the others
            log.warning("offload: closing an engine at exit failed: %s", exc)
    release_store()  # (the rendezvous store's threads too)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (torchrun ending the other ranks when one failed, a scheduler preempting the job) ends the process
    as an uncaught exception would: ``SystemExit`` unwinds the program and the exit hook closes the open engines,
    removing their swap files, which the default action (killed on the spot) left on every rank. Installed by
    the first engine when SIGTERM had its default action; with no engine open it takes that action itself. A
    second SIGTERM during the unwinding kills at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not _unclosed:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    log.warning("offload: SIGTERM: closing the open engines (their swap files are removed) and exiting")
    raise SystemExit(128 + signum)


def _take_sigterm() -> None:
    """Installs :func:`_on_sigterm` where SIGTERM still has its default action (a handler of the program's own is
    left alone) and this is the main thread (the only one that may)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _accepted(model: Any, cfg: OffloadConfig) -> torch.nn.Module:
    """The module an engine of ``model`` hooks and names (the one ``torch.compile`` wraps), once checked: a module,
    with plain tensors, that no open engine holds."""
    if not cfg.optimizer_given and isinstance(model, torch.nn.Module) and any(
            p.requires_grad for p in model.parameters()):  # (a frozen model's engine has nothing to update)
        log.warning("offload: the config has no optimizer section, so the defaults train: AdamW, lr %g, betas "
                    "%s, eps %g, weight_decay %g (where a param group sets none of its own). An optimizer passed "
                    "to deepspeed.initialize has no counterpart here: give its settings in the config's "
                    "optimizer section (docs/configuration.md)",
                    cfg.optimizer.lr, list(cfg.optimizer.betas), cfg.optimizer.eps, cfg.optimizer.weight_decay)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    module = unwrap_compiled(model)
    _check_tensors(module)
    left = holding(module)
    if left is not None and left.phase is Phase.CLOSED:  # a close, or a failed initialize's cleanup, that a
        left.close()  # second Ctrl-C cut short: its model's parameters are handed back now
    if holding(module) is not None:
        raise ValueError("initialize: this model is held by an engine that is still open (its hooks and "
                         "parameters are that engine's); close it first (engine.close(), or `with "
                         "offload.initialize(...) as engine:`), which hands the model back with its current "
                         "weights")
    return module


_warned_bf16 = False


def _warn_slow_bf16(device: torch.device, dtype: torch.dtype) -> None:
    """Once per process: bf16 compute on a CPU without native bf16 is ~100x slower than fp32."""
    global _warned_bf16
    if dtype is torch.bfloat16 and not _warned_bf16 and not fast_bf16(device):
        _warned_bf16 = True
        log.warning("offload: bf16 on %s, which has no native bf16 (AVX-512 BF16 or AMX): torch's bf16 matmuls run "
                    "about 100x slower than fp32 here. The CPU device tier is for testing; train on a GPU, or set "
                    "bf16.enabled false", device)


# config keys each rank may set for itself: where its files, memory and disk are, and how it waits
_PER_RANK = ("nvme_path", "pin_memory", "buffer_count", "fast_init", "aio.", "offload.device",
             "offload.device_memory_budget", "offload.host_memory_budget", "offload.nvme_memory_budget",
             "offload.comm_timeout", "offload.trim_host_heap", "seed", "ignored", "batch_keys", "optimizer_given")
# what the plan derives that the ranks' collectives depend on (the layout of the flat buffers, the buckets, the
# stage-3 window that decides when each parameter is gathered)
_PLAN_SHARED = ("stage", "partition", "dtype", "gradient_accumulation_steps", "sub_group_size", "grad_bucket",
                "max_live", "prefetch_bucket", "persistence_threshold", "overlap", "overlap_forward", "delayed")


def _shared_settings(cfg: OffloadConfig, plan: Plan) -> dict[str, Any]:
    """The settings every rank must share (see :func:`offload.dist.agree_on_settings`), by dotted name."""
    out = {name: value for name, value in flat_fields(cfg).items()
           if not any(name.startswith(key) or name.endswith("." + key) for key in _PER_RANK)}
    out.update({f"plan.{name}": getattr(plan, name) for name in _PLAN_SHARED})
    return out


def _warn_widened(params: list[torch.Tensor], dtype: torch.dtype) -> None:
    """A model given in bf16 or fp16 to a config that trains in fp32 (neither bf16 nor fp16 enabled) is widened
    to fp32 on every tier: said, since a model loaded in bf16 to fit in memory would then need twice as much."""
    size = torch.empty((), dtype=dtype).element_size()
    narrow_params = [p for p in params if p.is_floating_point() and p.element_size() < size]
    narrow = sorted({str(p.dtype).removeprefix("torch.") for p in narrow_params})
    if narrow:
        log.warning("offload: the model's trainable parameters are %s and the config trains in %s (bf16.enabled and "
                    "fp16.enabled are false): initialize widens them, %dx their bytes; to train in bfloat16 with "
                    "fp32 master weights set bf16.enabled true (transformers: TrainingArguments(bf16=True))",
                    " and ".join(narrow), str(dtype).removeprefix("torch."),
                    size // min(p.element_size() for p in narrow_params))


def _to_device(value: Any, device: torch.device, cast: torch.dtype | None = None) -> Any:
    """``value`` with every tensor in it (through lists, tuples, named tuples and mappings) on ``device``, floating
    ones in ``cast`` if given (DeepSpeed's ``fp16.auto_cast``)."""
    if isinstance(value, torch.Tensor):
        dtype = cast if cast is not None and value.is_floating_point() else value.dtype
        if value.device == device and value.dtype == dtype:
            return value
        # moved first, then cast there: a cast in the same call would convert on the host into pageable memory
        return value.to(device, non_blocking=device.type == "cuda" and value.is_pinned()).to(dtype)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_device(v, device, cast) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, cast) for v in value)
    if isinstance(value, Mapping):  # dicts, and UserDicts such as transformers' BatchEncoding
        moved = {k: _to_device(v, device, cast) for k, v in value.items()}
        try:
            return type(value)(moved)
        except TypeError:  # a mapping that cannot be built from a dict
            return moved
    return value


def _check_tensors(module: torch.nn.Module) -> None:
    """Refuses, before anything moves, what the engine cannot train: a tensor on the meta device (no values to
    train from), a float64 trainable parameter (the masters are fp32; rounding it silently would change the
    model, and its float64 inputs would then meet fp32 weights), and a trainable embedding whose forward writes its
    own weight (``max_norm``)."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"initialize: {kind} {name!r} is on the meta device (it has no values): build the model inside "
                    "`with offload.init(config):` and load its weights with offload.load_state_dict(model, path), "
                    "or give it values first (model.to_empty(device='cpu') and its own initialisation, or "
                    "load_state_dict(..., assign=True))")
            if kind == "parameter" and t.requires_grad and t.dtype == torch.float64:
                raise ValueError(
                    f"initialize: parameter {name!r} is float64; the engine keeps fp32 master weights and computes "
                    "in bf16, fp16 or fp32 (the config's bf16/fp16 sections): convert the model first "
                    "(model.float()), and its inputs with it")
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None \
                and m.weight.requires_grad:
            raise ValueError(
                f"initialize: {type(m).__name__} {name or '(the model)'!r} has max_norm={m.max_norm}: its forward "
                "renormalises the rows it reads in place, in the weight the forward uses, which the engine's fp32 "
                "master copy would never see (the next step writes the rows back unrenormalised: the run drifts from "
                "torch's without a word). Set max_norm=None, and renormalise in the loss if you need it, or freeze "
                "the embedding (requires_grad_(False))")


def _param_groups(module: torch.nn.Module, param_groups: Iterable[dict[str, Any]] | None
                  ) -> tuple[list[list[torch.nn.Parameter]], list[dict[str, Any]]]:
    """The trainable parameters in groups, with per-group options, checked against the model."""
    trainable = [p for p in module.parameters() if p.requires_grad]
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
                raise ValueError(f"param_groups[{i}] holds a tensor that is not a trainable parameter of the model")
            if id(p) in seen:
                raise ValueError(f"param_groups[{i}] repeats a parameter already in an earlier group")
            seen.add(id(p))
        unknown = set(g) - {"params", "lr", "betas", "eps", "weight_decay", "bias_correction", "adamw_mode"}
        if unknown:
            raise ValueError(f"param_groups[{i}]: unknown option {sorted(unknown)[0]!r}; allowed: lr, betas, eps, "
                             "weight_decay, bias_correction, adamw_mode")
        groups.append(params)
        options.append({k: v for k, v in g.items() if k != "params"})
    missing = [p for p in trainable if id(p) not in seen]
    if missing:
        raise ValueError(f"param_groups leave {len(missing)} trainable parameter(s) out; add them to a group or set "
                         "requires_grad=False")
    return groups, options


def _note_moved(module: torch.nn.Module, given: dict[int, tuple[torch.dtype, torch.device]],
                error: BaseException) -> None:
    """A failure after parameters began moving to their homes (a disk or device error; budgets are all checked
    before the first move) hands them back where and how the engine held them: says so on ``error``, so that nobody
    trains on, say, bf16-rounded weights believing them the fp32 ones they loaded."""
    moved = [(name, p) for name, p in module.named_parameters() if (p.dtype, p.device) != given.get(id(p))]
    if not moved:
        return
    now = sorted({f"{p.dtype} on {p.device}" for _, p in moved})
    names = ", ".join(name for name, _ in moved[:3]) + (", ..." if len(moved) > 3 else "")
    rounded = " (their values rounded to it)" if any(p.dtype != given[id(p)][0] for _, p in moved) else ""
    note_on(error, f"initialize had moved {len(moved)} of {len(given)} parameters ({names}) when it failed; they "
                   f"are left as {' and '.join(now)}{rounded}: reload the model's weights, or build it again, before "
                   "using it")


def initialize(model: torch.nn.Module, config: OffloadConfig | Mapping[str, Any] | str | Path | None = None, *,
               param_groups: Iterable[dict[str, Any]] | None = None, model_parameters: Iterable[Any] | None = None,
               config_params: Mapping[str, Any] | None = None, args: Any = None,
               lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, optimizer: Any = None,
               training_data: Any = None, _file_io: FileIO | None = None) -> Engine:
    """Wraps ``model`` (in place) for offloaded training under ``config`` (a dict, a JSON path, or OffloadConfig).
    Fails here, with the numbers, if the configuration cannot fit its tier budgets or an nvme_path is unusable.

    DeepSpeed's keywords, for scripts ported as they are: ``config_params`` is ``config``; ``args`` gives it from
    ``args.deepspeed_config``; ``model_parameters`` is ``param_groups`` (plain parameters: one group, the frozen
    ones left out); ``lr_scheduler`` a callable building a scheduler on ``engine.optimizer`` (stepped and saved as
    the config's). ``optimizer`` and ``training_data`` are refused, naming what to do instead.
    ``_file_io`` is for fault-injection tests (see :class:`Engine`)."""
    if optimizer is not None:
        raise TypeError("initialize(optimizer=...): the optimizer here is the config's optimizer section (Adam or "
                        "AdamW, run on the offloaded fp32 masters), which a torch optimizer cannot drive; put its "
                        "lr, betas, eps and weight_decay there, and per-group values in param_groups")
    if training_data is not None:
        raise TypeError("initialize(training_data=...): build the DataLoader yourself (with a DistributedSampler "
                        "under torchrun) and feed its batches to engine(...)")
    if config_params is not None:
        if config is not None:
            raise ValueError("initialize: config and config_params are both given; pass one")
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if model_parameters is not None:
        if param_groups is not None:
            raise ValueError("initialize: param_groups and model_parameters are both given; pass one")
        items = list(model_parameters)  # frozen parameters left out, in groups too, as DeepSpeed leaves them
        groups = items if items and all(isinstance(g, Mapping) for g in items) else [{"params": items}]
        param_groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} if "params" in g else g
                        for g in groups]
    if lr_scheduler is not None and (hasattr(lr_scheduler, "step") or not callable(lr_scheduler)):
        raise TypeError("initialize(lr_scheduler=...): a scheduler built on your own optimizer would not drive "
                        "this engine's; pass a callable, lr_scheduler=lambda opt: torch.optim.lr_scheduler."
                        "LambdaLR(opt, ...), which builds it on engine.optimizer")
    engine = Engine(model, config, param_groups=param_groups, _file_io=_file_io)
    if lr_scheduler is not None:
        if engine.lr_scheduler is not None:
            engine.close()
            raise ValueError("initialize: lr_scheduler is given and the config has a scheduler section; keep one")
        try:
            engine.lr_scheduler = lr_scheduler(engine.optimizer)
        except BaseException as exc:
            close_after_failure(engine.close, exc)
            raise
    return engine
