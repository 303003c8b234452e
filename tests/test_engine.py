"""The engine with offloaded optimizer state, against independent references: torch.optim.AdamW on an un-offloaded
copy (fp32), and mixed-precision loops written here with fp32 master weights (bf16, fp16). Engines train on the
machine's device (CUDA when present), and the references run there too (tests/models.py)."""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import gc
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest.mock
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import offload
import offload.plan
from offload.memory._heap import HeapTrim, available as heap_trim_available
from models import (DEVICE, PLACEMENTS, bag_batches, bag_loss, batches, close_enough, lazy_adamw_reference, lm_loss,
                    make, make_bag, on_device, placement_config, reference_model, train_steps)

LR, WD = 3e-3, 0.01


def config(tmp_path: Path, device: str, **extra) -> dict:
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.99], "eps": 1e-8}},
        "zero_optimization": {"sub_group_size": 4096,
                              "offload_optimizer": {"device": device, "nvme_path": str(tmp_path / "nvme")}},
        "aio": {"block_size": 1 << 16},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


@pytest.fixture(params=["direct", "staged"])
def gradients(request, monkeypatch) -> str:
    """How gradients reach the host: "staged" runs the CUDA path's buckets (device staging buffers of 1000
    elements, landing buffers and accumulation on the optimizer thread) on any machine; "direct" is the CPU's
    own path (on CUDA both are staged)."""
    if request.param == "staged":
        monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
        monkeypatch.setattr(offload.plan, "GRAD_BUCKET", 1000)
    return request.param


def train(engine, data, gas: int = 1) -> list[float]:
    losses = []
    for i in range(0, len(data), gas):
        for x, y in data[i : i + gas]:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def reference_fp32(steps: int, data, gas: int = 1, clip: float = 0.0, norms: list[float] | None = None,
                   loss_scale: float = 1.0):
    """torch's AdamW on an un-offloaded copy; ``norms`` gets each step's gradient norm (in float64)."""
    model = reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for i in range(0, steps * gas, gas):
        opt.zero_grad()
        for x, y in data[i : i + gas]:
            (lm_loss(model(on_device(x)), y) * loss_scale / gas).backward()
        if norms is not None:
            norms.append(math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters())))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


@pytest.mark.parametrize("kind, adam_w_mode, reference", [
    ("Adam", None, torch.optim.AdamW), ("Adam", False, torch.optim.Adam), ("AdamW", False, torch.optim.AdamW)])
def test_adam_types_decay_as_deepspeed_reads_them(tmp_path, kind, adam_w_mode, reference):
    """A DeepSpeed config's optimizer type as DeepSpeed trains it: "Adam" decouples the weight decay (AdamW) unless
    adam_w_mode is false, where it adds it to the gradient (torch's Adam); "AdamW" always decouples it."""
    data = batches(4)
    cfg = config(tmp_path, "cpu")
    cfg["optimizer"]["type"] = kind
    cfg["optimizer"]["params"]["weight_decay"] = 0.1
    if adam_w_mode is not None:
        cfg["optimizer"]["params"]["adam_w_mode"] = adam_w_mode
    with offload.initialize(make(), cfg) as engine:
        train(engine, data)
        got = engine.consolidated_state_dict()
    model = reference_model()
    opt = reference(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)
    for x, y in data:
        lm_loss(model(on_device(x)), y).backward()
        opt.step()
        opt.zero_grad()
    for k, r in model.state_dict().items():
        close_enough(got[k], r, 1e-5)


@pytest.mark.parametrize("device", ["none", "cpu", "nvme", "cpu, overlap_forward"])
def test_fp32_matches_torch_adamw(tmp_path, device, gradients):
    data = batches(20)
    model = make()
    device, _, beside = device.partition(", ")
    cfg = config(tmp_path, device)
    cfg["zero_optimization"]["offload_optimizer"]["overlap_forward"] = bool(beside)
    with offload.initialize(model, cfg) as engine:
        assert engine.plan().overlap_forward is bool(beside)
        assert len(engine.layout.sub_groups) > 3  # parameters straddle sub-groups
        train(engine, data)
        state = engine.consolidated_state_dict()
        staged = engine.plan().grad_staging
        assert staged == (device != "none" and (gradients == "staged" or DEVICE.type == "cuda"))
        assert (engine.stats()["gradient_copies"]["buckets"] > 0) == staged
        trims = engine.stats()["heap_trims"]  # on by default where autograd's tensors live in the C heap
        # two a backward: at its start and at half its gradient bytes
        assert (trims["trims"] == 2 * 20 if DEVICE.type == "cpu" and heap_trim_available() else trims is None)
    ref = reference_fp32(20, data)
    for (name, p), (rname, r) in zip(model.named_parameters(), ref.named_parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)
        close_enough(state[name], r.detach(), 1e-5)
    assert torch.equal(state["head.weight"], state["tok.weight"])  # tied weights stay one tensor
    assert not list((tmp_path / "nvme").glob("*")) if device == "nvme" else True


@pytest.mark.parametrize("gas, clip", [(4, 0.0), (1, 0.05), (2, 0.05)])
def test_accumulation_and_clipping_match_torch(tmp_path, gas, clip, gradients):
    data = batches(6 * gas)
    model = make()
    cfg = config(tmp_path, "nvme", gradient_accumulation_steps=gas, gradient_clipping=clip)
    with offload.initialize(model, cfg) as engine:
        for m, (x, y) in enumerate(data):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            assert engine.was_step_applied() is ((m + 1) % gas == 0)  # DeepSpeed's: no update between boundaries
        assert engine.global_steps == 6 and engine.micro_steps == 6 * gas
        if clip:
            assert engine.last_grad_norm > clip  # clipping was active
    ref = reference_fp32(6, data, gas, clip)
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)


@pytest.mark.parametrize("device, gas", [("none", 1), ("cpu", 1), ("nvme", 2), ("cpu, overlap_forward", 1),
                                         ("cpu, overlap_step false", 2)])
def test_grad_norm_without_clipping_matches_torch(tmp_path, device, gas, gradients):
    """Without clipping or fp16 the updates sum the gradient norm as they run (the CPU Adam kernel squares the
    gradients it reads; with the state on the device, "staged", the CUDA path's fused update sums it there):
    ``last_grad_norm`` is each step's global norm all the same. With the updates still running beside the next
    forward, reading it waits for them; a step nobody read is known after close."""
    data = batches(5 * gas)
    device, _, variant = device.partition(", ")
    cfg = config(tmp_path, device, gradient_accumulation_steps=gas)
    cfg["zero_optimization"]["offload_optimizer"].update(overlap_forward=variant == "overlap_forward",
                                                         overlap_step=variant != "overlap_step false")
    norms: list[float] = []
    with offload.initialize(make(), cfg) as engine:
        assert engine.plan().overlap is (variant != "overlap_step false")
        assert engine.plan().overlap_forward is (variant == "overlap_forward")
        for i in range(0, len(data), gas):
            train(engine, data[i : i + gas], gas)
            if i + gas < len(data):
                norms.append(engine.last_grad_norm)
    norms.append(engine.get_global_grad_norm())  # the last step's, read after close (DeepSpeed's name)
    want: list[float] = []
    reference_fp32(5, data, gas, norms=want)
    assert norms == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("case", ["delayed", "fp32 squares overflow"])
def test_grad_norm_of_delayed_updates_and_of_huge_gradients(tmp_path, case):
    """The delayed update sums the norm beside the next step, and ``last_grad_norm`` waits for it: it equals the
    norm clipping computes before the update (a limit of 1e30 computes it and clips nothing). Gradients whose
    squares overflow fp32 (a loss times 1e22) are summed again in float64 by the update that saw inf."""
    data = batches(4)
    scale = 1e22 if case == "fp32 squares overflow" else 1.0
    runs = []
    for clip in (0.0, 1e30):
        cfg = config(tmp_path, "cpu", gradient_clipping=clip)
        cfg["zero_optimization"]["offload_optimizer"]["delayed_update"] = case == "delayed"
        norms = []
        with offload.initialize(make(), cfg) as engine:
            for x, y in data:
                engine.backward(lm_loss(engine(x), y) * scale)
                engine.step()
                norms.append(engine.last_grad_norm)
        runs.append(norms)
    assert all(math.isfinite(n) for n in runs[0]), runs[0]
    assert runs[0] == pytest.approx(runs[1], rel=1e-5)
    if case != "delayed":
        want: list[float] = []
        reference_fp32(4, data, norms=want, loss_scale=scale)
        # torch's AdamW on CUDA squares a gradient before weighting it (fma(1 - beta2, g * g, v)), so at these
        # gradients its second moment overflows to inf where the CPU Adam kernel's ((1 - beta2) * g) * g (and
        # torch's on the CPU) does not: there its trajectory leaves ours after the first update
        steps = len(want) if DEVICE.type == "cpu" else 1
        assert runs[0][:steps] == pytest.approx(want[:steps], rel=1e-5)
    else:  # each step's norm is that of its stale gradient (taken at the parameters of two updates before)
        stale: list[float] = []
        reference_delayed(4, data, norms=stale)
        assert runs[0] == pytest.approx(stale, rel=1e-5)


def test_grad_norm_after_loading_an_earlier_checkpoint(tmp_path):
    """Steps taken again after a load count their norms afresh (the sums of the steps run before the load are
    forgotten), and right after the load the norm is unknown."""
    data = batches(4)
    cfg = config(tmp_path, "cpu")
    cfg["zero_optimization"]["offload_optimizer"]["overlap_forward"] = True
    with offload.initialize(make(), cfg) as engine:
        norms, again = [], []
        for i, (x, y) in enumerate(data):
            if i == 2:
                engine.save_checkpoint(tmp_path / "ckpt")
            train(engine, [(x, y)])
            norms.append(engine.last_grad_norm)
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine.last_grad_norm is None
        for x, y in data[2:]:
            train(engine, [(x, y)])
            again.append(engine.last_grad_norm)
    assert again == pytest.approx(norms[2:], rel=1e-6)


def reference_mixed(dtype: torch.dtype, steps: int, data, scale: float = 1.0):
    """Mixed precision by hand: the model in ``dtype``, fp32 master weights updated by torch's AdamW, gradients
    unscaled in fp32, the model's weights re-rounded from the masters after each step."""
    model = reference_model()
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    model.to(dtype)
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for x, y in data[:steps]:
        (lm_loss(model(on_device(x)), y) * scale).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float() / scale
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return model, masters


@pytest.mark.parametrize("dtype, device", [(torch.bfloat16, "cpu"), (torch.bfloat16, "nvme"),
                                           (torch.float16, "cpu"), (torch.float16, "nvme")])
def test_mixed_precision_matches_reference_loop(tmp_path, dtype, device, gradients):
    data = batches(20)
    model = make()
    extra = {"bf16": {"enabled": True}} if dtype == torch.bfloat16 else \
        {"fp16": {"enabled": True, "loss_scale": 1024.0}}
    with offload.initialize(model, config(tmp_path, device, **extra)) as engine:
        train(engine, data)
        state = engine.consolidated_state_dict()
        assert all(p.dtype == dtype for p in model.parameters())
    ref_model, masters = reference_mixed(dtype, 20, data, scale=1024.0 if dtype == torch.float16 else 1.0)
    names = [n for n, _ in ref_model.named_parameters()]
    for name, m in zip(names, masters):  # cuBLAS picks its low-precision GEMM kernels by layout: 1.3e-4 seen on an H200
        close_enough(state[name], m.detach(), 1e-4 if DEVICE.type == "cpu" else 3e-4)
    for name, p in model.named_parameters():  # the weights trained with are the masters rounded, bit for bit
        assert torch.equal(p.detach().cpu(), state[name].to(dtype)), name


def test_a_load_keeps_the_loss_scale_of_this_engines_precision(tmp_path):
    """The loss scale a checkpoint holds comes back only where both runs scale fp16 losses dynamically: a bf16
    engine loading an fp16 checkpoint stays unscaled, an fp16 engine loading a bf16 (or a fixed-scale) one starts at
    its own configured scale; the count of skipped steps is a counter and comes back either way."""
    data = batches(4)
    dynamic = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    runs = {"fp16": {"fp16": dynamic}, "fixed": {"fp16": {"enabled": True, "loss_scale": 128.0}},
            "bf16": {"bf16": {"enabled": True}}}
    states = {}
    for name, extra in runs.items():
        with offload.initialize(make(), config(tmp_path, "cpu", **extra)) as engine:
            train(engine, data[:3])
            if name != "bf16":  # an overflow: the step is skipped (bf16 refuses a non-finite loss instead)
                x, y = data[3]
                engine.backward(lm_loss(engine(x), y) * float("inf"))
                engine.step()
            states[name] = engine.scaler.state_dict()
            engine.save_checkpoint(tmp_path / name)
    assert states["fp16"]["scale"] == 256.0 and states["fp16"]["iteration"] == 4
    for saved, loaded, scale in (("fp16", "bf16", 1.0), ("bf16", "fp16", 256.0), ("fixed", "fp16", 256.0),
                                 ("fp16", "fixed", 128.0)):
        with offload.initialize(make(), config(tmp_path, "cpu", **runs[loaded])) as engine:
            engine.load_checkpoint(tmp_path / saved)
            assert engine.scaler.scale == scale and engine.scaler.iteration == 0, (saved, loaded)
            assert engine.skipped_steps == (1 if saved != "bf16" else 0), (saved, loaded)
    with offload.initialize(make(), config(tmp_path, "cpu", **runs["fp16"])) as engine:
        engine.load_checkpoint(tmp_path / "fp16")
        assert engine.scaler.state_dict() == states["fp16"]


def test_a_bf16_model_widened_by_an_fp32_config_is_said(tmp_path, caplog):
    """A model given in bf16 to a config that trains in fp32 (neither bf16 nor fp16 enabled) is widened to fp32,
    twice its bytes: a warning names both dtypes and the setting; with bf16 enabled nothing is said."""
    with caplog.at_level("WARNING", logger="offload"):
        with offload.initialize(make().bfloat16(), config(tmp_path, "cpu")) as engine:
            assert engine.dtype is torch.float32
    assert "parameters are bfloat16 and the config trains in float32" in caplog.text
    assert "2x their bytes" in caplog.text and "bf16.enabled true" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="offload"):
        with offload.initialize(make().bfloat16(), config(tmp_path, "cpu", bf16={"enabled": True})):
            pass
    assert "widens" not in caplog.text


def test_fp16_dynamic_loss_scale_skips_overflow(tmp_path):
    data = batches(6)
    model = make()
    cfg = config(tmp_path, "cpu", fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                                        "hysteresis": 1})
    with offload.initialize(model, cfg) as engine:
        assert not engine.was_step_applied()
        scales = []
        for batch in data[:3]:
            train(engine, [batch])
            scales.append(engine.scaler.scale)
        # DeepSpeed's DynamicLossScaler: doubled once a window of 2 clean steps follows the first one
        assert scales == [256.0, 256.0, 512.0]
        assert engine.was_step_applied()
        before = [p.detach().clone() for p in model.parameters()]
        x, y = data[3]
        engine.backward(lm_loss(engine(x), y) * float("inf"))
        engine.step()
        assert not engine.was_step_applied()  # DeepSpeed's name for a skipped step
        assert engine.scaler.scale == 256.0 and engine.stats()["skipped_steps"] == 1
        assert engine.get_global_grad_norm() == math.inf  # DeepSpeed's norm of an overflowed step
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step was skipped
        assert engine.global_steps == 4 and engine.skipped_steps == 1  # counted, as DeepSpeed and the Trainer do
        train(engine, data[4:])
        assert engine.global_steps == 6


class DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale (runtime/fp16/loss_scaler.py, 0.19.8), written out as the
    reference: hysteresis ("delayed_shift"), its refill, the window counted from the clean step after an
    overflow, and the run ended at the minimum scale."""

    def __init__(self, power: int, window: int, hysteresis: int, consecutive: bool, min_scale: float) -> None:
        self.cur_scale, self.window, self.delayed_shift = 2.0 ** power, window, hysteresis
        self.cur_hysteresis, self.consecutive, self.min_scale = hysteresis, consecutive, min_scale
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError("at the minimum")
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.window == 0:
                if not self.consecutive:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2
        self.cur_iter += 1


@settings(max_examples=200, deadline=None)
@given(pattern=st.lists(st.booleans(), max_size=60), window=st.integers(1, 5), hysteresis=st.integers(1, 4),
       consecutive=st.booleans(), power=st.integers(1, 6), min_scale=st.sampled_from([1.0, 2.0, 4.0]))
def test_fp16_loss_scale_follows_deepspeeds_scaler(pattern, window, hysteresis, consecutive, power, min_scale):
    """Any sequence of overflowing and clean steps under any fp16 settings: the scale after each step, the skipped
    count, and the step at which the run ends at the minimum scale are DeepSpeed's."""
    from offload._precision import LossScaler
    from offload.config import FP16Config

    ours = LossScaler(FP16Config(enabled=True, initial_scale_power=power, loss_scale_window=window,
                                 hysteresis=hysteresis, consecutive_hysteresis=consecutive, min_loss_scale=min_scale))
    ref = DeepSpeedScaler(power, window, hysteresis, consecutive, min_scale)
    for i, overflow in enumerate(pattern):
        try:
            ref.update_scale(overflow)
        except FloatingPointError:
            with pytest.raises(FloatingPointError, match="min_loss_scale"):
                ours.update(overflow)
            assert ours.skipped == sum(pattern[: i + 1])
            return
        ours.update(overflow)
        assert ours.scale == ref.cur_scale, (i, pattern[: i + 1])
    assert ours.skipped == sum(pattern)


def test_the_config_schedule_waits_out_an_fp16_skipped_step(tmp_path):
    """The config's scheduler is not stepped on a step fp16 skipped for overflow (DeepSpeed's): the lrs follow
    WarmupLR counted over applied updates only."""
    data = batches(4)
    sched = {"type": "WarmupLR", "params": {"warmup_max_lr": 4e-3, "warmup_num_steps": 5}}
    cfg = config(tmp_path, "cpu", scheduler=sched, fp16={"enabled": True, "initial_scale_power": 8,
                                                         "hysteresis": 1})
    with offload.initialize(make(), cfg) as engine:
        lrs, applied = [engine.get_lr()[0]], 0
        for i, (x, y) in enumerate(data):
            loss = lm_loss(engine(x), y)
            engine.backward(loss * float("inf") if i == 1 else loss)
            engine.step()
            applied += engine.was_step_applied()
            lrs.append(engine.get_lr()[0])
            assert lrs[-1] == pytest.approx(warmup_lr(applied, 0.0, 4e-3, 5, None)), i
    assert applied == 3 and engine.skipped_steps == 1 and lrs[1] == lrs[2]


def test_fp16_overflow_at_the_minimum_scale_raises_after_skipping(tmp_path):
    """DeepSpeed ends a run whose gradients overflow with the scale already at min_loss_scale (every later step
    would be skipped, without a word): here the step is skipped and counted, then FloatingPointError says why,
    and the engine trains on once the cause is gone."""
    data = batches(4)
    model = make()
    cfg = config(tmp_path, "cpu", fp16={"enabled": True, "initial_scale_power": 2, "min_loss_scale": 2,
                                        "hysteresis": 1})
    with offload.initialize(model, cfg) as engine:
        x, y = data[0]
        engine.backward(lm_loss(engine(x), y) * float("inf"))
        engine.step()  # 4 -> 2, the floor
        assert engine.scaler.scale == 2.0 and engine.skipped_steps == 1
        before = [p.detach().clone() for p in model.parameters()]
        engine.backward(lm_loss(engine(x), y) * float("inf"))
        with pytest.raises(FloatingPointError, match=r"fp16\.min_loss_scale \(2\).*lower min_loss_scale"):
            engine.step()
        assert engine.skipped_steps == 2 and engine.global_steps == 2 and not engine.was_step_applied()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        train(engine, data[1:])
        assert engine.was_step_applied() and engine.global_steps == 5


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_overlapped_and_serial_steps_are_identical(tmp_path, device, gradients):
    data = batches(5)
    results, overlapped, shapes = [], [], []
    for overlap in (True, False):
        model = make()
        cfg = config(tmp_path / str(overlap), device, bf16={"enabled": True},
                     zero_optimization={"sub_group_size": 1024,
                                        "offload_optimizer": {"device": device, "overlap_step": overlap,
                                                              "nvme_path": str(tmp_path / "nvme")}})
        with offload.initialize(model, cfg) as engine:
            train(engine, data)
            results.append(engine.consolidated_state_dict())
            overlapped.append(engine.stats()["sub_groups_overlapped"])
            shapes.append(engine.stats()["gradient_buffers"]["shape"])
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k
    assert overlapped[0] > 0 and overlapped[1] == 0  # queued during backward; when they ran is up to the OS
    assert shapes == ["slots", "whole"]  # sub-group slots give the same bits as every gradient held


def failed_until_loaded(engine, ckpt: Path, why: str, batch, rest) -> None:
    """The engine is FAILED: backward refuses, naming ``why``, until checkpoint ``good`` is loaded; then it
    trains on ``rest``."""
    assert engine.phase is offload.Phase.FAILED
    with pytest.raises(RuntimeError, match=why + ".*load a checkpoint"):
        engine.backward(lm_loss(engine(batch[0]), batch[1]))
    assert engine.load_checkpoint(ckpt, tag="good")[0].name == "good"
    train(engine, rest)


def fails_on_call(real, n: int, error: BaseException):
    """``real`` (a function, or a method taken from its class), raising ``error`` on its ``n``-th call instead."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise error
        return real(*args, **kwargs)

    return wrapped


def slow_updates(monkeypatch, seconds: float = 0.02) -> list[int]:
    """Each sub-group's update takes ``seconds`` longer (a slow CPU Adam), so the next forward reaches modules
    while updates are still queued; returns the sub-groups in the order the stepper updated them."""
    from offload.optim.offloaded import OffloadedAdam

    ran, real = [], OffloadedAdam._update

    def update(self, k, *args):
        time.sleep(seconds)
        real(self, k, *args)
        ran.append(k)

    monkeypatch.setattr(OffloadedAdam, "_update", update)
    return ran


@pytest.mark.parametrize("during_backward", [True, False])
def test_the_next_forward_runs_beside_the_step_with_the_same_bits(tmp_path, monkeypatch, gradients,
                                                                  during_backward):
    """``step()`` returns with updates queued and each module's forward waits only for the sub-groups up to its
    own parameters: the same bits as a step that finishes first (overlap_forward false), with the forward's
    first modules run while later sub-groups were still being updated (decay and no-decay param groups put block
    0's LayerNorm in the last sub-groups), the updates left after backward taken in the order the forward needs
    them, and ``state_dict()`` right after ``step()`` seeing the finished update. Updates during backward
    (``overlap_step``) leave only the few the gradient slots allow for the forward; without, all are left."""
    data = batches(4)
    ran = slow_updates(monkeypatch, 0.01)
    results, states, stats = [], [], []
    for beside in (True, False):
        model = make()
        cfg = config(tmp_path / str(beside), "cpu", bf16={"enabled": True},
                     zero_optimization={"sub_group_size": 1024,
                                        "offload_optimizer": {"device": "cpu", "overlap_forward": beside,
                                                              "overlap_step": during_backward}})
        decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's and the Trainer's two groups: the
        rest = [p for p in model.parameters() if p.dim() < 2]  # LayerNorms of block 0 in the last sub-groups
        groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
        with offload.initialize(model, cfg, param_groups=groups) as engine:
            assert engine.plan().overlap_forward is beside
            seen = []  # when block 0's forward ran: how many sub-groups had not been updated yet
            engine.module.blocks[0].register_forward_pre_hook(
                lambda *_: seen.append(sum(not job.done() for job in engine.optimizer.pending().values())))
            steps, orders = [], []
            for i, (x, y) in enumerate(data):
                loss = lm_loss(engine(x), y)  # every sub-group is updated once the forward is through
                orders.append(list(ran))  # the last step's updates that ran after its backward
                engine.backward(loss)
                del ran[:]
                engine.step()
                if i == 1:  # settles the step: the next forward finds nothing queued
                    steps.append({k: v.clone() for k, v in engine.module.state_dict().items()})
            results.append(engine.consolidated_state_dict())
            states.append(steps)
            stats.append(engine.stats()["update_beside_forward"])
        if beside and not during_backward:
            assert max(seen) >= 3  # block 0 ran with the later blocks' updates still queued behind it
        if beside:
            rank = engine._gate._rank  # the order the first forward needed the sub-groups in
            for order in orders[1:]:  # the first may have been picked before backward ended
                assert [rank[k] for k in order[1:]] == sorted(rank[k] for k in order[1:]), order
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k
    for a, b in zip(*states):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert stats[0]["steps"] == 4 and stats[1] is None


class ReadsALaterWeight(torch.nn.Module):
    """The root's forward reads ``last.weight`` itself before ``last`` runs: a parameter registered after the
    modules that run first, so its sub-group is updated after theirs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(64, 64)
        self.middle = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.last = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.first(x) + x @ self.last.weight.T)
        for m in self.middle:
            x = torch.tanh(m(x))
        return self.last(x).square().mean()


@pytest.mark.parametrize("declared", [False, True])
def test_a_parameter_read_outside_its_module_waits_for_its_update(tmp_path, monkeypatch, declared):
    """The root reads ``last.weight`` before ``last`` runs: the first forward's trace finds the read (or it is
    declared with ``register_external_parameter``), so the root's forward waits for that update too, and
    training equals a step that finishes first. (Without either, the root reads it half updated.)"""
    slow_updates(monkeypatch)
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(8, 64, generator=g) for _ in range(4)]
    results = []
    for beside in (True, False):
        model = ReadsALaterWeight()
        cfg = config(tmp_path / str(beside), "cpu",
                     zero_optimization={"sub_group_size": 4096,
                                        "offload_optimizer": {"device": "cpu", "overlap_forward": beside}})
        with offload.initialize(model, cfg) as engine:
            if declared:
                engine.register_external_parameter(model, model.last.weight)
            for x in data:
                engine.backward(engine(x))
                engine.step()
            results.append(engine.consolidated_state_dict())
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_the_first_forwards_trace_is_left_however_it_ends(tmp_path):
    """The trace's torch function mode is popped when the first forward ends, or, when an interrupt skipped
    torch's always-called hooks, by the first backward; training then goes on as usual."""
    from torch.overrides import _get_current_function_mode_stack as modes

    model = make()
    cfg = config(tmp_path, "cpu", zero_optimization={"sub_group_size": 1024, "offload_optimizer": {
        "device": "cpu", "overlap_forward": True}})
    data = batches(3)
    with offload.initialize(model, cfg) as engine:

        def interrupt(*_):
            raise KeyboardInterrupt

        handle = model.blocks[1].register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            engine(data[0][0])
        handle.remove()
        engine(data[0][0])  # still under the mode the interrupted forward left: the first backward pops it
        train(engine, data)
        assert modes() == [] and engine.stats()["update_beside_forward"]["steps"] == 3


@pytest.mark.parametrize("placement", ["cpu", "cpu, overlap_forward", "cpu, params on cpu"])
def test_a_copy_of_the_model_is_a_plain_model(tmp_path, placement):
    """``copy.deepcopy(model)`` (an EMA) and ``torch.save(model)`` of a model in training give a plain model with
    the current weights, which runs without the engine. With parameters offloaded the modules hold placeholders,
    so a copy is refused, naming what to use instead."""
    import copy
    import io

    device, *options = placement.split(", ")
    cfg = config(tmp_path, device, zero_optimization={"sub_group_size": 1024, "offload_optimizer": {
        "device": device, "overlap_forward": "overlap_forward" in options}})
    if "params on cpu" in options:
        cfg["zero_optimization"].update(stage=3, offload_param={"device": "cpu"})
    model = make()
    data = batches(2)
    with offload.initialize(model, cfg) as engine:
        train(engine, data)
        if "overlap_forward" in options:  # the step's updates may still run: a copy now would be half updated
            with pytest.raises(ValueError, match="half updated: call engine.finish_step"):
                copy.deepcopy(model)
        engine.finish_step()
        if options == ["params on cpu"]:
            for copies in (lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO())):
                with pytest.raises(ValueError, match="placeholders .* engine.save_safetensors"):
                    copies()
            return
        ema = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        expected = model(data[0][0].to(DEVICE))
    for other in (ema, loaded):
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            assert torch.equal(p, q), name
        assert torch.equal(other(data[0][0].to(DEVICE)), expected)


@pytest.mark.parametrize("placement", ["opt-host", "params-nvme"])
def test_a_non_finite_loss_is_refused_before_its_backward(tmp_path, placement):
    """A NaN loss mid-window (bf16/fp32) raises before its backward: the window's earlier gradients stay, and a
    loop that skips the batch ends bit for bit where the same loop without that batch ends."""
    data = batches(4)
    cfg = placement_config(tmp_path / "a", placement, gradient_accumulation_steps=2)
    with offload.initialize(make(), cfg) as engine:
        train_steps(engine, data)
        want = engine.consolidated_state_dict()
    with offload.initialize(make(), placement_config(tmp_path / "b", placement, gradient_accumulation_steps=2)) \
            as engine:
        for i, (x, y) in enumerate(data):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            if i == 0:  # a batch whose every label is ignored: the mean of no terms, 0/0
                loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), torch.full_like(y, -100).flatten()
                                                         .to(engine.device))
                with pytest.raises(FloatingPointError, match="the loss is nan .* nothing changed .* skip this batch"):
                    engine.backward(loss)
                assert engine.phase.value == "accumulating"
        got = engine.consolidated_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("refused", [(3,), (2,), (2, 3)], ids=["last of a window", "first", "a whole window"])
def test_a_loop_that_steps_past_a_refused_batch_keeps_its_windows(tmp_path, refused):
    """The loop ``try: engine.backward(loss) except FloatingPointError: pass; engine.step()`` (every rank refuses
    together): the refused batch counts, with no gradient, so windows still end every gradient_accumulation_steps
    step() calls, as DeepSpeed counts them; a window of refused batches only is a skipped step. Against torch's
    AdamW fed the same windows (before, every later window was shifted by one batch)."""
    data, gas = batches(6), 2
    with offload.initialize(make(), config(tmp_path, "cpu", gradient_accumulation_steps=gas)) as engine:
        applied = []
        for i, (x, y) in enumerate(data):
            out = engine(x)
            if i in refused:
                loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), torch.full_like(y, -100).flatten()
                                                         .to(engine.device))  # no label counts: 0/0
                with pytest.raises(FloatingPointError, match="a step\\(\\) after it counts the batch"):
                    engine.backward(loss)
            else:
                engine.backward(lm_loss(out, y))
            engine.step()
            applied.append(engine.was_step_applied())
        got = engine.consolidated_state_dict()
        assert engine.global_steps == 3 and engine.skipped_steps == (1 if len(refused) == 2 else 0)
    assert applied == [False, True, False, len(refused) < 2, False, True]
    model = reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for start in range(0, len(data), gas):
        window = [i for i in range(start, start + gas) if i not in refused]
        for i in window:
            x, y = data[i]
            (lm_loss(model(on_device(x)), y) / gas).backward()
        if window:
            opt.step()
        opt.zero_grad()
    for k, r in model.state_dict().items():
        close_enough(got[k], r, 1e-5)


