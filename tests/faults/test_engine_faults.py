"""Faults while training with optimizer state (and parameters) on NVMe: injected ENOSPC, EIO and short transfers on
the swap files' writes and reads, and exceptions raised in the swap worker and the optimizer's stepper thread.

Each test trains a small GPT with ``offload.initialize(..., _file_io=Faults())``, saves a checkpoint, arms a fault
during a later step, and checks that (1) the step fails with an error that names the sub-group's key and the swap
file, within a bounded time (no hang), (2) once the fault is cleared, loading the checkpoint into the same engine
and training on ends with parameters and optimizer state bitwise equal to a run that never saw the fault, and
(3) one-off short transfers, which the engine completes, change nothing at all.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

import offload
from _faults import Faults, bounded
from models import batches, lm_loss, make, placement_config

STEPS, SAVED_AT = 6, 3


def config(tmp_path: Path, backend: str = "auto") -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"sub_group_size": 4096,
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                                    "buffer_count": 2}},
        "aio": {"block_size": 1 << 16, "backend": backend},
    }


def step(engine, batch) -> None:
    x, y = batch
    engine.backward(lm_loss(engine(x), y))
    engine.step()


def to_checkpoint(engine, data, ckpt: Path) -> None:
    """The steps before the fault, then the checkpoint a test resumes from."""
    for batch in data[:SAVED_AT]:
        step(engine, batch)
    engine.save_checkpoint(ckpt)


def trained(cfg: dict) -> dict[str, torch.Tensor]:
    """The state after every step, never faulted: what each test's run must end equal to."""
    with offload.initialize(make(), cfg) as engine:
        for batch in batches(STEPS):
            step(engine, batch)
        return state(engine)


@pytest.fixture(scope="module")
def unfaulted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return trained(config(tmp_path_factory.mktemp("unfaulted")))


