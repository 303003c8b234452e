"""The training step: where an engine is in it (:class:`Phase`), the accumulation window, ``backward`` and
``step``, fp16's loss scale and clipping; :class:`StepController` owns them, one per engine.

A step: ``engine.backward(loss)`` scales the loss (fp16 loss scale, 1/accumulation steps) and runs backward; the
hooks hand each final gradient to the gradient stream and, where the plan allows (bf16/fp32, no clipping, last
micro-batch), each sub-group whose gradients have all been sent to the optimizer thread during the rest of
backward. ``engine.step()`` at an accumulation boundary checks for overflow (fp16), computes the global gradient
norm for clipping, folds loss scale and clipping into one gradient divisor for the CPU Adam kernel, and updates
the remaining sub-groups; without clipping the kernel sums the norm as it updates (``last_grad_norm``, see
``_norm.py``). Where the engine is in a step is :class:`Phase`, checked at every call.

With several ranks the layout gives this rank 1/N of every flat buffer; gradients are reduce-scattered to their
owners (at the step in stage 1, after each backward in stage 2, in each hook in stage 3), updated parameters
all-gathered (after the step, or on demand in stage 3). One rank runs the same code with collectives that are
copies or nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .._state import WriteRefused
from ..optim._schedule import after_engine_update
from ._interrupts import FORCED
from ._norm import check_loss

if TYPE_CHECKING:
    from ._engine import Engine

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


class StepController:
    """An engine's step: owns the phase (with what failed, and the call a second Ctrl-C cut short), the counters,
    the open accumulation window and the collective bytes of the last step. Reads the parts the engine built
    (optimizer, gradient stream, weights, reduce buckets, update gate, norm, loss scaler, LR scheduler, plan)
    through ``engine``: they do not exist yet when the controller is made, and the scheduler may be replaced."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine
        self.phase = Phase.IDLE
        self.failure = ""  # what put the engine in Phase.FAILED
        self.cut_short: str | None = None  # the call a second Ctrl-C cut short: from then on only close() works
        self.global_steps = 0
        self.micro_steps = 0
        self._samples_at = (0, 0)  # (global_steps, global_samples) where a load set them: see global_samples
        self.applied = False  # the last step() updated the parameters (was_step_applied)
        self._seen_micro: set[int] = set()  # parameters with a gradient in this micro-batch
        self._last_micro = True
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._window_start = (0, 0)  # micro_steps and sub_groups_overlapped when the open window began
        self._backward_done = False  # a backward ran since the last step() (its micro-batch is counted)
        self._refused = False  # the last backward refused its non-finite loss (a step() after it counts the batch)
        self._blocks = 0  # engine.gathered() blocks open
        self.last_step_comm = {"payload_bytes": 0, "wire_bytes": 0}
        self._comm_mark = dict(self.last_step_comm)

    # the phase --------------------------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.phase is Phase.CLOSED:
            raise RuntimeError("the engine is closed")

    def expect(self, call: str, *allowed: Phase) -> None:
        self.check_open()
        if self.cut_short is not None:
            raise self.cut_short_error(call)
        if self.phase is Phase.FAILED and Phase.FAILED not in allowed:
            raise self.failed_error(call)
        if self.phase not in allowed:
            raise RuntimeError(f"{call} called while the engine is in phase {self.phase.value!r} (allowed: "
                               f"{', '.join(p.value for p in allowed)}); calls from hooks or other threads during "
                               "a step are not supported")

    def expect_trainable(self, call: str) -> None:
        if not self._engine.layout.params:
            raise RuntimeError(f"{call}: this engine trains nothing (no parameter of the model had "
                               "requires_grad=True at offload.initialize): it runs forwards only, as a reference or "
                               "teacher model does. Compute its outputs under torch.no_grad() and call backward and "
                               "step on the engine of the model you train; to train this model, set requires_grad "
                               "on the parameters to train before offload.initialize")

    def fail(self, call: str, exc: BaseException) -> None:
        self.phase = Phase.FAILED  # the last step's norm stays readable where its updates all ran (last_grad_norm)
        if self.cut_short is None:  # (what follows a cut-short call, e.g. a hook that finds the phase changed)
            self.failure = f"{call} raised {type(exc).__name__}: {exc}"

    def interrupted(self, call: str) -> None:
        """A second Ctrl-C cut ``call`` short (see ``_lifetime.held``). Not only the training state may be half
        changed but the engine's own records (which buffer holds which parameter, which transfer is in flight),
        which a load does not rebuild: only ``close()`` is allowed from here, and a new engine loads the checkpoint."""
        if self.phase is not Phase.CLOSED:
            self.fail(call, KeyboardInterrupt(FORCED))
            self.cut_short = call

    def mark_closed(self) -> None:
        self.phase = Phase.CLOSED

    def loaded(self, micro_steps: int | None) -> None:
        """A checkpoint load succeeded: idle again, ``micro_steps`` (a module-only load's dropped window) restored."""
        if micro_steps is not None:
            self.micro_steps = micro_steps
        self.phase = Phase.IDLE

    def cut_short_error(self, call: str) -> RuntimeError:
        return RuntimeError(f"{call}: a second Ctrl-C cut {self.cut_short} short, which may have left the engine's "
                            "own records (which buffer holds which parameter, which transfers are in flight) half "
                            "changed, so it cannot go on: close() it (again, if that close is cut short too) and "
                            "build a new engine, whose load_checkpoint restores a saved state")

    def failed_error(self, call: str) -> RuntimeError:
        return RuntimeError(f"{call}: {self.failure}, which may have left gradients, parameters or optimizer "
                            "state half updated; load a checkpoint (engine.load_checkpoint: one that succeeds ends "
                            "this) or close the engine")

    # counters ---------------------------------------------------------------------------------------------------

    def restore(self, global_steps: int, micro_steps: int, global_samples: int) -> None:
        """The counters a checkpoint holds, with no micro-batch of a window counted."""
        self.global_steps, self.micro_steps = global_steps, micro_steps
        self._samples_at = (global_steps, global_samples)
        self._backward_done = self._refused = False

    def global_samples(self, batch: int) -> int:
        """Samples trained on, counting ``batch`` a step from what a checkpoint restored."""
        steps, samples = self._samples_at
        return samples + (self.global_steps - steps) * batch

    def count_comm_from_here(self) -> None:
        self._comm_mark = self._comm_totals()
        self.last_step_comm = {"payload_bytes": 0, "wire_bytes": 0}

    def _comm_totals(self) -> dict[str, int]:
        comm = self._engine.comm
        return {"payload_bytes": sum(comm.payload_bytes.values()), "wire_bytes": sum(comm.wire_bytes.values())}

    # the accumulation window ------------------------------------------------------------------------------------

    def is_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        ahead = 0 if self._backward_done else 1  # before its backward, the micro-batch is not counted yet
        return (self.micro_steps + ahead) % self._engine.gradient_accumulation_steps == 0

    def set_boundary(self, is_boundary: bool | None) -> None:
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ValueError(f"set_gradient_accumulation_boundary expects True, False or None, got {is_boundary!r}")
        if is_boundary is False and self._engine.gradient_accumulation_steps == 1:
            raise ValueError("set_gradient_accumulation_boundary(False) adds the next micro-batch to a window, but "
                             "gradient_accumulation_steps is 1, so the engine was built without room to add "
                             "gradients up; set gradient_accumulation_steps to the longest window you use")
        self._boundary = is_boundary

    def open_window(self) -> int | None:
        """``micro_steps`` where the open accumulation window began; None when none is open."""
        return self._window_start[0] if self.phase is Phase.ACCUMULATING else None

    def window_updates_started(self) -> bool:
        """The open window's last backward has started its updates (they run beside backward): its gradients are
        partly applied, and dropping the window would leave Adam's state holding a step that never completes."""
        return self._engine.optimizer.sub_groups_overlapped != self._window_start[1]

    def refuse_writes_over_started_updates(self, what: str, trainable: bool) -> None:
        """Weights of ``trainable`` parameters written once the window's updates have started would be overwritten
        by them, all or some (as each sub-group's update ends), so the step would be lost where torch applies it
        to the weights written (a frozen parameter's write stands)."""
        if trainable and self.phase is Phase.ACCUMULATING and self.window_updates_started():
            raise WriteRefused(f"{what} between the backward that started this window's updates (they run beside "
                               "backward) and engine.step(): the updates would overwrite the weights written; call "
                               "engine.step() first, or write them before that backward")

    def zero_grad(self) -> None:
        self.expect("engine.zero_grad()", Phase.IDLE, Phase.ACCUMULATING)
        if self.phase is Phase.IDLE:
            return
        if self.window_updates_started():
            raise RuntimeError("engine.zero_grad(): this window's updates have started (its last micro-batch's "
                               "backward ran them beside backward), so its gradients are partly applied; call "
                               "engine.step() to finish the step, or load a checkpoint")
        self.discard_window()
        self.micro_steps, self._backward_done, self._refused = self._window_start[0], False, False
        self.phase = Phase.IDLE

    def discard_window(self) -> None:
        """Before a load replaces the state: drops what the accumulation window held, or what a backward or step
        that failed left behind (updates queued, gradients half sent, the error they already raised)."""
        e = self._engine
        for _ in range(3):  # a pending error of the stepper first, then the write-backs its failure left
            try:
                e.optimizer.finish()
                e.grads.wait()
                break
            except Exception as exc:  # noqa: BLE001 - raised once already; the load overwrites what it touched
                log.warning("offload: loading a checkpoint over a failed step (%s: %s)", type(exc).__name__, exc)
        e.optimizer.skip()
        e.optimizer.grads.drop()
        e.grads.new_window()
        e.grads.begin_micro_batch()
        for p in e.layout.params:  # an interrupted backward leaves some: the next would add to them
            p.grad = None

    @contextlib.contextmanager
    def step_refused(self) -> Iterator[None]:
        """An ``engine.gathered()`` block: a step inside it would change the parameters the block holds."""
        self._blocks += 1
        try:
            yield
        finally:
            self._blocks -= 1

    # updates in flight ------------------------------------------------------------------------------------------

    def settle(self) -> None:
        """The last step's updates, finishing beside the next forward (``plan.overlap_forward``), are done."""
        if self._engine._gate is not None:
            self._engine._gate.settle()

    def finish_updates(self) -> None:
        """Every update queued or running is done: the last step's (``settle``) and those queued during a
        backward before its ``step()``. An error of one leaves the engine FAILED: its sub-group is not updated."""
        self.settle()
        try:
            self._engine.optimizer.wait()
        except BaseException as exc:
            self.fail("engine.backward (its updates, run during backward)", exc)
            raise
        self._engine.copies.use_uploads()  # on a GPU their new values may still be on the way to the device

    def updates_failed(self, exc: BaseException) -> None:
        """The update gate's ``on_error``."""
        self.fail("engine.step (its updates, finishing beside the next forward)", exc)

    # backward ---------------------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool) -> torch.Tensor:
        e = self._engine
        self.expect_trainable("engine.backward(loss)")
        self.expect("engine.backward(loss)", Phase.IDLE, Phase.ACCUMULATING)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor")
        self._refused = False
        try:
            check_loss(loss, e.comm, e.world_size, fp16=e.config.fp16.enabled, per_param=e.layout.per_param,
                       at=f"micro-batch {self.micro_steps} (step {self.global_steps})",
                       offloaded=e.weights.params is not None)
        except FloatingPointError:  # nothing ran: a step() after it counts the batch
            self._refused = True
            raise
        e.weights.check_trainable()
        self.settle()  # parameters no forward hook reached, and the gradient slots the updates read
        gas = e.gradient_accumulation_steps
        self._last_micro = self._boundary if self._boundary is not None else self.micro_steps % gas == gas - 1
        divisor = gas if scale_wrt_gas else 1
        first, queued = self.phase is Phase.IDLE, e.optimizer.sub_groups_overlapped
        if first:
            self._window_start = (self.micro_steps, queued)
        self.phase = Phase.BACKWARD
        e.optimizer.begin_backward()
        e.grads.begin_micro_batch()
        if e._reduce is not None:
            e._reduce.begin_micro_batch()
        self._seen_micro.clear()
        if e._heap is not None:
            e._heap.begin_backward()
        params = e.weights.params
        if params is not None:
            params.begin_backward(step_follows=self._last_micro)
        # a reentrant activation checkpoint re-runs forwards inside backward: what they save of a parameter is a
        # reference too, fetched again if the window evicted the parameter before the inner backward reads it
        recompute = params.saved_tensors() if params is not None else contextlib.nullcontext()
        try:
            with recompute:
                (loss.float() * (e.scaler.scale / divisor)).backward()
            if e._reduce is not None:
                e._reduce.end_backward()  # the last buckets reach their owners
            e.grads.end_backward()
        except BaseException as exc:
            self.fail("engine.backward", exc)
            raise
        finally:
            e.optimizer.end_backward()
            if params is not None:
                params.end_backward(step_follows=self._last_micro)
            if self.phase is Phase.FAILED and first and e.optimizer.sub_groups_overlapped == queued and \
                    self.cut_short is None:
                self.discard_window()  # nothing was updated and no earlier micro-batch is lost: start afresh
                self.phase = Phase.IDLE
        self.phase = Phase.ACCUMULATING
        self.micro_steps += 1
        self._backward_done = True
        return loss

    def on_grad(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s gradient is final: to its owner's host buffer (through a reduce bucket with stages
        1-2 on several ranks), then freed."""
        e = self._engine
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
        if e.weights.params is not None:  # before the update can start: a parameter set to land is marked so
            e.weights.params.grad_done(p)
        if e._reduce is not None:  # several ranks, stages 0-2: summed onto the owners bucket by bucket
            e._reduce.add(i, grad)
        else:
            flat = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)  # nn.Embedding(sparse=True)
            if e.layout.per_param:  # stage 3 on several ranks: summed over ranks now, this rank's piece kept
                e.grads.receive(i, e._zero.reduce_param(i, flat), base=e.rank * e.layout.piece[i])
            else:
                e.grads.receive(i, flat)
        self._seen_micro.add(i)
        if e._heap is not None:
            e._heap.add(grad.numel() * grad.element_size())
        p.grad = None  # the device copy is no longer needed (a copy in flight holds it until it has run)

    def sub_group_ready(self, k: int) -> None:
        """Every gradient of sub-group ``k`` has been sent in this micro-batch: start its update now if allowed."""
        if self._engine._plan.overlap and self._last_micro and self.phase is Phase.BACKWARD:
            self._engine.optimizer.submit(k)

    # step -------------------------------------------------------------------------------------------------------

    def step(self) -> None:
        e = self._engine
        self.applied = False  # first: a step() that raises, in its checks too, applied nothing (DeepSpeed's too)
        self.expect_trainable("engine.step()")
        if self._blocks:
            raise RuntimeError("engine.step() inside an engine.gathered() block: the update would change the "
                               "parameters the block holds; step after the block")
        if self._refused and not self._backward_done:  # the loop stepped past a refused batch: it counts, with
            self.expect("engine.step()", Phase.IDLE, Phase.ACCUMULATING)  # no gradient, so the windows keep
            self.micro_steps, self._backward_done = self.micro_steps + 1, True  # ending every gas step()s
        elif self.phase is Phase.IDLE:
            raise RuntimeError("engine.step() called before engine.backward(loss)" if self.micro_steps == 0 else
                               "engine.step() called twice without an engine.backward(loss) in between")
        else:
            self.expect("engine.step()", Phase.ACCUMULATING)
        self._refused = False
        boundary = self.is_boundary()
        self._backward_done = False
        if not boundary:
            return
        if self.phase is Phase.IDLE:  # a window of refused batches only: nothing to update, a skipped step
            self.global_steps += 1
            e.scaler.update(True)
            return
        self.phase = Phase.STEP
        try:
            self._update()
        except FloatingPointError:  # raised before any update: the window's gradients are dropped, state is intact
            self.phase = Phase.IDLE
            raise
        except BaseException as exc:
            self.fail("engine.step", exc)
            raise
        else:
            self.phase = Phase.IDLE
        finally:
            e.grads.new_window()
            totals = self._comm_totals()
            self.last_step_comm = {k: totals[k] - self._comm_mark[k] for k in totals}
            self._comm_mark = totals

    def _update(self) -> None:
        """The optimizer step of a window: its gradient divisor (loss scale, mean over ranks, clipping), fp16's
        overflow skip, the update run, queued or delayed, and the norm taken or left for the updates to sum."""
        e = self._engine
        plan, opt, norm, cfg = e._plan, e.optimizer, e._norm, e.config
        uploads: list[Any] = []
        e.grads.wait()  # every gradient of the window has landed (and an error of its thread surfaces here)
        if plan.delayed:
            opt.finish()  # the previous step's update, which ran beside this forward/backward
            uploads = e.weights.apply_update(e._zero)
        grad_scale = e.scaler.scale * e.world_size  # the kernel divides: the mean over ranks
        norm.new_step()
        # the norm before any update: fp16's overflow check and clipping need it; a delayed update on several ranks
        # would have it only inside the next step's collectives. Otherwise the updates sum it as they run.
        before = cfg.fp16.enabled or cfg.gradient_clipping > 0 or (plan.delayed and e.world_size > 1)
        if before:
            opt.wait()
            value = norm.measure()
            if not math.isfinite(value):
                norm.set(value)
                if cfg.fp16.enabled:
                    opt.skip()
                    self.global_steps += 1  # as DeepSpeed (and the Trainer) count a skipped step: see skipped_steps
                    norm.set(math.inf)  # DeepSpeed's norm of an overflowed step
                    e.scaler.update(True)  # last: at the scale's floor it raises, the step skipped
                    return
                if cfg.gradient_clipping > 0:  # else (a delayed update on several ranks) as the updates would
                    raise FloatingPointError(f"gradient norm is {value} at step {self.global_steps}: the loss or "
                                             "the model produced inf/NaN")
            value /= grad_scale
            norm.set(value)
            clip = cfg.gradient_clipping
            if clip > 0:
                coef = clip / (value + 1e-6)
                if coef < 1.0:
                    grad_scale /= coef
        if plan.delayed:
            opt.launch(grad_scale, wait_first=tuple(uploads))  # runs beside the next forward/backward
            opt.grads.swap()
            e.weights.pending = True
        elif e._gate is not None:
            opt.launch(grad_scale)  # the next forward waits for each sub-group as it reaches it
            e._gate.arm()
        else:
            opt.step(grad_scale=grad_scale)
        if not before:
            norm.summed_by(opt.step_count)
            if e.world_size > 1:  # the updates are done (they end inside the step there): reduced on every rank
                norm.take()
        if e._gate is None:
            e.weights.after_step(e._zero)
        if cfg.fp16.enabled:
            e.scaler.update(False)
        if e.lr_scheduler is not None:  # the next update's lr (the one launched above took its own already)
            with after_engine_update():
                e.lr_scheduler.step()
        self.global_steps += 1
        self.applied = True
