"""Ctrl-C (SIGINT) during engine calls, as a notebook user sends it: one is held until the call returns, so the
engine stays consistent and training on matches torch's AdamW on an un-offloaded copy; a second cuts the call
short and leaves the engine failed, until a checkpoint is loaded; a close cut short is finished by the next; a save
interrupted after ``latest`` named it stays loadable. Engines run on the machine's device (tests/models.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import offload
from offload import _state
from offload.engine import _engine
from offload.engine._interrupts import FORCED, HeldInterrupts
from offload.persist import _save
from models import (batches, close_enough, lm_loss, make, on_device, placement_config, reference_model,
                    train_steps)

STEPS = 6


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler for the test (a test runner's worker may have another), restored after."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def reference(data):
    """torch's AdamW on an un-offloaded copy, the lr and decay of placement_config."""
    model = reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for x, y in data:
        opt.zero_grad()
        lm_loss(model(on_device(x)), y).backward()
        opt.step()
    return model


def ctrl_c(times: int = 1) -> None:
    for _ in range(times):
        signal.raise_signal(signal.SIGINT)


class CtrlCInBackward(torch.autograd.Function):
    """The identity, whose backward presses Ctrl-C: inside engine.backward, between the engine's hooks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctrl_c()
        return g


def pressing_in(obj, name: str, times: int):
    """Wraps ``obj.name`` so that its next call presses Ctrl-C ``times`` times first."""
    original = getattr(obj, name)

    def pressed(*args, **kwargs):
        setattr(obj, name, original)
        ctrl_c(times)
        return original(*args, **kwargs)

    setattr(obj, name, pressed)


@pytest.mark.parametrize("placement", ["opt-nvme", "all-nvme"])
def test_one_ctrl_c_lands_after_the_call_and_training_goes_on_exactly(tmp_path, placement):
    """Ctrl-C inside a backward and inside a step: each call finishes first, then raises KeyboardInterrupt; the
    loop caught it and went on, as a notebook cell run again does, and ends where torch's AdamW ends."""
    data = batches(STEPS)
    model = make()
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        for i, (x, y) in enumerate(data):
            loss = lm_loss(engine(x), y)
            if i == 1:
                with pytest.raises(KeyboardInterrupt):
                    engine.backward(CtrlCInBackward.apply(loss))
                assert engine.phase is _engine.Phase.ACCUMULATING and engine.micro_steps == 2
            else:
                engine.backward(loss)
            if i == 3:
                pressing_in(engine.grads, "wait", 1)
                with pytest.raises(KeyboardInterrupt):
                    engine.step()
                assert engine.phase is _engine.Phase.IDLE and engine.global_steps == 4
            else:
                engine.step()
        state = engine.consolidated_state_dict()
    for name, r in reference(data).named_parameters():
        close_enough(state[name], r.detach(), 1e-5)


@pytest.mark.parametrize("placement", ["opt-host", "all-nvme"])
def test_one_ctrl_c_in_a_plain_model_forward_lands_after_it(tmp_path, placement):
    """A loop that calls the model itself, not engine(x): a Ctrl-C in the middle of its forward (between the
    engine's fetches of the blocks' parameters) lands when the whole forward has run, and the loop, running that
    forward again, ends where torch's AdamW ends. Then a forward that raises an error of its own gives SIGINT back."""
    data = batches(STEPS)
    model = make()
    reached_the_head = []
    model.head.register_forward_hook(lambda *_: reached_the_head.append(True))
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        for i, (x, y) in enumerate(data):
            if i == 2:
                press = model.blocks[0].register_forward_pre_hook(lambda *_: ctrl_c())
                reached_the_head.clear()
                with pytest.raises(KeyboardInterrupt):
                    model(on_device(x))
                press.remove()
                assert reached_the_head  # the forward ran to its end before the interrupt surfaced
            engine.backward(lm_loss(model(on_device(x)), y))
            engine.step()
        def fails(*_):
            raise ValueError("a forward of the user's that fails")

        failing = model.blocks[1].register_forward_pre_hook(fails)
        with pytest.raises(ValueError, match="that fails"):
            model(on_device(x))
        failing.remove()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        state = engine.consolidated_state_dict()
    for name, r in reference(data).named_parameters():
        close_enough(state[name], r.detach(), 1e-5)