def test_a_parameter_read_outside_its_forward_is_named_instead_of_training_nan(tmp_path):
    """Stage 3: the head's weight read by the loss outside any module's forward is the NaN placeholder; the
    engine refuses the loss naming the cause (before, NaN went into every master weight)."""
    model = make()
    with offload.initialize(model, placement_config(tmp_path, "params-host", live=8192, bucket=4096)) as engine:
        before = engine.consolidated_state_dict()
        x, y = batches(1)[0]
        h = model.ln(model.tok(x.to(engine.device)) + model.pos[: x.shape[1]])
        loss = lm_loss(torch.nn.functional.linear(h, model.head.weight), y)
        with pytest.raises(FloatingPointError, match="outside any forward of the model.*register_external_parameter"):
            engine.backward(loss)
        after = engine.consolidated_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_an_update_that_fails_during_backward_surfaces_at_the_next_read(tmp_path, monkeypatch):
    """An update run during backward fails and nothing waits for it before ``read_parameter``: that call raises
    the error and the engine is FAILED, so ``step()`` cannot go on with a sub-group left out."""
    from offload.optim import offloaded

    model = make()
    cfg = config(tmp_path, "cpu", zero_optimization={"sub_group_size": 8192})  # whole buffers: no slot waits
    with offload.initialize(model, cfg) as engine:
        assert engine.plan().overlap
        monkeypatch.setattr(offloaded, "adam_step",
                            fails_on_call(offloaded.adam_step, 1, RuntimeError("injected kernel error")))
        x, y = batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(RuntimeError, match="injected kernel error"):
            engine.read_parameter(model.pos)
        with pytest.raises(RuntimeError, match="its updates, run during backward.*load a checkpoint"):
            engine.step()


def test_an_update_that_fails_beside_the_forward_fails_the_engine(tmp_path, monkeypatch):
    """The CPU Adam kernel raises in a sub-group updated after ``step()`` returned: the forward that waits for it
    raises that error, the engine is FAILED (backward refuses, naming it), and loading a checkpoint recovers."""
    from offload.optim import offloaded

    data = batches(4)
    model = make()
    cfg = config(tmp_path, "cpu", zero_optimization={"sub_group_size": 1024, "offload_optimizer": {
        "device": "cpu", "overlap_forward": True}})
    with offload.initialize(model, cfg) as engine:
        train(engine, data[:1])
        engine.save_checkpoint(tmp_path / "ckpt", tag="good")
        last = len(engine.layout.sub_groups)  # the step's last update: one the next forward waits for
        monkeypatch.setattr(offloaded, "adam_step",
                            fails_on_call(offloaded.adam_step, last, RuntimeError("injected kernel error")))
        engine.backward(lm_loss(engine(data[1][0]), data[1][1]))
        engine.step()
        with pytest.raises(RuntimeError, match="injected kernel error"):
            engine(data[2][0])
        monkeypatch.undo()
        failed_until_loaded(engine, tmp_path / "ckpt", "its updates, finishing beside the next forward", data[2],
                            data[1:])
    ref = reference_fp32(4, data)
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)


class WithUnused(torch.nn.Module):
    """A TinyGPT beside a head the loss never uses: its sub-groups get no gradient in any step."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = make()
        self.unused = torch.nn.Linear(64, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)


@pytest.mark.parametrize("beside", [False, True])
def test_parameters_the_loss_does_not_use_get_zero_gradients(tmp_path, beside):
    """Parameters the loss does not use get a zero gradient (as in DeepSpeed: weight decay and the moments still
    move), filled in as backward ends: with gradient slots (and the next forward beside the updates) the same bits
    as with whole gradient buffers."""
    data = batches(3)
    results = {}
    for slots in (True, False):
        torch.manual_seed(0)
        model = WithUnused()
        cfg = config(tmp_path / str(slots), "cpu", zero_optimization={"sub_group_size": 1024, "offload_optimizer": {
            "device": "cpu", "overlap_step": slots, "overlap_forward": beside}})
        with offload.initialize(model, cfg) as engine:
            train(engine, data)
            results[slots] = engine.consolidated_state_dict()
            buffers = engine.stats()["gradient_buffers"]
        assert buffers["shape"] == ("slots" if slots else "whole")
    assert not torch.equal(results[True]["unused.weight"], WithUnused().unused.weight.detach())  # weight decay
    for k in results[True]:
        assert torch.equal(results[True][k], results[False][k]), k


class Sometimes(torch.nn.Module):
    """``extra`` (sub-groups of its own, first in the flat layout) that only micro-batches given ``w`` use, and a
    small layer ``a`` every micro-batch uses (in the last sub-group, beside the end of ``extra``)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(64, 64)
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        out = self.a(x).pow(2).mean()
        return out if w is None else out + self.extra(w).pow(2).mean()


def test_an_update_during_backward_waits_for_an_earlier_micro_batchs_adds(tmp_path, monkeypatch):
    """Staged gradients (the CUDA path, on any machine) accumulating 2 micro-batches: ``extra`` gets a gradient
    in the first only, and the second sends one bucket (``a``'s, in the last sub-group). At the end of the second
    backward the updates of ``extra``'s sub-groups are queued first, with nothing of that micro-batch to wait
    for, while the accumulation thread is still adding the first one's gradient (slowed here): they must wait for
    it (they read a half-added accumulator). The result equals torch's AdamW."""
    from offload.engine import _grads

    monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    monkeypatch.setattr(offload.plan, "GRAD_BUCKET", 1000)
    add = _grads._accumulate

    def slow(*args):
        time.sleep(0.05)
        add(*args)

    monkeypatch.setattr(_grads, "_accumulate", slow)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 16, generator=g), torch.randn(3, 64, generator=g) if i % 2 == 0 else None)
            for i in range(4)]
    torch.manual_seed(0)
    model = Sometimes()
    ref = copy.deepcopy(model).to(DEVICE)
    cfg = config(tmp_path, "cpu", gradient_accumulation_steps=2, zero_optimization={"sub_group_size": 1024})
    with offload.initialize(model, cfg) as engine:
        for x, w in data:
            engine.backward(engine(x, w))
            engine.step()
        assert engine.stats()["sub_groups_overlapped"] > 0
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for i, (x, w) in enumerate(data):
        (ref(x.to(DEVICE), None if w is None else w.to(DEVICE)) / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p, r, 1e-5)


class Crossed(torch.nn.Module):
    """Parameters registered a0 b0 a1 b1 ... but used a's first, then b's: each sub-group holds an a and a b, so
    backward (the b's first) leaves every sub-group partly filled until it reaches the a's. Each b has padding
    after it in the flat layout (300 elements, aligned to 256)."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.n = n
        for i in range(n):
            self.register_parameter(f"a{i}", torch.nn.Parameter(1 + 0.1 * torch.randn(512, generator=g)))
            self.register_parameter(f"b{i}", torch.nn.Parameter(0.1 * torch.randn(300, generator=g)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = torch.tanh(x * getattr(self, f"a{i}"))
        return sum((x[:, :300] * getattr(self, f"b{i}")).sum(-1) for i in range(self.n))


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_gradient_slots_when_sub_groups_fill_out_of_order(tmp_path, device, gradients):
    """Gradients held in sub-group slots (one micro-batch, no clipping): when more sub-groups are open at once
    than there are slots and no update is queued to free one, the pool grows instead of deadlocking. The result
    equals torch's AdamW, and the layout's padding keeps zero master weights although the slots are reused.
    Buckets of 512: an a and a b in separate buckets, so that (staged, as on CUDA, where a slot is taken when a
    bucket is sent) each b's bucket takes its sub-group's slot before the a's arrive."""
    xs = [torch.randn(4, 512, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    model, ref = Crossed(), Crossed().to(DEVICE)
    cfg = config(tmp_path, device, zero_optimization={"sub_group_size": 1024, "reduce_bucket_size": 512})
    with offload.initialize(model, cfg) as engine:
        assert engine.plan().grad_slots == offload.plan.GRAD_SLOTS < len(engine.layout.sub_groups) == 8
        for x in xs:
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        slots = engine.stats()["gradient_buffers"]
        assert slots["shape"] == "slots" and slots["grown"] == 8 - offload.plan.GRAD_SLOTS
        assert slots["held_peak"] == 8  # every sub-group open before the first is complete
        for sg in engine.layout.sub_groups:
            block = engine.optimizer.read_state(sg)
            assert sg.numel == 1024 and not block[812 : 1024].any()  # b's padding: master, moments
            assert not block[1024 + 812 : 2048].any() and not block[2048 + 812 :].any()
            engine.optimizer.done_state(sg, dirty=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for x in xs:
        opt.zero_grad()
        ref(x.to(DEVICE)).pow(2).mean().backward()
        opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p, r, 1e-5)


def test_a_bucket_of_padding_alone_holds_no_update_back(tmp_path, gradients):
    """Buckets of 100 elements: each sub-group of Crossed ends in two of alignment padding alone. Every sub-group's
    update still starts during backward, as soon as its last gradient is in (a bucket no gradient could complete
    held each one back until step())."""
    model = Crossed()
    cfg = config(tmp_path, "cpu", zero_optimization={"sub_group_size": 1024, "reduce_bucket_size": 100})
    with offload.initialize(model, cfg) as engine:
        for i in range(3):
            x = torch.randn(4, 512, generator=torch.Generator().manual_seed(i))
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        assert engine.stats()["sub_groups_overlapped"] == 3 * len(engine.layout.sub_groups) == 3 * 8


def test_gradient_slots_save_the_host_gradient_buffer(tmp_path):
    """With slots the host tier holds a few sub-groups of gradients instead of the whole model's: its peak drops by
    the difference, and the planner's estimate follows."""
    peaks, estimates = {}, {}
    for overlap in (True, False):
        cfg = config(tmp_path / str(overlap), "nvme", zero_optimization={
            "sub_group_size": 1024, "offload_optimizer": {"device": "nvme", "overlap_step": overlap,
                                                          "nvme_path": str(tmp_path / "nvme")}})
        with offload.initialize(make(), cfg) as engine:
            train(engine, batches(2))
            peaks[overlap] = engine.memory_report()["host"]["peak"]
            sizes = offload.plan.ModelSizes.of(engine.layout.params)
            estimates[overlap] = offload.plan.expected_bytes(engine.plan(), sizes)[offload.plan.Tier.HOST]
            owned, sub = engine.layout.owned_numel(0), engine.layout.max_sub_group_numel
    assert peaks[False] - peaks[True] == 4 * (owned - offload.plan.GRAD_SLOTS * sub)
    for overlap in (True, False):
        assert abs(estimates[overlap] - peaks[overlap]) <= 0.1 * peaks[overlap]


class _FailInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailInBackward.armed:
            raise RuntimeError("injected error in the model's backward")
        return grad


def test_an_error_in_a_windows_first_backward_drops_the_window(tmp_path):
    """The model's own backward raises halfway (the later layers' gradients already sent to the host) in the first
    micro-batch of a window, before any update: the window is dropped, the engine is idle again, and training on
    equals a run that never saw that batch."""
    data, bad = batches(6), batches(1, seed=9)[0]
    model = make()
    with offload.initialize(model, config(tmp_path, "nvme", gradient_accumulation_steps=2)) as engine:
        engine.module.blocks[0].register_forward_hook(lambda m, i, out: _FailInBackward.apply(out))
        train(engine, data[:2], gas=2)
        _FailInBackward.armed = True
        try:
            with pytest.raises(RuntimeError, match="injected error"):
                engine.backward(lm_loss(engine(bad[0]), bad[1]))
        finally:
            _FailInBackward.armed = False
        assert engine.phase is offload.Phase.IDLE and engine.micro_steps == 2
        train(engine, data[2:], gas=2)
        assert engine.global_steps == 3
    ref = reference_fp32(3, data, gas=2)
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)


def statm_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not heap_trim_available(), reason="malloc_trim is glibc's; this C library has none")
def test_heap_trim_returns_the_free_pages_of_the_heap():
    """Small tensors freed in the middle of the heap stay resident until a trim gives their pages back."""
    keep = [torch.ones(16 << 10) for _ in range(4000)]  # 64 KiB each, below glibc's mmap threshold: the heap
    last = torch.ones(16 << 10)  # holds the top of the heap, so free() alone cannot shrink it
    before = statm_rss()
    del keep
    freed = statm_rss()
    trim = HeapTrim(4 << 20)
    trim.begin_backward()
    after = statm_rss()
    assert before - freed < 64 << 20 < freed - after  # of the 256 MiB freed, most comes back only at the trim
    for _ in range(4):  # the second of four gradients of 1 MiB takes backward past half: one trim, none at the end
        trim.add(1 << 20)
    assert trim.stats()["trims"] == 2 and last.sum() == 16 << 10


def test_trim_host_heap_key(tmp_path):
    for value, want in ((True, True), (False, False), ("auto", DEVICE.type == "cpu" and heap_trim_available())):
        cfg = config(tmp_path, "cpu", offload={"trim_host_heap": value})
        with offload.initialize(make(), cfg) as engine:
            assert engine.plan().trim_heap is want and (engine.stats()["heap_trims"] is not None) is want
    with pytest.raises(ValueError, match=r"offload.trim_host_heap must be true, false or \"auto\", got 'yes'"):
        offload.initialize(make(), config(tmp_path, "cpu", offload={"trim_host_heap": "yes"}))


def test_optimizer_state_four_times_host_budget_on_nvme(tmp_path):
    """bf16 model of ~2.4M parameters: its Adam state (12 B/param) is over 4x the HOST budget, which still holds
    the bf16 host gradients and the staging buffers; peak HOST bytes stay under the budget."""
    model = make(d=160, layers=7, vocab=128)
    n = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * n
    budget = state_bytes // 4
    cfg = config(tmp_path, "nvme", bf16={"enabled": True}, offload={"host_memory_budget": budget},
                 zero_optimization={"sub_group_size": 16384,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                                          "buffer_count": 4}})
    with offload.initialize(model, cfg) as engine:
        losses = train(engine, batches(8, vocab=128, bsz=8) * 2)
        report = engine.memory_report()
        stats = engine.stats()
    assert report["host"]["budget"] == budget and report["host"]["peak"] <= budget
    assert report["nvme"]["current"] >= state_bytes
    assert losses[-1] < losses[0]
    assert stats["bytes_moved"]["nvme->host"] >= state_bytes * 15  # every step read all state back ...
    assert stats["bytes_moved"]["host->nvme"] >= state_bytes * 16  # ... and wrote it (plus the initial write)


def test_a_model_without_values_or_in_float64_is_refused_before_anything_moves(tmp_path):
    """A model built on the meta device (``init_empty_weights``' habit) has nothing to train from; a float64 one
    would be rounded to fp32 masters and then fail on its own float64 inputs. Both are named at initialize, and
    the model is left as it was."""
    with torch.device("meta"):
        empty = make()
    with pytest.raises(ValueError, match=r"parameter 'pos' is on the meta device .* offload\.init"):
        offload.initialize(empty, config(tmp_path, "cpu"))
    double = make().double()
    with pytest.raises(ValueError, match=r"parameter 'pos' is float64; .*\(model\.float\(\)\)"):
        offload.initialize(double, config(tmp_path, "cpu"))
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in double.parameters())


