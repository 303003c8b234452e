"""OffloadedAdam: Adam/AdamW whose fp32 master weights and moments live on HOST or NVME, one sub-group at a time.

Per sub-group (see :mod:`._layout`) the state is one flat fp32 block ``[master | exp_avg | exp_avg_sq]``: one
allocation on HOST, or one NVMe key read and written in a single request. Gradients arrive (from the engine's
:class:`~offload.engine._grads.GradientStream`) in :class:`~._grad_buffers.GradientBuffers`: whole buffers, or a few
sub-group slots when updates run during backward; fp32 when micro-batches accumulate, else the training dtype (a
bf16 gradient widened to fp32 carries no more information, and the kernel reads bf16/fp16 directly). An update
first waits for the handles of the copies that bring its sub-group's gradients (``grad_handles``). Updating a
sub-group is one pass of the CPU Adam kernel, which also writes the new low-precision parameters into the buffer
the update sink lends (:mod:`offload.params._sinks`: the target itself when it is host memory, else a staging
buffer), and hands them to the sink, which takes them where they live: to the device on the host-to-device stream
behind the point where backward stopped reading them, to their NVMe homes, or nowhere (written in place).

All state access runs on one worker thread, the stepper, which runs jobs in submission order: the engine queues a
sub-group as soon as its gradients are final (overlap with backward) or all remaining ones at ``step``. With
``overlap_forward`` the step returns before its updates have run and the next forward waits for each sub-group as
it reaches its parameters (:class:`~offload.engine._gate.UpdateGate`): once backward has ended the stepper then
takes the queued sub-groups in the order forward needs them (``update_order``). ``pending()`` hands the
gate each queued update, ``upload_of`` the copy that takes its new parameters to the device.
With state on NVMe the stepper is a pipeline through the store's staging buffers: while it updates sub-group k,
the reads of the next sub-groups (in the order the last step processed them) are in flight, and k-1's write-back
drains behind. An error on the stepper surfaces at the engine's next wait.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from nvme_swapper import evict_pages

from .._worker import Worker
from ..config import OptimizerConfig
from ..memory import CopyStreams, Tier, TieredStore, fmt_bytes, wait_all
from ..ops import adam_step, squared_norm
from ..plan import spare_writes
from ._grad_buffers import GradientBuffers
from ._layout import FlatLayout, Segment, SubGroup

if TYPE_CHECKING:
    from ..params._sinks import UpdateSink

_FIX_HOST = ("lower zero_optimization.sub_group_size, offload the optimizer to nvme, or raise "
             "offload.host_memory_budget")
_FIX_STATE = {  # the whole state, charged at once: smaller sub-groups do not make it smaller
    Tier.HOST: "offload the optimizer to nvme (zero_optimization.offload_optimizer.device), or raise "
               "offload.host_memory_budget",
    Tier.DEVICE: "offload the optimizer (zero_optimization.offload_optimizer.device \"cpu\" or \"nvme\"), or raise "
                 "offload.device_memory_budget"}
_SQUARE_LIMIT = math.sqrt(torch.finfo(torch.float32).max)  # a gradient element whose square overflows fp32


class OffloadedAdam(torch.optim.Optimizer):
    """A torch Optimizer over the layout's parameters (so LR schedulers and per-group hyperparameters work), whose
    state is held by a :class:`TieredStore` on ``placement`` (DEVICE means no offload)."""

    def __init__(self, layout: FlatLayout, store: TieredStore, copies: CopyStreams, cfg: OptimizerConfig,
                 placement: Tier, *, group_options: list[dict[str, Any]] | None = None, nvme_path: str | None = None,
                 buffer_count: int = 4, aio: Any = None, grad_dtype: torch.dtype = torch.float32,
                 grad_sets: int = 1, grad_slots: int = 0, lazy_rows: dict[int, int] | None = None,
                 cuda_path: bool = False, overlap_forward: bool = False) -> None:
        """``grad_sets``, ``grad_slots``: the shape of the gradient buffers (see :class:`GradientBuffers`).
        ``lazy_rows``: {parameter index: row width} of parameters (embeddings) whose rows with a zero gradient
        are left as they are by a step (parameter, moments and weight decay: lazy Adam) instead of updated as
        dense Adam does; only with the state offloaded (the CPU kernel). ``cuda_path``: state on the device is
        updated by torch's fused kernel on the compute stream and read by checkpoints through host copies (CUDA;
        see ``offload.plan.STAGE_ON_CPU``). ``overlap_forward``: after backward, update in the order the next forward
        needs the sub-groups in (``update_order``) rather than the order they were queued in. The state holds the
        initial values once :meth:`fill_masters` has read every parameter."""
        n_groups = len(layout.group_numel)
        options = group_options or [{} for _ in range(n_groups)]
        groups = [{"params": [p for p, pg in zip(layout.params, layout.param_group) if pg == g], **options[g]}
                  for g in range(n_groups)]
        defaults = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        bias_correction=cfg.bias_correction, adamw_mode=cfg.adamw_mode)
        super().__init__(groups, defaults)
        self.layout, self.store, self.copies, self.placement = layout, store, copies, placement
        self._fused = placement is Tier.DEVICE and cuda_path
        self._lazy = lazy_rows or {}
        if self._lazy and placement is Tier.DEVICE:
            raise ValueError('sparse_gradients "lazy" updates embedding rows with the CPU Adam kernel: offload the '
                             "optimizer (zero_optimization.offload_optimizer.device \"cpu\" or \"nvme\"), or set "
                             "sparse_gradients to true")
        self.step_count = 0  # completed steps; the update in progress uses step_count + 1
        self.adam_seconds = 0.0
        self.adam_seconds_overlapped = 0.0
        self.sub_groups_overlapped = 0  # queued during backward (their update could start before backward ended)
        # where updates hand the new low-precision parameters (set by Weights, which owns it, before any step)
        self.sink: UpdateSink | None = None
        self.grad_handles: Any = lambda k: ()  # what an update waits for: the copies of its gradients (engine-set)
        self._order = [sg.index for sg in reversed(layout.sub_groups)]  # backward makes gradients final in reverse
        self._done: set[int] = set()
        self._overlap_forward = overlap_forward
        self._rank = list(range(len(layout.sub_groups)))  # sub-group -> its place in the order forward needs them
        self._jobs: dict[int, Any] = {}  # sub-group -> the queued job of its update in the step in progress
        self._uploaded: dict[int, Any] = {}  # sub-group -> the copy of its new parameters to the device (CUDA)
        self._ran: list[int] = []  # sub-groups in the order the stepper updated them (the next step reads ahead so)
        # step -> the squared norms of the gradients its updates used so far (the newest two steps; stepper-written)
        self._squares: dict[int, tuple[float | torch.Tensor, ...]] = {}
        self._launched = False
        self._in_backward = False
        self.grads = GradientBuffers(layout, store, Tier.DEVICE if placement is Tier.DEVICE else Tier.HOST,
                                     grad_dtype, sets=grad_sets, slots=grad_slots)
        self._state: list[torch.Tensor] = []
        self._staged: dict[int, torch.Tensor] = {}  # host copies of device state handed out by read/stage_state
        self._filling: tuple[SubGroup, torch.Tensor] | None = None  # the state block being filled (fill_masters)
        self._next_fill = 0  # the next sub-group whose state block fill_masters opens
        self._filled_params = 0  # parameters [0, this) are in the master weights
        self._unfilled = 0  # bytes reserved on the state's tier for blocks fill_masters has not allocated yet
        self._segments_of: list[list[tuple[SubGroup, Segment]]] = [[] for _ in layout.params]
        for sg in layout.sub_groups:
            for seg in sg.segments:
                self._segments_of[seg.param].append((sg, seg))
        if placement is Tier.NVME:
            if not nvme_path:
                raise ValueError("zero_optimization.offload_optimizer.nvme_path is required for device \"nvme\"")
            total = sum(3 * sg.numel * 4 for sg in layout.sub_groups)
            buffer_count = min(buffer_count, len(layout.sub_groups))  # more buffers than sub-groups buy nothing
            slot = 3 * layout.max_sub_group_numel * 4
            store.open_nvme(nvme_path, aio, slot_bytes=slot, buffer_count=buffer_count, total_bytes=total,
                            what=f"optimizer state ({fmt_bytes(total)})",
                            spare_writes=spare_writes(total, -(-slot // 4096) * 4096, buffer_count),
                            key_bytes=[3 * sg.numel * 4 for sg in layout.sub_groups])
            for sg in layout.sub_groups:
                store.register(self._key(sg), 3 * sg.numel, torch.float32)
        else:  # charged whole now, so a budget the state does not fit fails before any parameter has moved
            self._unfilled = sum(3 * sg.numel * 4 for sg in layout.sub_groups)
            store.accounts[placement].reserve(
                self._unfilled, f"optimizer state ({len(layout.sub_groups)} sub-groups, "
                f"{fmt_bytes(self._unfilled)})", _FIX_STATE[placement])
        self._warm_kernel()  # before the stepper starts: a failure here leaves no thread behind
        self._stepper = Worker("offload-stepper", copies.device)

    @staticmethod
    def _warm_kernel() -> None:
        """Builds (first use on a machine) and loads the CPU Adam kernel now, not inside the first step."""
        one = torch.zeros(1, device="cpu")  # CPU tensors whatever default device the caller set
        adam_step(one, torch.zeros_like(one), torch.zeros_like(one), torch.zeros_like(one), step=1, lr=0.0,
                  beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)

    # setup ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _key(sg: SubGroup) -> str:
        return f"adam/{sg.group}/{sg.index}"

    def fill_masters(self, through: int | None = None) -> None:
        """Reads parameters up to ``through`` (all: None, which also completes the state) into the master weights:
        their current full-precision values; moments zero. The state is filled sub-group by sub-group in layout
        order, each block allocated (HOST) or staged (NVME) when its first parameter is read and finished (NVMe:
        written back) after its last one, so the caller may free each parameter's memory as soon as this returns
        for it: :class:`~offload.params._weights.Weights` moves the parameter to its home right after, and a model
        built in RAM and its optimizer state are not held whole at once. A parameter built in a file arena
        (``offload.init``) has its pages dropped again once read."""
        n = len(self.layout.params) if through is None else through
        while self._filled_params < n:
            i = self._filled_params
            param = self.layout.params[i].detach()
            flat = param.reshape(-1)
            for sg, seg in self._segments_of[i]:
                lo, src = seg.flat_start - sg.start, seg.param_start
                self._fill_block(sg.index)[lo : lo + seg.numel].copy_(flat[src : src + seg.numel])
            evict_pages(param)
            self._filled_params += 1
            if self._filling is not None and self._filling[0].segments[-1].param == i:
                self._finish_block()
        if through is None:
            self._fill_block(len(self.layout.sub_groups))  # finishes the rest (sub-groups of padding alone too)
            if self.placement is Tier.NVME:
                self.store.drain()

    def _fill_block(self, k: int) -> torch.Tensor | None:
        """Sub-group ``k``'s state block, open for its initial values; every earlier block is finished first."""
        while self._filling is None or self._filling[0].index < k:
            if self._filling is not None:
                self._finish_block()
            if self._next_fill == len(self.layout.sub_groups):
                return None
            sg = self.layout.sub_groups[self._next_fill]
            self._next_fill += 1
            if self.placement is Tier.NVME:
                block = self.store.stage(self._key(sg))
            else:  # the block's bytes move from the reservation to the allocation
                self.store.accounts[self.placement].release(3 * sg.numel * 4)
                self._unfilled -= 3 * sg.numel * 4
                block = self.store.allocate(self.placement, 3 * sg.numel, torch.float32,
                                            f"optimizer state of sub-group {sg.index}", _FIX_HOST,
                                            pin=False)  # read by CPU Adam alone, never copied to a device
                self._state.append(block)
            self._filling = (sg, block.zero_())
        return self._filling[1]

    def _finish_block(self) -> None:
        assert self._filling is not None
        sg, _ = self._filling
        self._filling = None
        if self.placement is Tier.NVME:
            self.store.evict(self._key(sg))

    # the step ---------------------------------------------------------------------------------------------------

    def begin_backward(self) -> None:
        self._in_backward = True
        self._stepper.lowest_first = False  # in the order gradients arrive: the slots they hold free in turn

    def end_backward(self) -> None:
        self._in_backward = False
        self._stepper.lowest_first = self._overlap_forward

    def submit(self, sg: int, grad_scale: float = 1.0, *, wait_first: tuple[Any, ...] = ()) -> None:
        """Queues one sub-group's update for the step in progress (its gradients are final, or on their way:
        the update waits for ``grad_handles(sg)``, and for ``wait_first``). Called from the training thread."""
        self._done.add(sg)
        if self._in_backward:
            self.sub_groups_overlapped += 1
        waits = (*wait_first, *self.grad_handles(sg))
        # the hyperparameters as they are now: an LR scheduler stepping while the update runs (delayed update)
        # changes the next step's, not this one's
        group = {k: v for k, v in self.param_groups[self.layout.sub_groups[sg].group].items() if k != "params"}
        job = self._stepper.submit(self._update, sg, grad_scale, self.grads.for_update(sg), self.step_count + 1,
                                   waits, self.copies.mark(), self.copies.current_stream(), group,
                                   key=self._rank[sg])
        self._jobs[sg] = job
        self.grads.queued(sg, job)

    def step(self, closure: Any = None, *, grad_scale: float = 1.0) -> None:  # type: ignore[override]
        """Updates every sub-group not already updated during backward; returns when all are done.
        ``grad_scale`` divides the gradients (loss scale over the clipping coefficient)."""
        if closure is not None:
            raise ValueError("OffloadedAdam.step does not take a closure")
        self.launch(grad_scale)
        self.finish()

    def launch(self, grad_scale: float = 1.0, *, wait_first: tuple[Any, ...] = ()) -> None:
        """Queues the rest of the step and returns at once; ``finish`` waits for it. Every update waits for
        ``wait_first`` (copies still reading a buffer the updates write) before writing."""
        for sg in self._order:
            if sg not in self._done:
                self.submit(sg, grad_scale, wait_first=wait_first)
        self.step_count += 1
        self._launched = True

    def update_order(self, rank: list[int]) -> None:
        """``rank[k]``: where sub-group ``k`` comes in the order the next forward needs them (with
        ``overlap_forward``, the stepper takes what is queued after backward in that order)."""
        self._rank = list(rank)

    def pending(self) -> dict[int, Any]:
        """The launched step's updates: {sub-group: the job of its update}, until ``finish``."""
        return dict(self._jobs)

    def upload_of(self, k: int) -> Any:
        """The copy of sub-group ``k``'s new parameters to the device, once its job has run (None: written in
        place, on the CPU device)."""
        return self._uploaded.get(k)

    def finish(self) -> None:
        """Waits for the launched step's updates, the writes of new parameters to their NVMe homes and, with state
        on NVMe, its write-backs (re-raising the first error of the stepper thread or of a write), and records the
        order the updates ran in. Draining here rather than beside the next forward measured ~5% faster at 3.8B on
        NVMe: the forward's parameter reads then get the whole disk instead of sharing it with the last sub-groups'
        writes."""
        try:
            self._stepper.wait_idle()
            if self.sink is not None:  # the parameters' writes to their NVMe homes
                self.sink.wait()
            if self.placement is Tier.NVME:
                self.store.drain()
        finally:
            self.grads.reclaim()
            if self._launched:
                order, self._ran = self._ran, []
                seen = set(order)
                self._order = order + [k for k in self._order if k not in seen]
                self._done.clear()
                self._launched = False
                self._jobs.clear()  # before a launch they are the step's (a checkpoint between backward and step)
                self._uploaded.clear()

    def wait(self) -> None:
        """Waits for everything queued or launched, inside a step or not (``finish``)."""
        self.finish()

    def restart_at(self, step_count: int) -> None:
        """A checkpoint's step count (the stepper is idle): the sums of steps run before it are forgotten, so step
        numbers taken again start from nothing."""
        self.step_count = step_count
        self._squares.clear()

    def grad_squares(self, step: int) -> float | torch.Tensor | None:
        """The sum over this rank's sub-groups of the squared norm of the gradients update ``step`` used (divided
        by its ``grad_scale``), taken by the updates themselves; None until every sub-group's update of that step
        has run (or for a step older than the one before the newest). With the state on a GPU, a 0-d float64
        tensor there, summed on the compute stream: nothing here waits for the device."""
        if not self.squares_ready(step):
            return None
        squares = self._squares[step]
        on_device = [v for v in squares if isinstance(v, torch.Tensor)]
        total = math.fsum(v for v in squares if not isinstance(v, torch.Tensor))
        if not on_device:
            return total
        with torch.cuda.stream(self.copies.current_stream()):  # the stream the updates summed them on
            return torch.stack(on_device).sum(dtype=torch.float64) + total

    def squares_ready(self, step: int) -> bool:
        """Every sub-group's update of ``step`` has summed its squares (``grad_squares`` has a value)."""
        return len(self._squares.get(step, ())) >= len(self.layout.sub_groups)

    def _count_squares(self, step: int, squares: float | torch.Tensor) -> None:
        """On the stepper: one update's squared gradient norm. One assignment each, so the training thread reading
        ``grad_squares`` sees a whole tuple; steps before the previous one are dropped."""
        self._squares[step] = (*self._squares.get(step, ()), squares)
        for old in [k for k in self._squares if k < step - 1]:
            del self._squares[old]

    def _update(self, k: int, grad_scale: float, grad: torch.Tensor, step: int, waits: tuple[Any, ...],
                after: Any, stream: Any, group: dict[str, Any]) -> None:
        """On the stepper: one sub-group's Adam update once its gradients have landed, its new parameters handed to
        the sink; ``after``: the point of the compute stream (``stream``, the submitter's) after which the device
        no longer reads this sub-group's parameters."""
        wait_all(waits)
        self._ran.append(k)
        sg = self.layout.sub_groups[k]
        if self.placement is Tier.NVME:
            block = self.store.acquire(self._key(sg))
            self._prefetch(k)
        else:
            block = self._state[k]
        n = sg.numel
        master, exp_avg, exp_avg_sq = block[:n], block[n : 2 * n], block[2 * n :]
        sink = self.sink
        assert sink is not None, "an update before Weights set the sink"
        t = time.perf_counter()
        out = sink.take(sg)
        if self._fused:  # state on the device (no offload): torch's fused kernel, same arithmetic
            with torch.cuda.stream(stream):  # ordered after the backward that wrote the gradients
                squares = self._fused_torch(master, exp_avg, exp_avg_sq, grad, group, grad_scale, step)
                sink.land(out, master)
        else:
            lowp = out.dtype != torch.float32
            hyper = dict(step=step, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                         eps=group["eps"], weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                         bias_correction=group["bias_correction"], grad_scale=grad_scale)
            state = (master, grad, exp_avg, exp_avg_sq, out if lowp else None)
            lazy = [seg for seg in sg.segments if seg.param in self._lazy]
            if lazy:
                squares = self._lazy_step(sg, lazy, *state, hyper)
            else:
                squares = adam_step(*state[:4], out=state[4], **hyper)
            if math.isinf(squares):  # the fp32 squares overflowed (summed again, scaled), or grad holds inf
                squares = squared_norm(grad, 1.0 / grad_scale)
            if not lowp:
                out.copy_(master)  # fp32 training: the new parameters are the masters
        self._count_squares(step, squares)
        elapsed = time.perf_counter() - t
        self.adam_seconds += elapsed
        if self._in_backward:
            self.adam_seconds_overlapped += elapsed
        upload = sink.put(sg, out, after)
        if upload is not None:
            self._uploaded[k] = upload
        if self.placement is Tier.NVME:
            self.store.evict(self._key(sg))

    def _lazy_step(self, sg: SubGroup, lazy: list[Any], master: torch.Tensor, grad: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, out: torch.Tensor | None,
                   hyper: dict[str, Any]) -> float:
        """Adam over a sub-group holding lazy parameters: dense between them; on each lazy segment, only the rows
        with a non-zero gradient, gathered into compact tensors, updated, and scattered back (the other rows keep
        their parameter and moments, and their low-precision copy is the unchanged master rounded). Returns the
        squared gradient norm (the rows left out have none)."""
        def dense(a: int, b: int) -> float:
            if a >= b:
                return 0.0
            return adam_step(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b],
                             out=None if out is None else out[a:b], **hyper)

        pos, squares = 0, 0.0
        for seg in lazy:
            lo, hi = seg.flat_start - sg.start, seg.flat_start - sg.start + seg.numel
            squares += dense(pos, lo)
            width = self._lazy[seg.param]
            first = seg.param_start  # element of the flattened parameter at ``lo``
            touched = torch.unique((first + grad[lo:hi].nonzero().reshape(-1)) // width)
            cols = torch.arange(width, device="cpu")
            idx = (touched[:, None] * width + cols[None, :]).reshape(-1) - first
            idx = idx[(idx >= 0) & (idx < hi - lo)] + lo
            if out is not None:
                out[lo:hi].copy_(master[lo:hi])
            if idx.numel():
                parts = [t.index_select(0, idx) for t in (master, grad, exp_avg, exp_avg_sq)]
                low = torch.empty(idx.numel(), dtype=out.dtype, device="cpu") if out is not None else None
                squares += adam_step(*parts, out=low, **hyper)
                for t, part in zip((master, exp_avg, exp_avg_sq), (parts[0], parts[2], parts[3])):
                    t.index_copy_(0, idx, part)
                if out is not None:
                    out.index_copy_(0, idx, low)
            pos = hi
        return squares + dense(pos, sg.numel)

    def _prefetch(self, current: int) -> None:
        """Starts reads of the sub-groups expected next, as far as free staging buffers allow."""
        order = self._order
        pos = order.index(current) if current in order else -1
        for k in order[pos + 1 :]:
            if self.store.fetch(self._key(self.layout.sub_groups[k])) is None:
                break

    def _fused_torch(self, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                     group: dict[str, Any], grad_scale: float, step_number: int) -> torch.Tensor:
        """State on a CUDA device (no offload): torch's fused kernel does the same arithmetic. It always corrects
        for bias, by 1 - beta**step: without bias correction it is given an infinite step, where that is exactly 1
        (betas are below 1). Scalars are filled on the device: a tensor made from a Python number would be a
        blocking copy, which waits for the compute stream. Returns the squared norm of grad / grad_scale, a 0-d
        float64 tensor on the device (fp32 squares, as the CPU kernel's; no wider copy of the gradients). A
        sub-group with an element of ``grad / grad_scale`` above sqrt(fp32 max), about 1.8e19, keeps its values this
        step: torch's CUDA kernel forms the second moment as fma(-beta2, g*g, g*g), which is inf - inf = NaN there,
        and would write NaN into the masters and moments. Telling costs a max over the gradients, one more read of
        them. The kernel leaves ``grad`` divided by ``grad_scale``."""
        fn = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
        grad = grad.float()  # the fused kernel takes one dtype for state and gradients
        squares = torch.linalg.vector_norm(grad).double().square() / grad_scale**2
        largest = torch.linalg.vector_norm(grad, ord=math.inf).double() / grad_scale
        on = dict(dtype=torch.float32, device=master.device)
        step = torch.full((), float(step_number) if group["bias_correction"] else float("inf"), **on)
        fn([master], [grad], [m], [v], [], [step], lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
           weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
           grad_scale=torch.full((), grad_scale, **on) if grad_scale != 1.0 else None,
           found_inf=(largest > _SQUARE_LIMIT).to(torch.float32))
        return squares

    # state access (the stepper is idle whenever these run) ------------------------------------------------------

    def read_state(self, sg: SubGroup) -> torch.Tensor:
        """The sub-group's ``[master | exp_avg | exp_avg_sq]`` block in host memory (a staged copy for NVMe, a
        copy of state on a CUDA device; call ``done_state``, with ``dirty`` if it was written)."""
        if self.placement is Tier.NVME:
            return self.store.acquire(self._key(sg))
        if self._fused:
            self._staged[sg.index] = block = self.copies.download(self._state[sg.index])
            return block
        return self._state[sg.index]

    def stage_state(self, sg: SubGroup) -> torch.Tensor:
        """The sub-group's block in host memory, to be overwritten whole (NVMe: a staging buffer, not read first;
        state on a CUDA device: a host block that ``done_state(dirty=True)`` copies there)."""
        if self.placement is Tier.NVME:
            return self.store.stage(self._key(sg))
        if self._fused:
            self._staged[sg.index] = block = torch.empty(self._state[sg.index].shape, dtype=torch.float32,
                                                         device="cpu")
            return block
        return self._state[sg.index]

    def skip(self) -> None:
        """Forgets sub-groups queued during backward (a skipped step, a window dropped); their jobs have run."""
        self._done.clear()
        self._jobs.clear()
        self._uploaded.clear()

    def done_state(self, sg: SubGroup, dirty: bool) -> None:
        if self.placement is Tier.NVME:
            if dirty:
                self.store.evict(self._key(sg))
            else:
                self.store.release(self._key(sg))
        staged = self._staged.pop(sg.index, None)
        if staged is not None and dirty:
            self._state[sg.index].copy_(staged)  # on the calling thread's stream, from pageable memory: blocking

    def close(self) -> None:
        self._stepper.close()
        self.grads.close()
        for block in self._state:
            self.store.free(self.placement, block)
        self._state = []
        if self._unfilled:  # initialize failed before the masters were filled
            self.store.accounts[self.placement].release(self._unfilled)
            self._unfilled = 0

    # torch.optim.Optimizer surface that does not apply -----------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the gradient buffers, which the engine overwrites each accumulation window."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("OffloadedAdam state can be larger than memory: use engine.save_checkpoint(dir)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("OffloadedAdam state can be larger than memory: use engine.load_checkpoint(dir)")