def state(engine) -> dict[str, torch.Tensor]:
    """Parameters and the full optimizer state, as the checkpoint format sees them."""
    ckpt = engine.save_checkpoint(engine.config.zero_optimization.offload_optimizer.nvme_path + "-final")
    out = {}
    with offload.initialize(make(seed=9), {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) as other:
        other.load_checkpoint(ckpt.parent)
        out.update(other.consolidated_state_dict())
        for k, sg in enumerate(other.layout.sub_groups):
            out[f"state/{k}"] = other.optimizer.read_state(sg).clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


FAULTS = [
    ("write", errno.ENOSPC, errno.ENOSPC),
    ("write", errno.EIO, errno.EIO),
    ("write", ("short", 0), errno.ENOSPC),  # a write that makes no progress: the disk is full
    ("read", errno.EIO, errno.EIO),
    ("read", ("short", 0), errno.EIO),  # the file ends early (truncated)
]


@pytest.mark.parametrize("op, fault, code, backend", [(*f, "aio") for f in FAULTS] +
                         [(*f, "threads") for f in FAULTS if isinstance(f[1], int)])
def test_swap_fault_mid_step_names_key_and_file_and_loses_nothing(tmp_path, unfaulted, backend, op, fault, code):
    data = batches(STEPS)
    faults = Faults()
    ckpt = tmp_path / "ckpt"
    with offload.initialize(make(), config(tmp_path, backend), _file_io=faults) as engine:
        swap_file = str(engine.store._nvme._swap._file.path)
        to_checkpoint(engine, data, ckpt)
        step(engine, data[SAVED_AT])
        faults.arm(op, fault)  # until cleared: every write (or read) of the swap file fails
        with pytest.raises(OSError) as info:
            bounded(lambda: step(engine, data[SAVED_AT + 1]))
        assert faults.hits[op] >= 1
        err = info.value
        assert err.errno == code and err.filename == swap_file, err
        assert re.search(rf"{op} of key 'adam/\d+/\d+' failed", str(err)), err
        faults.disarm()
        assert bounded(lambda: engine.load_checkpoint(ckpt))[0].name == f"step{SAVED_AT}"
        for batch in data[SAVED_AT:]:
            bounded(lambda: step(engine, batch))
        assert_same(state(engine), unfaulted)


def test_a_step_whose_swap_writes_fail_raises_once(tmp_path):
    """Parameters and optimizer on NVMe, the disk's writes failing (ENOSPC) mid-window: the step raises the error
    once, and never again ``close()`` (or a ``with`` block's exit) once the disk works; the swap files go."""
    faults = Faults()
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "gradient_accumulation_steps": 2,
           "gradient_clipping": 0.5, "aio": {"block_size": 1 << 16},
           "zero_optimization": {"stage": 3, "sub_group_size": 8192, "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "swap")}}}
    engine = offload.initialize(make(d=96), cfg, _file_io=faults)
    try:
        faults.arm("write", errno.ENOSPC)
        with pytest.raises(OSError) as info:
            bounded(lambda: [step(engine, batch) for batch in batches(4)])
        assert info.value.errno == errno.ENOSPC and engine.phase is offload.Phase.FAILED
    finally:
        faults.disarm()
        engine.close()
    assert engine.phase is offload.Phase.CLOSED and not any((tmp_path / "swap").rglob("swap.*"))


@pytest.mark.parametrize("op", ["write", "read"])
def test_one_off_short_transfers_are_completed_transparently(tmp_path, unfaulted, op):
    faults = Faults()
    with offload.initialize(make(), config(tmp_path), _file_io=faults) as engine:
        for i, batch in enumerate(batches(STEPS)):
            if i >= 1:
                faults.arm(op, ("short", 4096), times=3)  # three calls per step come up one page long
            bounded(lambda: step(engine, batch))
        assert faults.hits[op] >= 3
        assert_same(state(engine), unfaulted)


class WorkerBug(RuntimeError):
    pass


def test_exception_in_swap_worker_surfaces_at_next_wait(tmp_path, unfaulted):
    data = batches(STEPS)
    faults = Faults()
    ckpt = tmp_path / "ckpt"
    with offload.initialize(make(), config(tmp_path), _file_io=faults) as engine:
        to_checkpoint(engine, data, ckpt)
        faults.arm("read", WorkerBug("injected bug in the swap worker"), times=1)
        with pytest.raises(WorkerBug, match="injected bug in the swap worker"):
            bounded(lambda: step(engine, data[SAVED_AT]))
        engine.load_checkpoint(ckpt)
        for batch in data[SAVED_AT:]:
            bounded(lambda: step(engine, batch))
        assert_same(state(engine), unfaulted)


@pytest.mark.parametrize("fail_at", [1, 4, 7])
def test_exception_in_stepper_thread_surfaces_at_next_wait(tmp_path, unfaulted, monkeypatch, fail_at):
    from offload.optim import offloaded

    data = batches(STEPS)
    ckpt = tmp_path / "ckpt"
    real = offloaded.adam_step
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise WorkerBug("injected bug in the optimizer thread")
        return real(*args, **kwargs)

    with offload.initialize(make(), config(tmp_path)) as engine:
        to_checkpoint(engine, data, ckpt)
        monkeypatch.setattr(offloaded, "adam_step", failing_once)
        with pytest.raises(WorkerBug, match="optimizer thread"):
            bounded(lambda: step(engine, data[SAVED_AT]))
        assert [t for t in threading.enumerate() if t.name == "offload-stepper"]  # still serving
        engine.load_checkpoint(ckpt)
        for batch in data[SAVED_AT:]:
            bounded(lambda: step(engine, batch))
        assert_same(state(engine), unfaulted)


def test_stepper_error_inside_backward_then_a_load_loses_nothing(tmp_path, unfaulted, monkeypatch):
    """Gradients in sub-group slots: backward waits for a queued update to free a slot, so an error of that update
    surfaces inside backward. Loading a checkpoint right after (no step in between) drops the failed window
    (updates queued, gradients half sent, the error), and training on equals the run that never failed."""
    from offload.optim import offloaded

    data = batches(STEPS)
    ckpt = tmp_path / "ckpt"
    real, calls = offloaded.adam_step, {"n": 0}

    def slow_failure_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(0.5)  # backward fills the other slots meanwhile, then waits for this one
            raise WorkerBug("injected bug in the optimizer thread")
        return real(*args, **kwargs)

    with offload.initialize(make(), config(tmp_path)) as engine:
        assert engine.plan().grad_slots
        to_checkpoint(engine, data, ckpt)
        monkeypatch.setattr(offloaded, "adam_step", slow_failure_once)
        x, y = data[SAVED_AT]
        waits = engine.stats()["gradient_buffers"]["waits"]
        with pytest.raises(WorkerBug, match="optimizer thread"):
            bounded(lambda: engine.backward(lm_loss(engine(x), y)))
        assert engine.stats()["gradient_buffers"]["waits"] == waits + 1
        for refused in (engine.step, lambda: engine.save_checkpoint(tmp_path / "bad")):  # state is half updated
            with pytest.raises(RuntimeError, match=r"engine.backward raised WorkerBug.*load a checkpoint"):
                refused()
        assert not (tmp_path / "bad").exists()
        assert bounded(lambda: engine.load_checkpoint(ckpt))[0].name == f"step{SAVED_AT}"
        for batch in data[SAVED_AT:]:
            bounded(lambda: step(engine, batch))
        assert_same(state(engine), unfaulted)


def test_swap_file_altered_behind_the_engine_fails_the_step_then_resumes(tmp_path, unfaulted):
    data = batches(STEPS)
    ckpt = tmp_path / "ckpt"
    with offload.initialize(make(), config(tmp_path)) as engine:
        to_checkpoint(engine, data, ckpt)
        swap = engine.store._nvme._swap
        key = swap.keys()[1]
        fd = os.open(swap._file.path, os.O_RDWR)
        try:
            offset = swap._index[key].extent.offset + 1000
            os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 1]), offset)  # one bit of one moment flipped
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(OSError, match=f"read of key '{key}' failed: checksum mismatch") as info:
            bounded(lambda: step(engine, data[SAVED_AT]))
        assert info.value.errno == errno.EBADMSG and info.value.filename == str(swap._file.path)
        engine.load_checkpoint(ckpt)  # rewrites every sub-group's state
        for batch in data[SAVED_AT:]:
            bounded(lambda: step(engine, batch))
        assert_same(state(engine), unfaulted)