def test_budgets_that_cannot_fit_fail_at_initialize(tmp_path):
    with pytest.raises(offload.BudgetExceeded, match=r"host tier: .* offload.host_memory_budget"):
        offload.initialize(make(), config(tmp_path, "cpu", offload={"host_memory_budget": "64KiB"}))
    with pytest.raises(offload.BudgetExceeded, match=r"device tier: .*needs .* offload.device_memory_budget"):
        offload.initialize(make(), config(tmp_path, "cpu", offload={"device_memory_budget": 1000}))
    with pytest.raises(offload.BudgetExceeded, match="staging buffers.*sub_group_size"):
        offload.initialize(make(), config(tmp_path, "nvme", offload={"host_memory_budget": 200_000},
                                          zero_optimization={"sub_group_size": 1 << 20}))
    assert not [t for t in threading.enumerate() if t.name.startswith(("offload", "nvme_swapper"))]


@pytest.mark.parametrize("params", ["none", "cpu"], ids=["optimizer on cpu", "optimizer + parameters on cpu"])
def test_a_host_budget_the_state_does_not_fit_fails_before_any_parameter_moves(tmp_path, params):
    """initialize moves each parameter as soon as the masters have read it; the whole state is charged to the
    budget before the first one moves, so a budget it does not fit leaves the model as it was (bf16 training:
    a parameter already moved would come back rounded)."""
    extra = dict(bf16={"enabled": True}, zero_optimization={"stage": 3 if params != "none" else 2,
                                                            "offload_param": {"device": params}})
    with offload.initialize(make(), config(tmp_path, "cpu", **extra)) as engine:
        peak = engine.memory_report()["host"]["peak"]
        state = sum(12 * sg.numel for sg in engine.layout.sub_groups)
    model = make()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(offload.BudgetExceeded, match=r"host tier: optimizer state .*offload.host_memory_budget"):
        offload.initialize(model, config(tmp_path, "cpu", offload={"host_memory_budget": peak - state // 2},
                                         **extra))
    for name, p in model.named_parameters():
        ptr, value = before[name]
        assert p.data_ptr() == ptr and p.dtype == torch.float32 and torch.equal(p.detach(), value), name


@pytest.mark.parametrize("short", [1, 4 << 10, 16 << 10, 64 << 10])
def test_a_host_budget_just_below_the_peak_leaves_the_model_as_it_was(tmp_path, gradients, short):
    """The host buffers the engine takes last (with CUDA: the pinned staging updated parameters reach the device
    through) come before any parameter moves too: a budget ``short`` bytes below the peak fails with the model as
    given. Found by a desk review for CUDA: the staging was taken after the move, leaving bf16-rounded weights."""
    cfg = config(tmp_path, "cpu", bf16={"enabled": True})
    with offload.initialize(make(), cfg) as engine:
        peak = engine.memory_report()["host"]["peak"]
    model = make()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(offload.BudgetExceeded, match="host tier"):
        offload.initialize(model, config(tmp_path, "cpu", bf16={"enabled": True},
                                         offload={"host_memory_budget": peak - short}))
    for name, p in model.named_parameters():
        ptr, value = before[name]
        assert p.data_ptr() == ptr and p.dtype == torch.float32 and torch.equal(p.detach(), value), name


class Rotary(torch.nn.Module):
    """A layer whose fp32 buffer (a rotary embedding's inverse frequencies) multiplies its input's positions."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        angles = (pos[:, None] * self.inv_freq.float()[None, :]).repeat(1, 2)  # fp32 math, as transformers does
        return self.lin(x) * torch.cos(angles).to(x.dtype)


@pytest.mark.parametrize("given", [torch.bfloat16, torch.float32])
def test_a_model_given_in_the_training_dtype_keeps_its_fp32_buffers(tmp_path, given):
    """bf16 training: a model whose parameters come in bf16 (transformers' from_pretrained(torch_dtype=bf16)) keeps
    its fp32 buffers, as it runs without the engine (RoPE's inv_freq rounded to bf16 moved its angles by radians at
    long positions); a model given in fp32 is converted whole, buffers too (as DeepSpeed converts it)."""
    torch.manual_seed(0)
    model = Rotary().to(given)
    model.inv_freq = model.inv_freq.float()
    x = torch.randn(2, 4096, 16, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():  # the reference on the engine's device: the same kernels, so the same bits
        plain = Rotary().to(torch.bfloat16)
        plain.load_state_dict(model.state_dict())
        plain.inv_freq = model.inv_freq.float().clone()
        expected = plain.to(DEVICE)(x).cpu() if given is torch.bfloat16 else None
    with offload.initialize(model, config(tmp_path, "cpu", bf16={"enabled": True})) as engine:
        assert model.inv_freq.dtype == (torch.float32 if given is torch.bfloat16 else torch.bfloat16)
        assert model.lin.weight.dtype == torch.bfloat16
        if expected is not None:
            with torch.no_grad():
                assert torch.equal(engine(x).cpu(), expected)


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_a_transformers_model_given_in_fp32_holds_its_buffers_as_from_pretrained_in_bf16_does(tmp_path, param):
    """from_pretrained -> initialize (and offload.init) give the engine an fp32 transformers model: its buffers
    take the dtypes from_pretrained(dtype=bf16) gives them (RoPE's inv_freq stays fp32: rounded to bf16, its angles
    were 2.4 rad off at position 2000), and its forward equals that model's, bit for bit."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ck")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ck"), dtype=torch.bfloat16).to(DEVICE)
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32  # the reference's own choice
    x = torch.randint(0, 64, (1, 2048), device=DEVICE)
    with torch.no_grad():
        expected = hf(x).logits.cpu()
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ck"))  # fp32
    cfg_ = config(tmp_path, "cpu", bf16={"enabled": True})
    if param != "none":
        cfg_["zero_optimization"].update(stage=3, offload_param={"device": param})
    with offload.initialize(model, cfg_) as engine:
        assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in hf.named_buffers()}
        with torch.no_grad():
            assert torch.equal(engine(x).logits.cpu(), expected)


def test_a_device_budget_too_small_for_the_gradients_names_the_device_budget():
    """No offload: the gradients live on the device, so a device budget they do not fit names that budget and
    offloading the optimizer as the fix (it named the host budget)."""
    with pytest.raises(offload.BudgetExceeded) as info:
        offload.initialize(make(), {"offload": {"device_memory_budget": "1KiB"}})
    msg = str(info.value)
    assert msg.startswith("device tier:") and "gradients" in msg and "raise offload.device_memory_budget" in msg
    assert "host_memory_budget" not in msg and "offload_optimizer.device" in msg


@pytest.mark.parametrize("home", ["cpu", "nvme"])
@pytest.mark.parametrize("limit, error, match", [
    ({"offload": {"device_memory_budget": "1KiB"}}, offload.BudgetExceeded, r"device tier: the parameter window"),
    ({"offload": {"device_memory_budget": "1KiB"}, "zero_optimization": {"stage3_param_persistence_threshold": 0}},
     offload.BudgetExceeded, r"raise offload.device_memory_budget to at least \d+ B: the largest parameter"),
    ({"zero_optimization": {"stage3_max_live_parameters": 100, "stage3_param_persistence_threshold": 10}},
     ValueError, r"stage3_max_live_parameters \(100\) is smaller than the largest parameter"),
], ids=["device budget", "nothing persists", "window"])
def test_a_parameter_window_that_cannot_fit_fails_before_any_parameter_moves(tmp_path, home, limit, error, match):
    """Parameter offload with bf16: the window is checked before the parameters go to their homes, so the model
    comes back as it was, fp32 and unrounded (before, the device budget's check came after the move)."""
    model = make()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    cfg = config(tmp_path, "cpu", bf16={"enabled": True},
                 zero_optimization={"stage": 3, "offload_param": {"device": home,
                                                                  "nvme_path": str(tmp_path / "params")}})
    for key, value in limit.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    with pytest.raises(error, match=match):
        offload.initialize(model, cfg)
    for name, p in model.named_parameters():
        ptr, value = before[name]
        assert p.data_ptr() == ptr and p.dtype == torch.float32 and torch.equal(p.detach(), value), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(placement=st.sampled_from(sorted(PLACEMENTS)), frozen=st.booleans(),
       tier=st.sampled_from(["host_memory_budget", "device_memory_budget", "nvme_memory_budget"]),
       budget=st.integers(1 << 10, 1 << 20))
def test_an_initialize_that_fails_on_a_budget_leaves_the_model_as_it_was(tmp_path, placement, frozen, tier, budget):
    """Whatever the placement and the budget, initialize either succeeds or fails with every parameter as the
    user gave it: the same storage, fp32, unrounded (bf16 training rounds what has moved). Found two holes: the
    device window checked after the move, and host copies of frozen parameters taken one by one as they moved."""
    model = make()
    if frozen:
        for p in [model.tok.weight, *model.blocks[0].parameters()]:
            p.requires_grad_(False)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    cfg = placement_config(tmp_path, placement, bf16={"enabled": True}, offload={tier: budget})
    try:
        offload.initialize(model, cfg).close()
        return
    except (offload.BudgetExceeded, ValueError):
        pass
    for name, p in model.named_parameters():
        ptr, value = before[name]
        assert p.data_ptr() == ptr and p.dtype == torch.float32 and torch.equal(p.detach(), value), name


@pytest.mark.parametrize("device, dtype, cuda_path", [("nvme", torch.float32, False), ("cpu", torch.bfloat16, False),
                                                     ("none", torch.bfloat16, False), ("none", torch.bfloat16, True)])
def test_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch, device, dtype, cuda_path):
    """``cuda_path``: state left on the device is updated by torch's fused kernel and checkpointed through host
    copies, as on CUDA (offload.plan.STAGE_ON_CPU)."""
    if cuda_path:
        monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    data = batches(20)
    extra = {"bf16": {"enabled": True}} if dtype == torch.bfloat16 else {}
    model = make()
    with offload.initialize(model, config(tmp_path / "a", device, **extra)) as engine:
        train(engine, data[:10])
        path = engine.save_checkpoint(tmp_path / "ckpt")
        train(engine, data[10:])
        straight = engine.consolidated_state_dict()
    assert path.name == "step10" and (tmp_path / "ckpt" / "latest").read_text() == "step10"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in path.iterdir())
    json.loads((path / "meta.json").read_text())  # plain JSON, nothing to unpickle

    model2 = make(seed=123)  # different initial weights: everything must come from the checkpoint
    with offload.initialize(model2, config(tmp_path / "b", device, **extra)) as engine2:
        assert engine2.load_checkpoint(tmp_path / "ckpt")[0].name == "step10"
        assert engine2.global_steps == 10
        train(engine2, data[10:])
        resumed = engine2.consolidated_state_dict()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def optimizer_blocks(engine) -> list[torch.Tensor]:
    """Every sub-group's [master | exp_avg | exp_avg_sq], copied."""
    blocks = []
    for sg in engine.layout.sub_groups:
        blocks.append(engine.optimizer.read_state(sg).clone())
        engine.optimizer.done_state(sg, dirty=False)
    return blocks


@pytest.mark.parametrize("device", ["cpu", "nvme", "none"])
def test_deepspeeds_partial_checkpoint_loads(tmp_path, device, monkeypatch):
    """A run fine-tuned from another's checkpoint, as DeepSpeed's load_checkpoint options do it: without the
    optimizer states the weights and step counters come from the checkpoint, and Adam's moments, the optimizer's
    step count and hyperparameters stay this engine's; without the LR scheduler's state its schedule stays;
    ``load_module_only`` takes the weights alone (and drops an open window's micro-batches from the count). The
    parameters the model computes with are the loaded masters. After a failed step only a whole load is taken.
    "none": the state on the device, as on CUDA (STAGE_ON_CPU: torch's fused Adam, state read through copies)."""
    from offload.optim import offloaded

    if device == "none":
        monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    data = batches(8)
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_type": "linear", "warmup_max_lr": LR}}
    cfg = config(tmp_path / "a", device, scheduler=sched)
    with offload.initialize(make(), cfg) as engine:
        train(engine, data[:5])
        engine.save_checkpoint(tmp_path / "ckpt")
        saved, saved_lr = optimizer_blocks(engine), engine.get_lr()
    cases = {"optimizer": dict(load_optimizer_states=False), "scheduler": dict(load_lr_scheduler_states=False),
             "module": dict(load_module_only=True)}
    for name, options in cases.items():
        with offload.initialize(make(seed=7), config(tmp_path / name, device, scheduler=sched)) as engine:
            train(engine, data[5:8])
            own, own_lr = optimizer_blocks(engine), engine.get_lr()
            engine.load_checkpoint(tmp_path / "ckpt", **options)
            got = optimizer_blocks(engine)
            for sg, block, theirs, mine in zip(engine.layout.sub_groups, got, saved, own):
                n = sg.numel
                assert torch.equal(block[:n], theirs[:n]), name  # the weights: always the checkpoint's
                keep = theirs if name == "scheduler" else mine
                assert torch.equal(block[n:], keep[n:]), name  # the moments
            assert engine.global_steps == (3 if name == "module" else 5), name
            assert engine.optimizer.step_count == (5 if name == "scheduler" else 3), name
            assert engine.get_lr() == (saved_lr if name == "optimizer" else own_lr), name
            state = engine.consolidated_state_dict()
            for (key, p), q in zip(engine.module.named_parameters(), engine.module.parameters()):
                assert torch.equal(q.detach().cpu(), state[key]), (name, key)  # fp32: the masters themselves
    with offload.initialize(make(), config(tmp_path / "strict", device, gradient_accumulation_steps=2)) as engine:
        with pytest.raises(ValueError, match=r"load_module_strict=False.*engine.load_state_dict\(OUT, "
                                             r"strict=False\)"):
            engine.load_checkpoint(tmp_path / "ckpt", load_module_strict=False)
        x, y = data[0]
        engine.backward(lm_loss(engine(x), y))  # micro-batch 1 of 2: the load drops it, and its count
        engine.load_checkpoint(tmp_path / "ckpt", load_module_only=True)
        assert engine.micro_steps == 0 and not engine.is_gradient_accumulation_boundary()
        applied = []
        for x, y in data[:4]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            applied.append(engine.was_step_applied())
        assert applied == [False, True, False, True]
        if device == "none":  # torch's fused Adam, on the device
            monkeypatch.setattr(offloaded.OffloadedAdam, "_fused_torch", fails_on_call(
                offloaded.OffloadedAdam._fused_torch, 2, RuntimeError("injected")))
        else:
            monkeypatch.setattr(offloaded, "adam_step", fails_on_call(offloaded.adam_step, 2,
                                                                      RuntimeError("injected")))
        for x, y in data[4:6]:  # the window's second backward runs the updates: the second of them fails
            engine.backward(lm_loss(engine(x), y))
            with contextlib.suppress(RuntimeError):
                engine.step()
        assert engine.phase is offload.Phase.FAILED  # Adam's state half updated
        monkeypatch.undo()
        for partial in ({"load_optimizer_states": False}, {"load_module_only": True}):
            with pytest.raises(RuntimeError, match=r"after a failed step .* load a checkpoint whole first"):
                engine.load_checkpoint(tmp_path / "ckpt", **partial)
        engine.load_checkpoint(tmp_path / "ckpt")  # whole: the way out
        for x, y in data[:2]:  # the window's last backward starts its updates: its moments are no one's to keep
            engine.backward(lm_loss(engine(x), y))
        with pytest.raises(RuntimeError, match=r"load_module_only=True\): this window's updates have started"):
            engine.load_checkpoint(tmp_path / "ckpt", load_module_only=True)
        engine.step()