def test_a_second_ctrl_c_cuts_the_step_short_and_a_new_engine_loads_the_checkpoint(tmp_path):
    """Two presses inside a step: the second raises at once. The engine's own records may be half changed, which
    no load rebuilds, so every call but close() is refused naming the interrupt; close() frees everything, and a
    new engine loading the checkpoint before it ends where torch's AdamW ends."""
    data = batches(STEPS)
    model = make()
    engine = offload.initialize(model, placement_config(tmp_path, "all-nvme"))
    for i, (x, y) in enumerate(data[:3]):
        engine.backward(lm_loss(engine(x), y))
        if i == 2:
            pressing_in(engine.grads, "wait", 2)
            with pytest.raises(KeyboardInterrupt):
                engine.step()
        else:
            engine.step()
        if i == 1:
            engine.save_checkpoint(tmp_path / "ckpt", tag="two")
    assert engine.phase is _engine.Phase.FAILED
    refused = "a second Ctrl-C cut engine.step short.*close\\(\\) it"
    with pytest.raises(RuntimeError, match=refused):
        engine(data[3][0])
    with pytest.raises(RuntimeError, match=refused):
        engine.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=refused):  # it would read the records the interrupt left
        engine.consolidated_state_dict()
    engine.close()
    assert not os.listdir(tmp_path / "offload_param") and not os.listdir(tmp_path / "offload_optimizer")
    with offload.initialize(make(seed=5), placement_config(tmp_path, "all-nvme")) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        for x, y in data[2:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        state = engine.consolidated_state_dict()
    for name, r in reference(data).named_parameters():
        close_enough(state[name], r.detach(), 1e-5)


def test_a_second_ctrl_c_inside_a_parameters_release_leaves_close_to_free_everything(tmp_path):
    """Two presses while a stage-3 forward releases a parameter (its record half changed): the forward raises,
    the engine refuses to go on, and close() still stops every thread and removes every swap file."""
    model = make()
    engine = offload.initialize(model, placement_config(tmp_path, "all-nvme", live=8_000, bucket=4_000))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    pressing_in(engine.weights.params.window, "_released", 2)
    with pytest.raises(KeyboardInterrupt):
        engine(x)
    with pytest.raises(RuntimeError, match="a second Ctrl-C cut the forward short"):
        engine.backward(lm_loss(engine(x), y))
    try:
        engine.close()
    except Exception as exc:  # noqa: BLE001 - a hand-back that found a half-changed record says so
        assert "a second Ctrl-C had cut the forward short" in str(exc) + "".join(getattr(exc, "__notes__", []))
    assert not _state.is_open(engine)
    assert not os.listdir(tmp_path / "offload_param") and not os.listdir(tmp_path / "offload_optimizer")


def engine_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("offload", "nvme_swapper")))


def pressing_while_built(monkeypatch, name: str, times: int) -> None:
    """The next ``name`` the engine's build makes (a class in _engine's namespace) presses Ctrl-C once it is
    made (its threads started), before the engine keeps it."""
    original = getattr(_engine, name)

    def pressed(*args, **kwargs):
        monkeypatch.setattr(_engine, name, original)
        made = original(*args, **kwargs)
        ctrl_c(times)
        return made

    monkeypatch.setattr(_engine, name, pressed)


@pytest.mark.parametrize("placement", ["opt-host", "all-nvme"])
def test_one_ctrl_c_during_initialize_stops_the_build_and_frees_everything(tmp_path, monkeypatch, placement):
    """A press as initialize's optimizer is made (its thread started), before the engine keeps it: the build
    goes on to its next part, stops, and its cleanup runs whole: no thread, swap file or hook is left, the model
    has its own values, and a new engine on it trains as torch's AdamW does. (Before, the press landed inside a
    part: in one soak a third of the builds left the optimizer's thread running, some left swap files, fds and
    I/O threads.)"""
    model = make()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    threads = engine_threads()
    pressing_while_built(monkeypatch, "OffloadedAdam", 1)
    with pytest.raises(KeyboardInterrupt):
        offload.initialize(model, placement_config(tmp_path, placement))
    assert engine_threads() == threads and _state.holding(model) is None
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert all(torch.equal(p, original[n]) for n, p in model.named_parameters())
    data = batches(3)
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        train_steps(engine, data)
        state = engine.consolidated_state_dict()
    for name, r in reference(data).named_parameters():
        close_enough(state[name], r.detach(), 1e-5)


def test_a_flag_setting_handler_of_the_users_lets_initialize_finish(tmp_path, monkeypatch):
    """A SIGINT handler of the user's that only sets a flag (a graceful stop at the next step): a press during
    initialize reaches it once the build is done, and the build is not stopped."""
    pressed = []
    signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    pressing_while_built(monkeypatch, "OffloadedAdam", 1)
    with offload.initialize(make(), placement_config(tmp_path, "opt-nvme")) as engine:
        assert pressed == [True]
        train_steps(engine, batches(1))