def params_config(tmp_path: Path) -> dict:
    """Parameters homed on NVMe as well, through a window small enough that forward and backward both read."""
    cfg = config(tmp_path)
    cfg["zero_optimization"].update(stage=3, offload_param={"device": "nvme", "nvme_path": str(tmp_path / "params")},
                                    stage3_max_live_parameters=8000, stage3_prefetch_bucket_size=2000,
                                    stage3_param_persistence_threshold=100)
    return cfg


@pytest.fixture(scope="module")
def unfaulted_params(tmp_path_factory) -> dict[str, torch.Tensor]:
    return trained(params_config(tmp_path_factory.mktemp("unfaulted_params")))


def test_parameter_read_fault_fails_the_forward_then_the_same_batch_trains_on(tmp_path, unfaulted_params):
    """A read of a parameter's home fails in forward: the forward raises naming the key and the file; reads that
    were prefetched while the disk failed are read again by the next forward (not failed for a fault now gone),
    and training on from the same batch equals the run that never failed; nothing to reload."""
    data = batches(STEPS)
    faults = Faults()
    with offload.initialize(make(), params_config(tmp_path), _file_io=faults) as engine:
        swap_file = str(engine.weights.params.homes.space._swap._file.path)
        for batch in data[:SAVED_AT]:
            step(engine, batch)
        faults.arm("read", errno.EIO)
        with pytest.raises(OSError) as info:
            bounded(lambda: engine(data[SAVED_AT][0]))
        assert info.value.errno == errno.EIO and info.value.filename == swap_file
        assert re.search(r"read of key 'param/\d+/\d+' failed", str(info.value)), info.value
        faults.disarm()
        for batch in data[SAVED_AT:]:
            bounded(lambda: step(engine, batch))
        assert engine.stats()["params"]["refetched"] >= 1
        assert_same(state(engine), unfaulted_params)