def test_a_checkpoint_loads_into_another_accumulation_and_another_trainable_set(tmp_path):
    """Fine-tuning from another run's checkpoint, as DeepSpeed's load_checkpoint does it: with another
    gradient_accumulation_steps the first window after the load is a whole one, however much is loaded; the
    weights alone load by name into a model with some layers frozen (or all: forward only), and a whole load
    names the parameters whose trainability differs; fp16's skipped steps come back with the step count."""
    data = batches(8)
    with offload.initialize(make(), config(tmp_path / "a", "cpu")) as engine:
        train(engine, data[:3])
        engine.save_checkpoint(tmp_path / "ckpt")
        saved = engine.consolidated_state_dict()
    for options in ({}, {"load_optimizer_states": False}, {"load_module_only": True}):
        with offload.initialize(make(), config(tmp_path / "b", "cpu", gradient_accumulation_steps=4)) as engine:
            engine.load_checkpoint(tmp_path / "ckpt", **options)
            applied = []
            for x, y in data:
                engine.backward(lm_loss(engine(x), y))
                engine.step()
                applied.append(engine.was_step_applied())
            assert applied == [False, False, False, True] * 2, options
    frozen = make(seed=7)
    frozen.tok.requires_grad_(False)
    cases = {"layer": (frozen, config(tmp_path / "c", "cpu")),
             "all": (make(seed=7).requires_grad_(False), {"zero_optimization": {"stage": 3, "offload_param": {
                 "device": "cpu"}}})}
    for name, (model, cfg) in cases.items():
        for options in ({"load_optimizer_states": False}, {"load_module_only": True}):
            with offload.initialize(model, cfg) as engine:
                engine.load_checkpoint(tmp_path / "ckpt", **options)
                got = engine.consolidated_state_dict()
                assert all(torch.equal(got[k], saved[k]) for k in saved), (name, options)
    with offload.initialize(frozen, config(tmp_path / "d", "cpu")) as engine:
        with pytest.raises(ValueError, match=r"\['tok.weight'\] are trainable in one and frozen in the other: a "
                                             r"whole load needs the same trainable parameters"):
            engine.load_checkpoint(tmp_path / "ckpt")
    bf16 = make(seed=7)  # frozen when saved, in bf16 (the training dtype); trainable now: its fp32 master
    bf16.tok.requires_grad_(False)
    with offload.initialize(bf16, config(tmp_path / "f", "cpu", bf16={"enabled": True})) as engine:
        engine.save_checkpoint(tmp_path / "bf16")
        saved_bf16 = engine.consolidated_state_dict()
    for options in ({"load_optimizer_states": False}, {"load_module_only": True}):
        with offload.initialize(make(), config(tmp_path / "g", "cpu", bf16={"enabled": True})) as engine:
            engine.load_checkpoint(tmp_path / "bf16", **options)
            got = engine.consolidated_state_dict()
            assert all(torch.equal(got[k], saved_bf16[k].float()) for k in saved_bf16), options
    fp16 = config(tmp_path / "e", "cpu", fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    with offload.initialize(make(), fp16) as engine:
        for i, (x, y) in enumerate(data[:6]):
            engine.backward(lm_loss(engine(x), y) * (float("inf") if i in (1, 4, 5) else 1.0))
            engine.step()
            if i == 2:
                engine.save_checkpoint(tmp_path / "fp16")
        assert (engine.global_steps, engine.skipped_steps) == (6, 3)
        engine.load_checkpoint(tmp_path / "fp16", load_optimizer_states=False)
        assert (engine.global_steps, engine.skipped_steps) == (3, 1)


def test_a_resume_keeps_the_count_of_a_window_a_loop_ended_early(tmp_path):
    """gradient_accumulation_steps 2, the first window ended after one batch (set_gradient_accumulation_boundary),
    a checkpoint then: resumed under the same setting the windows fall where the straight run's fall, bit for
    bit (the count is only realigned under another setting)."""
    data = batches(5)

    def run(engine, batches_: list, applied: list) -> None:
        for i, (x, y) in batches_:
            engine.set_gradient_accumulation_boundary(True if i == 0 else None)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            applied.append(engine.was_step_applied())

    straight, resumed = [], []
    with offload.initialize(make(), config(tmp_path / "a", "cpu", gradient_accumulation_steps=2)) as engine:
        run(engine, list(enumerate(data))[:1], straight)
        engine.save_checkpoint(tmp_path / "ckpt")
        run(engine, list(enumerate(data))[1:], straight)
        want = engine.consolidated_state_dict()
    with offload.initialize(make(), config(tmp_path / "b", "cpu", gradient_accumulation_steps=2)) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        run(engine, list(enumerate(data))[1:], resumed)
        got = engine.consolidated_state_dict()
    assert straight == [True, True, False, True, False] and resumed == straight[1:]
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("how", ["engine", "model", "gathered"])
def test_weights_written_inside_a_window(tmp_path, how):
    """Weights written between backward and step(), by ``engine.load_state_dict``, the model's own
    ``load_state_dict`` or an edit in ``engine.gathered()``: before the window's updates start (the first
    micro-batch of 2) the step applies to them, as torch's does; once its last backward started the updates
    (they run beside it) the write is refused, naming step(), and the step completes unchanged."""
    data = batches(4)
    loaded = {k: v + 0.01 for k, v in make(seed=5).state_dict().items()}

    def write(engine) -> None:
        if how == "engine":
            engine.load_state_dict(loaded)
        elif how == "model":
            engine.module.load_state_dict(loaded)
        else:
            with engine.gathered():
                for k, p in engine.module.named_parameters():
                    p.data.copy_(loaded[k])

    ref = reference_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for i, (x, y) in enumerate(data):
        (lm_loss(ref(on_device(x)), y) / 2).backward()
        if i == 0:
            ref.load_state_dict(loaded)
        if i % 2:
            opt.step()
            opt.zero_grad()
    with offload.initialize(make(), config(tmp_path, "cpu", gradient_accumulation_steps=2)) as engine:
        for i, (x, y) in enumerate(data):
            engine.backward(lm_loss(engine(x), y))
            if i == 0:
                write(engine)
            if i == 3:
                assert engine.optimizer.sub_groups_overlapped > 0
                with pytest.raises(RuntimeError, match=r"between the backward that started this window's updates "
                                                       r".* call engine.step\(\) first"):
                    write(engine)
            engine.step()
        got = engine.consolidated_state_dict()
    for k, r in ref.state_dict().items():
        close_enough(got[k], r, 1e-5)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_zero_grad_drops_an_unfinished_window_and_refuses_a_started_one(tmp_path, device):
    """A loop interrupted after the first micro-batch of a window of 2: ``engine.zero_grad()`` drops it, and the
    run that follows is bit-identical to one that never saw it (the micro-batch count included). After the last
    micro-batch's backward the updates have started: zero_grad refuses, naming step(), which still completes it."""
    data = batches(5)
    cfg = config(tmp_path, device, gradient_accumulation_steps=2)
    with offload.initialize(make(), cfg) as engine:
        train(engine, data[:4])
        expected = engine.consolidated_state_dict()
    with offload.initialize(make(), cfg) as engine:
        engine.zero_grad()  # idle: nothing to drop
        x, y = data[4]
        engine.backward(lm_loss(engine(x), y))
        engine.zero_grad()
        assert engine.micro_steps == 0 and not engine.is_gradient_accumulation_boundary()  # micro-batch 1 of 2
        train(engine, data[:2])
        for x, y in data[2:4]:
            engine.backward(lm_loss(engine(x), y))
        with pytest.raises(RuntimeError, match=r"updates have started .* engine\.step\(\)"):
            engine.zero_grad()
        engine.step()
        got = engine.consolidated_state_dict()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_a_checkpoint_inside_an_accumulation_window_is_refused(tmp_path):
    """A checkpoint holds no gradients: saved mid-window, a resume silently lost the window's first micro-batches
    (probed: parameters 0.013 off an uninterrupted run). Refused, naming where to save; at the boundary it works."""
    data = batches(4)
    with offload.initialize(make(), config(tmp_path, "cpu", gradient_accumulation_steps=2)) as engine:
        x, y = data[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()  # the first of two micro-batches: gradients held
        with pytest.raises(RuntimeError, match=r"unfinished accumulation window held \(after micro-batch 1 of 2.*"
                                               r"Save after the engine.step\(\) that ends the window"):
            engine.save_checkpoint(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()
        x, y = data[1]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")


KILLED_AT_LATEST = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
import offload
from models import batches, lm_loss, make
engine = offload.initialize(make(), {cfg!r})
real = os.replace
for i, (x, y) in enumerate(batches(3)):
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    if i == 2:  # the third save is killed after its folder is renamed into place, before latest names it
        os.replace = lambda a, b, *rest: os.kill(os.getpid(), signal.SIGKILL) if str(b).endswith("latest") else \
            real(a, b, *rest)
    engine.save_checkpoint({ckpt!r})
"""


def test_a_run_killed_inside_a_commit_resumes_and_saves_that_tag_again(tmp_path):
    """SIGKILL between a checkpoint folder's rename into place and ``latest`` naming it: the resumed run loads the
    one before (latest's) and, reaching that step again, saves its tag again (it raised "already exists" and the
    training loop died); a committed tag (latest's, an older one, one with a file added since) is never
    overwritten: only a tag whose commit marker is still there."""
    import subprocess
    import sys

    cfg = config(tmp_path, "cpu")
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AT_LATEST.format(tests=str(Path(__file__).resolve().parent), cfg=cfg,
                                              ckpt=str(tmp_path / "ck")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == -9, done.stderr[-3000:]
    assert (tmp_path / "ck" / "latest").read_text() == "step2" and (tmp_path / "ck" / "step3").is_dir()
    data = batches(3)
    with offload.initialize(make(seed=1), cfg) as engine:
        engine.load_checkpoint(tmp_path / "ck")
        assert engine.global_steps == 2
        x, y = data[2]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        assert engine.save_checkpoint(tmp_path / "ck").name == "step3"
        assert (tmp_path / "ck" / "latest").read_text() == "step3"
        (tmp_path / "ck" / "step1" / "NOTES.txt").write_text("x")  # a file added to a committed one: still kept
        with pytest.raises(ValueError, match="already exists"):
            engine.save_checkpoint(tmp_path / "ck", tag="step1")
        assert (tmp_path / "ck" / "step1" / "NOTES.txt").exists()
        assert not list((tmp_path / "ck").glob(".committing-*"))
        with pytest.raises(ValueError, match="already exists"):
            engine.save_checkpoint(tmp_path / "ck")


def test_checkpoint_errors(tmp_path):
    with offload.initialize(make(), config(tmp_path, "cpu")) as engine:
        engine_dir = tmp_path / "ckpt"
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            engine.load_checkpoint(engine_dir)
        engine.save_checkpoint(engine_dir, tag="t")
        with pytest.raises(ValueError, match="already exists"):
            engine.save_checkpoint(engine_dir, tag="t")
        with pytest.raises(ValueError, match="plain name"):
            engine.save_checkpoint(engine_dir, tag="../evil")
        # the folder save_checkpoint returns (one tag's) loads as that tag; a file is named as not a folder; a
        # number is a tag as its text (DeepSpeed's str(tag))
        engine.save_checkpoint(engine_dir, tag="u")
        assert engine.save_checkpoint(engine_dir, tag=0).name == "0"
        assert engine.load_checkpoint(engine_dir, 0) == (engine_dir / "0", {})  # DeepSpeed's (path, client_state)
        # DeepSpeed's client_state: the loop's own values saved with the checkpoint and given back by the load; one
        # a safe load cannot read back is refused before anything is written
        state = {"epoch": 3, "seen": [1, 2], "rng": torch.arange(4)}
        engine.save_checkpoint(engine_dir, tag="c", client_state=state)
        folder, got = engine.load_checkpoint(engine_dir, "c")
        assert folder == engine_dir / "c" and got.keys() == state.keys() and torch.equal(got["rng"], state["rng"])
        for bad, kind in ((object(), "object"), (lambda: 0, "function"), ([1, np.float64(2)], "list")):
            with pytest.raises(ValueError, match=f"client_state\\['obj'\\] holds a {kind} that a safe load cannot"):
                engine.save_checkpoint(engine_dir, tag="d", client_state={"epoch": 3, "obj": bad})
            assert not (engine_dir / "d").exists()
        with pytest.raises(ValueError, match=r"client_state, a defaultdict with keys of types \['str'\], is something"):
            engine.save_checkpoint(engine_dir, tag="d", client_state=collections.defaultdict(list, epoch=[3]))
        assert engine.load_checkpoint(engine_dir / "t")[0].name == "t"
        with pytest.raises(NotADirectoryError, match=f"{engine_dir / 't' / 'meta.json'} is a file, not a checkpoint"):
            engine.load_checkpoint(engine_dir / "t" / "meta.json")
    with offload.initialize(make(d=48), config(tmp_path, "cpu")) as other:
        with pytest.raises(ValueError, match=r"does not match the model: .*shapes differ for \d+ \(pos: checkpoint "
                                             r"\[\d+, \d+\], model \[\d+, 48\];.*offload export"):
            other.load_checkpoint(engine_dir)


def test_a_save_that_fills_the_disk_gives_the_space_back(small_ext4):
    """A checkpoint that does not fit (a real ENOSPC from a 16 MiB filesystem) raises it, leaves the previous
    checkpoint the latest and loadable, and removes its partial directory: the disk has as much room as before."""
    root = small_ext4 / "ckpt"
    with offload.initialize(make(d=192), config(small_ext4, "cpu")) as engine:
        train(engine, batches(1))
        engine.save_checkpoint(root, tag="a")
        expected = engine.consolidated_state_dict()
        free = os.statvfs(small_ext4).f_bavail
        train(engine, batches(1, seed=5))
        with pytest.raises(OSError) as info:
            engine.save_checkpoint(root, tag="b")
        assert info.value.errno == errno.ENOSPC, info.value
        assert f"in {root}/.tmp-b-" in str(info.value), info.value  # the file it was writing, named
        assert sorted(p.name for p in root.iterdir()) == ["a", "latest"]
        assert os.statvfs(small_ext4).f_bavail == free
    with offload.initialize(make(d=192), config(small_ext4, "cpu")) as engine:
        assert engine.load_checkpoint(root)[0].name == "a"
        loaded = engine.consolidated_state_dict()
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k


def test_a_disk_filled_after_initialize_does_not_stop_the_steps(small_ext4):
    """Parameters and optimizer on a disk another process fills to its last block once initialize is done: the
    steps go on (their swap files were reserved whole at initialize, every rewrite lands in that room) and the
    files do not grow; before, the files grew past what initialize had checked and the step failed with ENOSPC."""
    swap = small_ext4 / "swap"
    cfg = config(small_ext4, "nvme", gradient_accumulation_steps=2, gradient_clipping=0.5, zero_optimization={
        "stage": 3, "sub_group_size": 8192, "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
        "offload_param": {"device": "nvme", "nvme_path": str(swap)}})
    filler = small_ext4 / "filler"
    with offload.initialize(make(d=96), cfg) as engine:
        sizes = {f: f.stat().st_size for f in swap.rglob("swap.*")}
        try:
            with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:  # to the last block (root's reserved ones too)
                    f.write(b"x" * (1 << 16))
            train(engine, batches(8), gas=2)
            engine.write_parameter(engine.module.tok.weight, torch.zeros_like(engine.module.tok.weight))  # a load's
            assert engine.global_steps == 4
            assert {f: f.stat().st_size for f in swap.rglob("swap.*")} == sizes
        finally:
            filler.unlink()
    assert engine.phase is offload.Phase.CLOSED and not any(swap.rglob("swap.*"))


def test_a_killed_save_is_cleared_by_the_next_save_of_its_tag(tmp_path):
    """The temporary directory of a save whose process died is removed by the next save of that tag (a tag with
    glob characters too); one of a live process (this one's parent), and a dead one of another tag that shares
    the prefix, are left alone."""
    root = tmp_path / "ckpt"
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    (root / f".tmp-b[1]-{dead}").mkdir(parents=True)
    (root / f".tmp-b[1]-{dead}" / "tensors.bin").write_bytes(b"x" * 4096)
    for kept in (f".tmp-b[1]-{os.getppid()}", f".tmp-b[1]-c-{dead}"):
        (root / kept).mkdir()
    with offload.initialize(make(), config(tmp_path, "cpu")) as engine:
        engine.save_checkpoint(root, tag="b[1]")
    assert sorted(p.name for p in root.iterdir()) == sorted([f".tmp-b[1]-{os.getppid()}", f".tmp-b[1]-c-{dead}",
                                                             "b[1]", "latest"])


def test_a_save_that_fails_to_commit_leaves_no_trace(tmp_path, monkeypatch):
    """A failure after every shard is written (renaming the directory into place, or replacing ``latest``)
    raises, removes what it wrote and leaves the previous checkpoint the latest; so does a folder that cannot be
    made. The engine goes on and saves again."""
    (tmp_path / "a-file").write_text("")
    root = tmp_path / "ckpt"
    with offload.initialize(make(), config(tmp_path, "cpu")) as engine:
        train(engine, batches(1))
        engine.save_checkpoint(root, tag="a")
        rename = os.rename

        def failing(src, dst):
            raise OSError(errno.EIO, "Input/output error (injected)")

        monkeypatch.setattr(os, "rename", failing)
        with pytest.raises(OSError, match="injected"):
            engine.save_checkpoint(root, tag="b")
        assert sorted(p.name for p in root.iterdir()) == ["a", "latest"] and (root / "latest").read_text() == "a"
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "replace", failing)  # renamed into place, then `latest` cannot be replaced
        with pytest.raises(OSError, match="injected"):
            engine.save_checkpoint(root, tag="b")
        assert sorted(p.name for p in root.iterdir()) == ["a", "latest"] and (root / "latest").read_text() == "a"
        monkeypatch.undo()
        with pytest.raises(OSError):  # the folder cannot be made: a file is in the way
            engine.save_checkpoint(tmp_path / "a-file" / "ckpt", tag="c")
        train(engine, batches(1, seed=5))
        engine.save_checkpoint(root, tag="b")
    assert (root / "latest").read_text() == "b"


def test_a_load_that_fails_after_it_began_writing_leaves_the_engine_failed(tmp_path, monkeypatch):
    """A load whose disk fails after the checkpoint passed its checks, while the state is being overwritten
    (an EIO injected into the third tensor read): the engine refuses to go on until a good checkpoint is loaded.
    A checkpoint cut short fails the checks instead and changes nothing."""
    from offload.persist._reader import Checkpoint

    data = batches(4)
    with offload.initialize(make(), config(tmp_path, "nvme")) as engine:
        train(engine, data[:2])
        engine.save_checkpoint(tmp_path / "ckpt", tag="good")
        short = engine.save_checkpoint(tmp_path / "ckpt", tag="short")
        for f in short.rglob("*.bin"):
            os.truncate(f, f.stat().st_size // 2)
        with pytest.raises(ValueError, match="truncated"):
            engine.load_checkpoint(tmp_path / "ckpt", tag="short")
        assert engine.phase is offload.Phase.IDLE
        for damage in ("cut", "gone"):  # a client_state that cannot be read back: named, and nothing loaded
            bad = engine.save_checkpoint(tmp_path / "ckpt", tag=damage, client_state={"epoch": 2})
            if damage == "cut":
                os.truncate(bad / "client_state.pt", 10)
            else:
                (bad / "client_state.pt").unlink()
            with pytest.raises(ValueError, match=rf"checkpoint {bad}.* is damaged.*nothing was loaded"):
                engine.load_checkpoint(tmp_path / "ckpt", tag=damage)
            assert engine.phase is offload.Phase.IDLE
        monkeypatch.setattr(Checkpoint, "read_range",
                            fails_on_call(Checkpoint.read_range, 3, OSError(5, "injected EIO")))
        with pytest.raises(OSError, match="injected EIO"):
            engine.load_checkpoint(tmp_path / "ckpt", tag="good")
        monkeypatch.undo()
        failed_until_loaded(engine, tmp_path / "ckpt", "engine.load_checkpoint raised ", data[2], data[2:])
        assert engine.global_steps == 4


@pytest.mark.parametrize("entry", ["param/blocks.0.qkv.weight", "exp_avg_sq/tok.weight", "buffer"])
def test_a_checkpoint_changed_on_disk_after_the_save_fails_its_load_naming_the_entry(tmp_path, entry):
    """One byte of a master weight, of an Adam moment or of a buffer flipped in tensors.bin after the save: the
    load (and an export) fails naming the file and the entry, where it used to load the wrong value silently; the
    engine then refuses to train until a good checkpoint is loaded, and the untouched one loads exactly."""
    from offload.persist import export

    data = batches(4)
    model = make()
    model.register_buffer("scale", torch.arange(6.0))
    with offload.initialize(model, config(tmp_path, "nvme")) as engine:
        train(engine, data[:2])
        good = engine.save_checkpoint(tmp_path / "ckpt", tag="good")
        bad = engine.save_checkpoint(tmp_path / "ckpt", tag="bad")
        index = json.loads((bad / "index.0.json").read_text())
        name = "buffer/scale" if entry == "buffer" else entry
        where = index[name]["offset"] + 4 * 3 + 1  # the second byte of the fourth element
        with open(bad / "tensors.bin", "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(ValueError, match=rf"checkpoint {bad / 'tensors.bin'}: {re.escape(name)}, elements "
                                             r"\[0, \d+\), does not match the checksum written with it"):
            engine.load_checkpoint(tmp_path / "ckpt", tag="bad")
        if not name.startswith("exp_avg"):  # (an export reads the weights and buffers)
            with pytest.raises(ValueError, match="does not match the checksum"):
                export(tmp_path / "ckpt", tmp_path / "out.pt", tag="bad")
        engine.load_checkpoint(tmp_path / "ckpt", tag="good")
        train(engine, data[2:])
        state = engine.consolidated_state_dict()
    with offload.initialize(make(), config(tmp_path / "again", "nvme")) as engine:
        engine.module.register_buffer("scale", torch.zeros(6))
        engine.load_checkpoint(good.parent, tag="good")
        train(engine, data[2:])
        again = engine.consolidated_state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)


def test_the_weights_of_a_tied_checkpoint_load_into_a_model_untied_since(tmp_path):
    """Saved with the output head tied to the token embedding, loaded (the weights alone) into the same model with
    a head of its own: the head gets the saved embedding, as the checkpoint's state_dict keys say (before, the load
    refused it as missing)."""
    with offload.initialize(make(), config(tmp_path, "cpu")) as engine:
        train(engine, batches(2))
        engine.save_checkpoint(tmp_path / "ckpt")
        saved = engine.consolidated_state_dict()
    untied = make(seed=4)
    untied.head.weight = torch.nn.Parameter(torch.zeros_like(untied.head.weight))
    with offload.initialize(untied, config(tmp_path, "cpu")) as engine:
        with pytest.raises(ValueError, match="does not match the model"):  # Adam's state has no separate head
            engine.load_checkpoint(tmp_path / "ckpt")
        engine.load_checkpoint(tmp_path / "ckpt", load_module_only=True)
        state = engine.consolidated_state_dict()
    assert torch.equal(state["head.weight"], saved["tok.weight"])
    assert torch.equal(state["tok.weight"], saved["tok.weight"])


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), cuts=st.lists(st.integers(0, 3000), max_size=5),
       reads=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 3000)), min_size=1, max_size=6),
       flip=st.one_of(st.none(), st.integers(0, 3000)), chunk=st.sampled_from([None, 37]))
def test_checkpoint_tensor_files_check_every_piece_a_read_touches(numel, cuts, reads, flip, chunk):
    """An entry written in pieces (as sub-groups and ranks write a parameter), read back in other ranges (as
    another layout or number of ranks cuts them): every read returns the written values, and with one byte flipped
    in one piece, exactly the reads that touch that piece fail (one covering it in part reads it whole to check).
    ``chunk``: elements per checksum within a write (the files' 64 MiB, made small)."""
    from offload.persist import _format
    from offload.persist._format import TensorFile

    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    index = TensorFile.plan([("e", torch.float32, (numel,))])
    bounds = sorted({0, numel, *(c % numel for c in cuts)})
    step = chunk or numel
    pieces = [(i, min(i + step, b)) for a, b in zip(bounds, bounds[1:]) for i in range(a, b, step)]
    with tempfile.TemporaryDirectory() as tmp, \
            unittest.mock.patch.object(_format, "_SUM_BYTES", 4 * chunk if chunk else _format._SUM_BYTES):
        path = Path(tmp) / "tensors.bin"
        f = TensorFile(path, index, write=True)
        for a, b in zip(bounds, bounds[1:]):
            f.write("e", values[a:b], a)
        f.close()
        assert [(s, s + n) for s, n, _ in index["e"]["sums"]["pieces"]] == pieces
        bad = None
        if flip is not None:
            flip %= numel
            bad = next((a, b) for a, b in pieces if a <= flip < b)
            with open(path, "r+b") as raw:
                raw.seek(index["e"]["offset"] + 4 * flip + 2)
                byte = raw.read(1)
                raw.seek(-1, os.SEEK_CUR)
                raw.write(bytes([byte[0] ^ 0x10]))
        r = TensorFile(path, index, write=False)
        try:
            for start, n in reads:
                start %= numel
                n = min(n, numel - start)
                out = torch.empty(n)
                if bad is not None and start < bad[1] and bad[0] < start + n:
                    with pytest.raises(ValueError, match=rf"e, elements \[{bad[0]}, {bad[1]}\), does not match"):
                        r.read_into("e", out, start)
                else:
                    r.read_into("e", out, start)
                    assert torch.equal(out, values[start : start + n])
        finally:
            r.close()


KILLED_SAVE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import offload
    from models import make, batches, lm_loss
    torch.manual_seed(0)
    model = make(d=384, layers=6)
    cfg = {{"zero_optimization": {{"offload_optimizer": {{"device": "nvme", "nvme_path": {nvme!r}}}}}}}
    engine = offload.initialize(model, cfg)
    for x, y in batches(2):
        engine.backward(lm_loss(engine(x), y)); engine.step()
    engine.save_checkpoint({ckpt!r}, tag="a")
    print("SAVED", flush=True)
    for x, y in batches(1, seed=5):
        engine.backward(lm_loss(engine(x), y)); engine.step()
    while True:
        engine.save_checkpoint({ckpt!r}, tag="b")
        import shutil; shutil.rmtree({ckpt!r} + "/b")
""")


def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), nvme=str(tmp_path / "nvme"), ckpt=str(ckpt))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SAVED"
        deadline = time.monotonic() + 120
        while not list(ckpt.glob(".tmp-b-*/tensors.bin")):  # a save of "b" has started writing
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert (ckpt / "latest").read_text() == "a"
    model = make(d=384, layers=6)
    with offload.initialize(model, config(tmp_path / "load", "cpu")) as engine:
        assert engine.load_checkpoint(ckpt)[0].name == "a"
        loaded = engine.consolidated_state_dict()
    ref = make(d=384, layers=6)  # the same two steps, here, from the same seed
    cfg = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    with offload.initialize(ref, cfg) as engine:
        for x, y in batches(2):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        expected = engine.consolidated_state_dict()
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k


def test_close_joins_threads_and_removes_swap_files(tmp_path):
    engine = offload.initialize(make(), config(tmp_path, "nvme"))
    train(engine, batches(2))
    assert [t for t in threading.enumerate() if t.name == "offload-stepper"]
    engine.close()
    engine.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(("offload", "nvme_swapper"))]
    assert list((tmp_path / "nvme").iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_an_engine_left_open_is_closed_at_exit(tmp_path):
    """A script that never closes its engine (optimizer and parameters on NVMe) exits cleanly: the engine is closed
    at interpreter exit, its threads joined and its swap files removed."""
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        import offload
        from models import batches, lm_loss, make
        cfg = {{"zero_optimization": {{"stage": 3, "sub_group_size": 4096,
                "offload_optimizer": {{"device": "nvme", "nvme_path": {str(tmp_path / "opt")!r}}},
                "offload_param": {{"device": "nvme", "nvme_path": {str(tmp_path / "param")!r}}}}}}}
        engine = offload.initialize(make(), cfg)
        for x, y in batches(2):
            engine.backward(lm_loss(engine(x), y)); engine.step()
        print(any(p.is_file() for p in __import__("pathlib").Path({str(tmp_path)!r}).rglob("*")), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_param_groups_and_lr_scheduler(tmp_path):
    data = batches(6)
    model = make()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]
    with offload.initialize(model, config(tmp_path, "nvme"), param_groups=groups) as engine:
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)
        for x, y in data:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            sched.step()
    ref = reference_model()
    rd = [p for n, p in ref.named_parameters() if p.dim() >= 2]
    rn = [p for n, p in ref.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": rd, "weight_decay": 0.1}, {"params": rn, "weight_decay": 0.0, "lr": 1e-3}],
                            lr=LR, betas=(0.9, 0.99), eps=1e-8)
    rsched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for x, y in data:
        opt.zero_grad()
        lm_loss(ref(on_device(x)), y).backward()
        opt.step()
        rsched.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)
    fresh = make()
    partial = [p for p in fresh.parameters() if p.dim() >= 2]
    with pytest.raises(ValueError, match="leave .* trainable parameter"):
        offload.initialize(fresh, config(tmp_path, "cpu"), param_groups=[{"params": partial}])
    with pytest.raises(ValueError, match="not a trainable parameter"):
        offload.initialize(fresh, config(tmp_path, "cpu"), param_groups=[{"params": decay}])


def test_a_checkpoint_gives_each_param_group_its_settings_by_the_parameters_it_holds(tmp_path):
    """Saved with the decayed weights in the first group, loaded into an engine that lists the groups the other
    way round: each group keeps its own weight decay and lr, and training on ends where torch's AdamW with those
    groups ends. Groups that hold other parameters are refused before anything is written, naming both sides; the
    weights alone still load. The count of samples seen goes on from the checkpoint's under another batch size."""
    data = batches(6)

    def groups(model, flipped=False):
        decay = {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1}
        rest = {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-3}
        return [rest, decay] if flipped else [decay, rest]

    model = make()
    with offload.initialize(model, config(tmp_path, "nvme", train_micro_batch_size_per_gpu=4),
                            param_groups=groups(model)) as engine:
        for x, y in data[:3]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        assert engine.global_samples == 12
    model = make(seed=7)
    with offload.initialize(model, config(tmp_path, "nvme", train_micro_batch_size_per_gpu=2,
                                          gradient_accumulation_steps=2),
                            param_groups=groups(model, flipped=True)) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert [(g["weight_decay"], g["lr"]) for g in engine.optimizer.param_groups] == [(0.0, 1e-3), (0.1, LR)]
        assert engine.global_samples == 12
        for x, y in data[3:]:
            for half in (slice(0, 2), slice(2, 4)):
                engine.backward(lm_loss(engine(x[half]), y[half]) * 2 * (x[half].shape[0] / x.shape[0]))
                engine.step()
        assert engine.global_samples == 12 + 3 * 4
    ref = reference_model()
    opt = torch.optim.AdamW(groups(ref), lr=LR, betas=(0.9, 0.99), eps=1e-8)
    for x, y in data:
        opt.zero_grad()
        lm_loss(ref(on_device(x)), on_device(y)).backward()
        opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)
    model = make()
    with offload.initialize(model, config(tmp_path, "cpu")) as engine:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"does not match the optimizer's param groups: it has 2 group\(s\) "
                                             r"\(\d+ parameter\(s\) \['.*this engine 1 .*load_optimizer_states=False"):
            engine.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        engine.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)
        assert engine.global_steps == 3


def warmup_lr(t: int, lo: float, hi: float, warm: int, total: int | None) -> float:
    """The lr of optimizer step t (0: the first update) under DeepSpeed's WarmupLR / WarmupDecayLR (log warm-up,
    ``warm`` >= 2), computed independently: DeepSpeed sets warmup_min_lr when it builds the scheduler and steps it
    after each update, so update t takes the value after t - 1 scheduler steps (the first two: warmup_min_lr)."""
    s = t - 1
    g = 0.0 if s < 0 else math.log(s + 1) / math.log(warm) if s < warm else 1.0 if total is None else \
        max(0.0, (total - s) / max(1, total - warm))
    return lo + (hi - lo) * g


def test_warmup_without_a_max_lr_warms_each_group_to_its_own_lr(tmp_path):
    """WarmupLR without warmup_max_lr (DeepSpeed 0.17.2 on): each param group warms up to its own lr, keeping
    the groups' ratio (before, every group went to 1e-3, 20x an lr of 5e-5); warmup_num_steps 1 counts as 2."""
    model = make()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_type": "linear"}}
    with offload.initialize(model, config(tmp_path, "cpu", scheduler=sched),
                            param_groups=[{"params": decay, "lr": 5e-5}, {"params": rest, "lr": 5e-4}]) as engine:
        lrs = [engine.get_lr()]
        for x, y in batches(3):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            lrs.append(engine.get_lr())
    # DeepSpeed's sequence for n = 2: updates 0 and 1 at warmup_min_lr, update 2 half way, then the group's lr
    assert lrs == [[0.0, 0.0], [0.0, 0.0], [pytest.approx(2.5e-5), pytest.approx(2.5e-4)], [5e-5, 5e-4]]


def test_a_deepspeed_script_runs_with_its_keywords_and_accessors(tmp_path, caplog):
    """What a DeepSpeed training script calls, ported unchanged: initialize's keywords (config_params, args with
    deepspeed_config, model_parameters with a frozen parameter in it, a scheduler callable), the accessors it
    reads. The scheduler's lrs are torch's LambdaLR's on a plain optimizer; what has no counterpart (a torch
    optimizer, a data set, the 4-tuple) is refused naming the fix."""
    import argparse

    model = make()
    model.pos.requires_grad_(False)
    cfg = config(tmp_path, "cpu", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)

    def decay(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))

    engine = offload.initialize(model=model, args=args, model_parameters=model.parameters(), lr_scheduler=decay)
    with engine:
        assert engine.gradient_accumulation_steps == 2  # a number here; DeepSpeed's is a method
        assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (2, 4)
        assert engine.get_mom() == [(0.9, 0.99)] and engine.gradient_clipping() == 0.0
        assert not engine.fp16_enabled() and not engine.bfloat16_enabled() and engine.zero_optimization_stage() == 0
        assert (engine.global_rank, engine.dp_world_size, engine.local_rank) == (0, 1, 0)
        train(engine, batches(6), gas=2)
        assert engine.global_steps == 3 and engine.global_samples == 12
        assert engine.get_lr() == [pytest.approx(LR / 4)]  # LambdaLR after 3 steps
        assert not any(p is model.pos for p in engine.layout.params)
        with pytest.raises(TypeError, match=r"returns the engine alone.*engine = offload.initialize"):
            _, _, _, _ = engine
    grouped = make()
    grouped.pos.requires_grad_(False)  # a frozen parameter in a group: left out, as DeepSpeed leaves it
    groups = [{"params": [p for n, p in grouped.named_parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for n, p in grouped.named_parameters() if p.dim() < 2], "weight_decay": 0.0}]
    with offload.initialize(grouped, cfg, model_parameters=groups) as engine:
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
        assert not any(p is grouped.pos for p in engine.layout.params)
    with pytest.raises(TypeError, match=r"optimizer=.*config's optimizer section"):
        offload.initialize(make(), cfg, optimizer=torch.optim.AdamW(make().parameters()))
    with pytest.raises(TypeError, match=r"training_data=.*build the DataLoader yourself"):
        offload.initialize(make(), cfg, training_data=[1, 2])
    plain = torch.optim.SGD(make().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"lr_scheduler=.*pass a callable"):
        offload.initialize(make(), cfg, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 1.0))
    caplog.clear()
    with caplog.at_level("WARNING", logger="offload"):
        offload.initialize(make(), config_params={"train_micro_batch_size_per_gpu": 1}).close()
    assert "the config has no optimizer section, so the defaults train: AdamW, lr 0.001" in caplog.text