def test_a_cleanup_of_initialize_cut_short_is_finished_by_the_next_initialize(tmp_path, monkeypatch):
    """Two presses in the build cut it short, two more cut its cleanup short while the parameters are handed
    back: the model is left holding placeholders, and the cleanup is kept. The next initialize on that model
    finishes it first, so the model trains from its own values (before, it trained on NaN placeholders)."""
    model = make()
    threads = engine_threads()
    weights, original_close = _engine.Weights, _engine.Weights.close
    pressed = []

    def close_pressed(self):  # (the cleanup kept is this bound method: it presses once)
        if not pressed:
            pressed.append(True)
            ctrl_c(2)
        return original_close(self)

    monkeypatch.setattr(weights, "close", close_pressed)
    pressing_while_built(monkeypatch, "GradientStream", 2)  # the parameters are in their homes by then
    with pytest.raises(KeyboardInterrupt):
        offload.initialize(model, placement_config(tmp_path, "all-nvme"))
    assert _state.holding(model) is not None  # its cleanup is kept, to be finished
    data = batches(3)
    with offload.initialize(model, placement_config(tmp_path, "all-nvme")) as engine:
        train_steps(engine, data)
        state = engine.consolidated_state_dict()
    for name, r in reference(data).named_parameters():
        close_enough(state[name], r.detach(), 1e-5)
    assert engine_threads() == threads and [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_close_cut_short_is_finished_by_the_next_close(tmp_path):
    """Two presses while close() joins the swap engine's threads: it raises with the swap files, their threads
    and the engine among those closed at exit still there; the next close() removes them all."""
    model = make()
    engine = offload.initialize(model, placement_config(tmp_path, "opt-nvme"))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    swap = engine.store._nvme._swap
    pressing_in(swap._workers, "close", 2)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert engine.phase is _engine.Phase.CLOSED and _state.is_open(engine)
    assert swap.directory.exists()
    assert any(t.name.startswith("nvme_swapper") for t in threading.enumerate())
    engine.close()
    assert not _state.is_open(engine)
    assert not swap.directory.exists() and not os.listdir(tmp_path / "offload_optimizer")
    with torch.no_grad():
        assert torch.isfinite(model(on_device(x))).all()  # the model is handed back with its trained weights


def test_a_save_interrupted_after_latest_named_it_stays_loadable(tmp_path, monkeypatch):
    """A KeyboardInterrupt right after ``latest`` was replaced: the save is committed, so its folder stays."""
    model = make()
    data = batches(2)
    replace = os.replace

    def then_interrupted(src, dst, *args, **kwargs):
        replace(src, dst, *args, **kwargs)
        if os.path.basename(dst) == "latest":
            raise KeyboardInterrupt

    with offload.initialize(model, placement_config(tmp_path, "opt-host")) as engine:
        for x, y in data:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        monkeypatch.setattr(_save.os, "replace", then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.save_checkpoint(tmp_path / "ckpt", tag="saved")
        monkeypatch.setattr(_save.os, "replace", replace)
        saved = engine.consolidated_state_dict()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "saved"
    with offload.initialize(make(seed=3), placement_config(tmp_path, "opt-host")) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine.global_steps == 2
        loaded = engine.consolidated_state_dict()
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k


def test_a_close_cut_short_while_handing_parameters_back_hands_them_all_back_next_time(tmp_path):
    """Two presses while close() reads the parameters back from NVMe (its slow part): nothing it reads from is
    freed, and the next close() hands every parameter back with its trained value."""
    model = make()
    engine = offload.initialize(model, placement_config(tmp_path, "all-nvme"))
    for x, y in batches(2):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    want = {k: v.to(torch.float32) for k, v in engine.consolidated_state_dict().items()}
    pressing_in(engine.weights.params, "read_home", 2)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert _state.is_open(engine)
    engine.close()
    assert not _state.is_open(engine) and not os.listdir(tmp_path / "offload_param")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().float().cpu(), want[name].cpu()), name


def test_a_handler_of_the_users_gets_both_presses_and_the_call_goes_on(tmp_path):
    """A handler that only sets a flag (a graceful stop) sees both signals; the call finishes and the engine is
    not failed, so the loop can save and stop."""
    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    model = make()
    x, y = batches(1)[0]
    with offload.initialize(model, placement_config(tmp_path, "opt-nvme")) as engine:
        pressing_in(engine.grads, "wait", 2)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        assert seen == [signal.SIGINT, signal.SIGINT] and engine.phase is _engine.Phase.IDLE
        engine.save_checkpoint(tmp_path / "ckpt")


def test_the_second_press_gives_sigint_back_at_once():
    """Whenever the second press comes (inside the call, or as the call returns), the handler is Python's again
    from then on, so no later call is left holding it."""
    forced = []
    held = HeldInterrupts(lambda: forced.append(True))
    held.__enter__()
    recorder = signal.getsignal(signal.SIGINT)
    recorder(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt, match=FORCED):
        recorder(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and forced == [True]
    held.__exit__(None, None, None)  # nothing left to deliver
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