def test_parameter_read_fault_in_backward_then_a_load_loses_nothing(tmp_path, unfaulted_params):
    data = batches(STEPS)
    faults = Faults()
    ckpt = tmp_path / "ckpt"
    with offload.initialize(make(), params_config(tmp_path), _file_io=faults) as engine:
        to_checkpoint(engine, data, ckpt)
        x, y = data[SAVED_AT]
        loss = lm_loss(engine(x), y)
        faults.arm("read", errno.EIO)
        with pytest.raises(OSError, match=r"read of key '(param|adam)/\d+/\d+' failed"):
            bounded(lambda: engine.backward(loss))
        faults.disarm()
        assert bounded(lambda: engine.load_checkpoint(ckpt))[0].name == f"step{SAVED_AT}"
        for batch in data[SAVED_AT:]:
            bounded(lambda: step(engine, batch))
        assert_same(state(engine), unfaulted_params)


class StickyDeviceError(RuntimeError):
    pass


def test_close_after_the_device_fails_still_removes_files_threads_and_hooks(tmp_path, monkeypatch):
    """A GPU left in a sticky error state (a device-side assert in the model) fails every later synchronize.
    close() still runs every step of its teardown: the swap files are removed, the threads joined, the hooks
    taken off the model; then the device's error is raised."""
    model = make()
    cfg = params_config(tmp_path)
    engine = offload.initialize(model, cfg)
    step(engine, batches(1)[0])

    def broken() -> None:
        raise StickyDeviceError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(engine.copies, "synchronize", broken)
    with pytest.raises(StickyDeviceError):
        engine.close()
    for path in (tmp_path / "nvme", tmp_path / "params"):
        assert not [f for f in path.rglob("*") if f.is_file()], path
    assert not [t for t in threading.enumerate() if t.name.startswith(("offload", "nvme_swapper"))]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("placement", ["opt-nvme", "params-nvme", "all-nvme"])
def test_a_disk_failure_midway_through_initialize_says_what_it_left_of_the_model(tmp_path, placement):
    """Budgets are checked before any parameter moves; a disk failing after some have moved (bf16: their fp32
    values rounded as they went) cannot be undone, so the error says which and how they are left, and the rest of
    the model is untouched. Found with bare errors: the model silently half bf16, and a failed space reservation
    that named no file."""
    model = make()
    given = {n: (p.dtype, p.device, p.detach().clone()) for n, p in model.named_parameters()}
    faults = Faults()
    # the swap files' headers and space reservations (one more with parameter homes on NVMe), then the first homes
    # or state
    faults.arm("write", errno.EIO, times=None, after=4 + (placement == "all-nvme"))
    with pytest.raises(OSError, match=r"write of key '(param|adam)/.*' failed: Input/output error") as info:
        offload.initialize(model, placement_config(tmp_path, placement, bf16={"enabled": True}), _file_io=faults)
    moved = [n for n, p in model.named_parameters() if (p.dtype, p.device) != given[n][:2]]
    assert 0 < len(moved) < len(given)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert f"initialize had moved {len(moved)} of {len(given)} parameters ({moved[0]}" in note, note
    assert "torch.bfloat16" in note and "rounded" in note and "reload the model's weights" in note, note
    for name, p in model.named_parameters():
        dtype, _, value = given[name]
        expected = value.to(torch.bfloat16) if name in moved else value
        assert torch.equal(p.detach().cpu(), expected), name
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]