def deepspeed_cosine(it: int, total: int, warm: int, min_ratio: float, cos_min: float, kind: str) -> float:
    """The lr ratio of DeepSpeed's WarmupCosineLR at ``last_batch_iteration`` ``it``, written out from its
    source: 0 before the first scheduler step, a log or linear warm-up from min_ratio, then the cosine."""
    if it < 0:
        return 0.0
    warm = max(2, warm)
    if it < warm:
        rise = math.log(it + 1) / math.log(warm) if kind == "log" else it / warm
        return min_ratio + rise * (1.0 - min_ratio)
    progress = min(1.0, (it - warm + 1) / max(1, total - warm))
    return max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


@pytest.mark.parametrize("kind, warm, total", [("log", 5, 30), ("linear", 4, 10), ("linear", 8, 6)])
def test_warmup_cosine_follows_deepspeed_and_decay_defaults_to_its_max(kind, warm, total, caplog):
    """WarmupCosineLR scales each group's own lr by DeepSpeed's ratio (update t takes the ratio after t - 1
    scheduler steps), to its floor past total_num_steps; WarmupDecayLR without warmup_max_lr peaks at 1e-3 as
    DeepSpeed's does (only WarmupLR's default became the group's lr), saying so where the group's lr differs."""
    from offload.config import SchedulerConfig
    from offload.optim._schedule import WarmupSchedule
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w], "lr": 0.5}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 2.0}])
    cfg = SchedulerConfig.from_dict({"type": "WarmupCosineLR", "params": {
        "total_num_steps": total, "warmup_num_steps": warm, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
        "warmup_type": kind}})
    sched = WarmupSchedule(opt, cfg)
    for t in range(total + 5):
        ratio = deepspeed_cosine(t - 1, total, warm, 0.1, 0.01, kind)
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.5 * ratio), pytest.approx(2.0 * ratio)], t
        opt.step()
        sched.step()
    with caplog.at_level("WARNING", logger="offload"):
        decay = WarmupSchedule(torch.optim.SGD([w], lr=0.01), SchedulerConfig.from_dict(
            {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10}}))
    assert "WarmupDecayLR without warmup_max_lr peaks at DeepSpeed's default, 0.001, not the optimizer's lr (0.01)" \
        in caplog.text
    for _ in range(3):
        decay.step()
    assert decay.get_last_lr() == [pytest.approx(1e-3)]


def test_a_schedule_assigned_to_the_engine_resumes_where_it_was(tmp_path):
    """A scheduler object put on engine.lr_scheduler in place of the config's (a DeepSpeed one: its state is its
    iteration, its last lr exists only once stepped) is stepped with the updates, saved and loaded; the lr after a
    load is the saved run's next one (it took the fresh scheduler's, or failed on it)."""

    class IterationSchedule:  # the interface of DeepSpeed's schedulers (lr_schedules.py)
        def __init__(self, optimizer):
            self.optimizer, self.last_batch_iteration = optimizer, -1

        def step(self):
            self.last_batch_iteration += 1
            self._last_lr = [1e-3 / (2 + self.last_batch_iteration)] * len(self.optimizer.param_groups)
            for g, lr in zip(self.optimizer.param_groups, self._last_lr):
                g["lr"] = lr

        def get_last_lr(self):
            assert getattr(self, "_last_lr", None) is not None, "need to call step() first"
            return self._last_lr

        def state_dict(self):
            return {"last_batch_iteration": self.last_batch_iteration}

        def load_state_dict(self, sd):
            self.last_batch_iteration = sd["last_batch_iteration"]

    data = batches(3)
    with offload.initialize(make(), config(tmp_path / "a", "cpu")) as engine:
        engine.lr_scheduler = IterationSchedule(engine.optimizer)
        train(engine, data)
        assert engine.get_lr() == [pytest.approx(1e-3 / 4)]
        engine.save_checkpoint(tmp_path / "ck")
    with offload.initialize(make(seed=2), config(tmp_path / "b", "cpu")) as engine:
        engine.lr_scheduler = IterationSchedule(engine.optimizer)
        engine.load_checkpoint(tmp_path / "ck")
        assert engine.get_lr() == [pytest.approx(1e-3 / 4)]
        assert engine.lr_scheduler.last_batch_iteration == 2
        train(engine, data[:1])
        assert engine.get_lr() == [pytest.approx(1e-3 / 5)]
        engine.lr_scheduler.state_dict = lambda: {"scale": torch.ones(1)}  # not JSON: named before any write
        with pytest.raises(ValueError, match=r"engine.lr_scheduler \(IterationSchedule\) has a state_dict\(\) that is "
                                             r"not plain JSON .* client_state"):
            engine.save_checkpoint(tmp_path / "ck", tag="tensor")
        assert not (tmp_path / "ck" / "tensor").exists()


@pytest.mark.parametrize("delayed", [False, True], ids=["serial", "delayed"])
def test_config_scheduler_steps_with_the_engine_and_resumes(tmp_path, delayed):
    """The config's WarmupDecayLR sets each update's lr (the delayed update keeps the lr it was launched with while
    the scheduler moves on), and a checkpoint carries it: the reference is torch AdamW with the same lr per step."""
    data = batches(8)
    sched = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 4e-3,
                                                  "warmup_num_steps": 3, "total_num_steps": 8}}
    offload_opt = {"delayed_update": delayed}
    cfg = config(tmp_path, "cpu", scheduler=sched, zero_optimization={"offload_optimizer": {
        "device": "cpu", **offload_opt}, "sub_group_size": 4096})
    model = make()
    with offload.initialize(model, cfg) as engine:
        assert engine.get_lr() == [pytest.approx(warmup_lr(0, 1e-4, 4e-3, 3, 8))]
        train(engine, data[:4])
        engine.save_checkpoint(tmp_path / "ck")
    resumed = make(seed=5)
    with offload.initialize(resumed, cfg) as engine:
        engine.load_checkpoint(tmp_path / "ck")
        assert engine.lr_scheduler.last_epoch == 4
        assert engine.get_lr() == [pytest.approx(warmup_lr(4, 1e-4, 4e-3, 3, 8))]  # DeepSpeed's name: the next lr
        train(engine, data[4:])
        engine.apply_delayed_update()
        state = engine.consolidated_state_dict()
    def lr(t: int) -> float:
        return warmup_lr(t, 1e-4, 4e-3, 3, 8)

    if delayed:
        _, want = reference_delayed(8, data, lr)
    else:
        ref = reference_model()
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
        for t, (x, y) in enumerate(data):
            opt.zero_grad()
            lm_loss(ref(on_device(x)), y).backward()
            opt.param_groups[0]["lr"] = lr(t)
            opt.step()
        want = list(ref.parameters())
    for (name, _), r in zip(make().named_parameters(), want):
        close_enough(state[name], r.detach(), 1e-5)


@pytest.mark.parametrize("options", [{}, {"load_optimizer_states": False}], ids=["whole", "weights"])
def test_a_loaded_schedule_is_the_position_under_this_runs_config(tmp_path, options):
    """A checkpoint carries where the config's schedule is, as DeepSpeed's schedulers save it (their iteration):
    a run resumed or fine-tuned with another schedule (lower maximum, other warm-up, a decay) follows its own
    config's from that position, never the old run's maximum."""
    data = batches(8)
    first = {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 10}}
    with offload.initialize(make(), config(tmp_path / "a", "cpu", scheduler=first)) as engine:
        train(engine, data[:5])
        engine.save_checkpoint(tmp_path / "ck")
    second = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-4, "warmup_num_steps": 3,
                                                   "total_num_steps": 12}}
    with offload.initialize(make(seed=3), config(tmp_path / "b", "cpu", scheduler=second)) as engine:
        engine.load_checkpoint(tmp_path / "ck", **options)
        lrs = [engine.get_lr()[0]]
        for x, y in data[5:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([warmup_lr(t, 0.0, 1e-4, 3, 12) for t in range(5, 9)])
    with offload.initialize(make(seed=3), config(tmp_path / "c", "cpu", scheduler=second)) as engine:
        # a state saved before this change held the whole schedule: its position counts, its shape does not
        engine.lr_scheduler.load_state_dict({"last_epoch": 5, "_step_count": 6, "base_lrs": [3e-3], "min_lr": 0.0,
                                             "max_lrs": [3e-3], "warmup": 10, "kind": "log", "total": None,
                                             "_last_lr": [3e-3]})
        assert engine.lr_scheduler.get_last_lr() == pytest.approx([warmup_lr(5, 0.0, 1e-4, 3, 12)])


def test_the_boundary_is_deepspeeds_before_a_backward_and_after_it(tmp_path):
    """is_gradient_accumulation_boundary() says whether the micro-batch at hand ends its window, before its
    backward as after it (DeepSpeed's): with 3 micro-batches a window, False, False, True, False, ... both times.
    Before, it read True before the first backward and False before the third."""
    data = batches(6)
    seen = []
    with offload.initialize(make(), config(tmp_path, "cpu", gradient_accumulation_steps=3)) as engine:
        for x, y in data:
            before = engine.is_gradient_accumulation_boundary()
            loss = lm_loss(engine(x), y)
            assert engine.backward(loss) is loss  # DeepSpeed's backward returns the loss
            seen.append((before, engine.is_gradient_accumulation_boundary()))
            engine.step()
        assert engine.global_steps == 2
    assert seen == [(False, False), (False, False), (True, True)] * 2


def test_train_batch_size_sets_the_accumulation_as_deepspeed_derives_it(tmp_path):
    """train_batch_size 8 with micro-batches of 2 on one rank is 4 micro-batches per update (before, the engine
    updated after each: 4x the steps, without a word); any two of the three keys give the third, and three that
    disagree are refused naming them."""
    data = batches(8, bsz=2)
    with offload.initialize(make(), config(tmp_path, "cpu", train_batch_size=8,
                                           train_micro_batch_size_per_gpu=2)) as engine:
        assert engine.gradient_accumulation_steps == 4
        train(engine, data)
        assert engine.global_steps == 2
        got = engine.consolidated_state_dict()
    with offload.initialize(make(), config(tmp_path, "cpu", gradient_accumulation_steps=4)) as engine:
        train(engine, data)
        want = engine.consolidated_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with offload.initialize(make(), config(tmp_path, "cpu", train_batch_size=8)) as engine:
        assert (engine.config.train_micro_batch_size_per_gpu, engine.gradient_accumulation_steps) == (8, 1)
    with pytest.raises(ValueError, match=r"train_batch_size 7 must equal .* given: train_batch_size 7, "
                                         r"train_micro_batch_size_per_gpu 2\. Set two of them"):
        offload.initialize(make(), config(tmp_path, "cpu", train_batch_size=7, train_micro_batch_size_per_gpu=2))


def test_accumulation_boundary_set_by_the_caller(tmp_path):
    """set_gradient_accumulation_boundary decides where a window ends (a short last one included), and
    backward(scale_wrt_gas=False) takes a loss the caller normalised: windows of 3 and 1 micro-batches with
    gradient_accumulation_steps 3 equal torch accumulating the same windows."""
    data = batches(4)
    model = make()
    windows = [data[:3], data[3:]]
    with offload.initialize(model, config(tmp_path, "nvme", gradient_accumulation_steps=3)) as engine:
        for window in windows:
            for i, (x, y) in enumerate(window):
                engine.set_gradient_accumulation_boundary(i == len(window) - 1)
                engine.backward(lm_loss(engine(x), y) / len(window), scale_wrt_gas=False)
                engine.step()
        assert engine.global_steps == 2
        with pytest.raises(ValueError, match="True, False or None"):
            engine.set_gradient_accumulation_boundary(1)
    with offload.initialize(make(), config(tmp_path / "one", "cpu")) as engine:
        with pytest.raises(ValueError, match="gradient_accumulation_steps is 1.*longest window"):
            engine.set_gradient_accumulation_boundary(False)
    ref = reference_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for window in windows:
        opt.zero_grad()
        for x, y in window:
            (lm_loss(ref(on_device(x)), y) / len(window)).backward()
        opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)


def reference_delayed(steps: int, data, lr=None, norms: list[float] | None = None):
    """ZeRO-Offload's delayed parameter update by hand: the gradient of step t is taken at the parameters of
    update t-1 (the first two at the initial ones), while update t runs on the fp32 masters (at ``lr(t)``);
    ``norms`` gets each step's gradient norm (float64)."""
    model = reference_model()
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, betas=(0.9, 0.99), eps=1e-8)
    for t, (x, y) in enumerate(data[:steps]):
        if lr is not None:
            opt.param_groups[0]["lr"] = lr(t)
        lm_loss(model(on_device(x)), y).backward()
        grads = [p.grad for p in model.parameters()]
        if norms is not None:
            norms.append(math.sqrt(sum(float(g.double().square().sum()) for g in grads)))
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)  # the update that finished beside this step's forward/backward reaches the model
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
    return model, masters


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_delayed_update_matches_stale_reference(tmp_path, device, gradients):
    data = batches(10)
    model = make()
    cfg = config(tmp_path, device, zero_optimization={
        "offload_optimizer": {"device": device, "delayed_update": True, "nvme_path": str(tmp_path / "nvme")}})
    ref_model, masters = reference_delayed(10, data)
    with offload.initialize(model, cfg) as engine:
        train(engine, data)
        state = engine.consolidated_state_dict()
        for p, r in zip(model.parameters(), ref_model.parameters()):  # the model is one update behind
            close_enough(p.detach(), r.detach(), 1e-5)
    names = [n for n, _ in ref_model.named_parameters()]
    for name, m, p in zip(names, masters, model.parameters()):
        close_enough(state[name], m.detach(), 1e-5)
        close_enough(p.detach(), m.detach(), 1e-5)  # close() applied the last update


def test_delayed_update_resumes_bit_identically_mid_pipeline(tmp_path):
    data = batches(10)

    def cfg(sub):
        return config(tmp_path / sub, "nvme", bf16={"enabled": True}, zero_optimization={
            "offload_optimizer": {"device": "nvme", "delayed_update": True, "nvme_path": str(tmp_path / sub)}})

    model = make()
    with offload.initialize(model, cfg("a")) as engine:
        train(engine, data[:5])
        engine.save_checkpoint(tmp_path / "ckpt")  # an update is still pending for the device
        train(engine, data[5:])
        straight = engine.consolidated_state_dict()
    model2 = make(seed=7)
    with offload.initialize(model2, cfg("b")) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        train(engine, data[5:])
        resumed = engine.consolidated_state_dict()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("call", ["engine.load_state_dict", "offload.load_state_dict"])
def test_a_load_with_a_delayed_update_pending_is_not_overwritten_by_it(tmp_path, call):
    """With the delayed update a step leaves its new values pending for the device; a load after it keeps the
    loaded values on the device and in the masters (the pending update was applied over them at the next step),
    through the engine's method and through ``offload.load_state_dict(engine, ...)`` alike (which skipped it)."""
    model = make()
    cfg = config(tmp_path, "cpu", zero_optimization={"offload_optimizer": {"device": "cpu", "delayed_update": True}})
    with offload.initialize(model, cfg) as engine:
        train(engine, batches(2))
        assert engine.training_state().pending_update
        loaded = {k: torch.full_like(v, 0.125) for k, v in make(seed=3).state_dict().items()}
        if call == "engine.load_state_dict":
            engine.load_state_dict(loaded)
        else:
            offload.load_state_dict(engine, loaded)
        engine.apply_delayed_update()
        for (name, p) in model.named_parameters():
            assert torch.equal(p.detach().cpu(), loaded[name]), name
        state = engine.consolidated_state_dict()
    assert all(torch.equal(state[k], loaded[k]) for k in loaded)


@pytest.mark.parametrize("buffers", [1, 2])
def test_few_staging_buffers_still_correct(tmp_path, buffers):
    data = batches(4)
    model = make()
    cfg = config(tmp_path, "nvme", zero_optimization={
        "sub_group_size": 2048, "offload_optimizer": {"device": "nvme", "buffer_count": buffers,
                                                      "nvme_path": str(tmp_path / "nvme")}})
    with offload.initialize(model, cfg) as engine:
        train(engine, data)
    ref = reference_fp32(4, data)
    for p, r in zip(model.parameters(), ref.parameters()):
        close_enough(p.detach(), r.detach(), 1e-5)


def test_a_gradient_that_arrives_twice_in_one_backward_is_named(tmp_path):
    """Reentrant checkpointing over a layer also used outside the segment makes autograd finish its gradient twice;
    the engine says so (summing silently would race the overlapped update) and names the fix."""
    from torch.utils.checkpoint import checkpoint

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.lin, torch.tanh(self.lin(x)), use_reentrant=True).sum()

    with offload.initialize(Twice(), config(tmp_path, "cpu")) as engine:
        with pytest.raises(RuntimeError, match="got its gradient twice in one backward.*use_reentrant=False"):
            engine.backward(engine(torch.randn(4, 8)))


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_loss_backward_instead_of_engine_backward_is_named_and_changes_nothing(tmp_path, params):
    """``loss.backward()`` (plain torch's habit) fails at the first gradient, naming engine.backward; the gradient
    it had made is dropped, so training from there matches torch's AdamW."""
    data = batches(4)
    cfg = config(tmp_path, "cpu", zero_optimization={"stage": 3 if params != "none" else 2,
                                                     "offload_param": {"device": params}})
    with offload.initialize(make(), cfg) as engine:
        x, y = data[0]
        with pytest.raises(RuntimeError, match=r"outside engine\.backward\(loss\): call engine\.backward"):
            lm_loss(engine(x), y).backward()
        train(engine, data)
        state = engine.consolidated_state_dict()
    for name, r in reference_fp32(len(data), data).named_parameters():
        close_enough(state[name], r.detach(), 1e-5)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("sparse_module", [False, True])
def test_lazy_sparse_gradients_leave_untouched_rows_alone(tmp_path, device, sparse_module):
    """sparse_gradients "lazy": an embedding's untouched rows keep their values and moments (lazy Adam), touched
    rows and the other parameters follow AdamW; with nn.Embedding(sparse=True) as with a dense gradient."""
    data = bag_batches(4)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "betas": [0.9, 0.99],
                                                      "eps": 1e-8}},
           "sparse_gradients": "lazy",
           "zero_optimization": {"stage": 2, "sub_group_size": 1 << 16,
                                 "offload_optimizer": {"device": device, "nvme_path": str(tmp_path)}}}
    model = make_bag(sparse=sparse_module)
    initial = model.emb.weight.detach().clone()
    with offload.initialize(model, cfg) as engine:
        train_steps(engine, data, bag_loss)
        got = engine.consolidated_state_dict()
    want = lazy_adamw_reference(data, 4)
    for k in want:
        close_enough(got[k], want[k], 1e-5)
    untouched = torch.ones(initial.shape[0], dtype=torch.bool)
    untouched[torch.cat([x.reshape(-1) for x, _ in data])] = False
    assert untouched.sum() > 0.99 * len(untouched)
    assert torch.equal(got["emb.weight"][untouched], initial[untouched])


def test_lazy_sparse_gradients_need_offloaded_state(tmp_path):
    cfg = {"sparse_gradients": "lazy", "zero_optimization": {"offload_optimizer": {"device": "none"}}}
    with pytest.raises(ValueError, match='sparse_gradients "lazy"'):
        offload.initialize(make_bag(), cfg)
    with pytest.raises(ValueError, match="sparse_gradients must be true, false or \"lazy\""):
        offload.initialize(make_bag(), {"sparse_gradients": "yes"})


@pytest.mark.parametrize("variant", ["overlap_forward", "delayed_update"])
def test_grad_norm_survives_a_dropped_window(tmp_path, variant):
    """A backward that raises before any update (the window is dropped, the engine idle again) leaves the norm of
    the step before it known: its updates ran, so ``last_grad_norm`` is still that step's norm, not None."""
    data, bad = batches(1), batches(1, seed=9)[0]
    cfg = config(tmp_path, "cpu")
    cfg["zero_optimization"]["offload_optimizer"][variant] = True
    with offload.initialize(make(), cfg) as engine:
        train(engine, data)
        _FailInBackward.armed = True
        try:
            with pytest.raises(RuntimeError, match="injected error"):
                engine.backward(lm_loss(_FailInBackward.apply(engine(bad[0])), bad[1]))
        finally:
            _FailInBackward.armed = False
        assert engine.phase is offload.Phase.IDLE
        norm = engine.last_grad_norm
    want: list[float] = []
    reference_fp32(1, data, norms=want)
    assert norm == pytest.approx(want[0], rel=1e-5)


def test_grad_norm_reads_after_a_close_that_raised(tmp_path, monkeypatch):
    """The delayed update of the last step fails inside ``close()``: the norm of that step is unknown (None), and
    reading it after the close neither raises nor waits."""
    from offload.optim import offloaded

    data = batches(2)
    cfg = config(tmp_path, "cpu")
    cfg["zero_optimization"]["offload_optimizer"]["delayed_update"] = True
    engine = offload.initialize(make(), cfg)
    train(engine, data[:1])
    engine.optimizer.finish()  # the first step's update, beside us on the stepper thread, ran (not the one patched)
    monkeypatch.setattr(offloaded, "adam_step", fails_on_call(offloaded.adam_step, 1, RuntimeError("injected")))
    engine.backward(lm_loss(engine(data[1][0]), data[1][1]))
    engine.step()
    with pytest.raises(RuntimeError, match="injected"):
        engine.close()
    assert engine.last_grad_norm is None


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_grad_norm_of_huge_gradients_with_the_state_on_the_device(tmp_path, monkeypatch, clip):
    """The fused update (state on the device, the CUDA path; STAGE_ON_CPU runs it on any machine) sums fp32 squares
    and does not retry in float64, which would cost a float64 pass over every gradient on the GPU: gradients whose
    squares overflow fp32 (a loss times 1e22) read as an inf norm, never as a wrong finite one, and train on. The
    sub-group (here the whole model) keeps its values: torch's CUDA kernel would write NaN into them (on an H200
    the next loss was NaN). Clipped, the gradients the kernel sees are small: it updates (the norm, taken before,
    in float64, is finite)."""
    monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    data, scale = batches(2), 1e22
    initial = make().state_dict()
    cfg = config(tmp_path, "none", zero_optimization={"sub_group_size": 1 << 24}, gradient_clipping=clip)
    with offload.initialize(make(), cfg) as engine:
        for x, y in data:
            engine.backward(lm_loss(engine(x), y) * scale)
            engine.step()
            assert (engine.last_grad_norm == math.inf) is not bool(clip) and engine.was_step_applied()
        state = engine.consolidated_state_dict()
    assert all(bool(v.isfinite().all()) for v in state.values())
    assert all(torch.equal(v, initial[k]) is not bool(clip) for k, v in state.items())


def test_a_step_that_raises_is_not_applied(tmp_path):
    """``was_step_applied`` is False after any ``step()`` that raised, its checks included (called twice without a
    backward, inside an ``engine.gathered()`` block): the updates of the step before are not this one's."""
    data = batches(2)
    with offload.initialize(make(), config(tmp_path, "cpu")) as engine:
        train(engine, data[:1])
        assert engine.was_step_applied()
        with pytest.raises(RuntimeError, match="called twice without an engine.backward"):
            engine.step()
        assert not engine.was_step_applied()
        train(engine, data[1:])
        assert engine.was_step_applied()
        x, y = data[0]
        engine.backward(lm_loss(engine(x), y))
        with engine.gathered([engine.module.tok.weight]):
            with pytest.raises(RuntimeError, match="inside an engine.gathered"):
                engine.step()
        assert not engine.was_step_applied()
        engine.step()
        assert engine.was_step_applied()


@pytest.mark.parametrize("placement", [pytest.param("opt-nvme", marks=pytest.mark.slow), "all-nvme",
                                       pytest.param("opt-host-overlap", marks=pytest.mark.slow)])
def test_an_engine_collected_unclosed_is_closed_with_a_resource_warning(tmp_path, placement):
    """An engine dropped without close() lived until exit with its threads, buffers and swap files (20 of them:
    1 GiB RSS, 83 threads), kept alive through the parameters' gradient hooks, which torch holds in C++ where the
    collector cannot see the cycle, and by the optimizer thread's last job. It now lives as long as its model (whose
    hooks need it: a model kept for its forwards keeps working) and, once both are dropped, is closed when
    collected, with a ResourceWarning."""
    def offload_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(("offload", "nvme_swapper"))]

    before = offload_threads()
    x, y = batches(1)[0]

    def train_and_keep_the_model() -> tuple[torch.nn.Module, torch.Tensor]:
        model = make()
        engine = offload.initialize(model, placement_config(tmp_path, placement))
        train_steps(engine, batches(2))
        with torch.no_grad():
            return model, engine(x).detach().clone()

    model, expected = train_and_keep_the_model()
    gc.collect()
    assert offload_threads() != before  # the model holds its engine
    assert bool(list(tmp_path.rglob("swap-*"))) == ("nvme" in placement)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with pytest.warns(ResourceWarning, match="garbage collected without close"):
        del model
        gc.collect()
    assert offload_threads() == before
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
