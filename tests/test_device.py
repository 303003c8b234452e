"""The device, decided in one place: ``offload.device``, inputs moved to it, parameters placed on it, step phases
checked, page-locked host memory of exact size, failures inside ``initialize`` that surface as themselves, and
(CUDA) every placement's copies ordered across streams as torch's stream sanitizer checks them.
Each test runs on whichever device this machine has (tests/models.py: DEVICE); a few need CUDA and say so."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from collections import UserDict, namedtuple
from pathlib import Path

import pytest
import torch

import offload
from nvme_swapper import SwapEngine, aligned_tensor, pinned_bytes
from offload._device import resolve_device
from models import DEVICE, batches, lm_loss, make, on_device

CUDA = torch.cuda.is_available()
Pair = namedtuple("Pair", "idx extra")


def config(tmp_path, **offload_section) -> dict:
    return {"zero_optimization": {"sub_group_size": 4096, "offload_optimizer": {"device": "cpu"}},
            "offload": offload_section}


class Nested(torch.nn.Module):
    """A model whose forward takes tensors nested in a mapping (a ``UserDict``, as transformers' BatchEncoding), a
    dict, a list, a named tuple and a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = make()

    def forward(self, batch: UserDict, *, scale: torch.Tensor) -> torch.Tensor:
        idx = batch["ids"][0]
        extra = batch["more"]["pair"].extra
        assert isinstance(batch, UserDict)
        assert batch["more"]["pair"].idx.device == idx.device == scale.device == self.gpt.tok.weight.device
        return self.gpt(idx) * scale + extra.sum()


def test_inputs_move_to_the_device_and_the_model_lives_there(tmp_path):
    model = Nested()  # built on the CPU
    x, y = batches(1)[0]
    with offload.initialize(model, config(tmp_path)) as engine:
        assert engine.device == DEVICE and engine.plan().device == DEVICE
        assert all(p.device == DEVICE for p in model.parameters())
        batch = UserDict({"ids": [x], "more": {"pair": Pair(x, torch.zeros(3))}})
        out = engine(batch, scale=torch.ones(()))  # CPU tensors in, nested
        assert out.device == DEVICE
        engine.backward(lm_loss(out, y))
        engine.step()
    assert all(p.device == DEVICE for p in model.parameters())  # close() leaves the model where it trained


def test_fp16_auto_cast_casts_floating_inputs_as_deepspeed_does(tmp_path):
    """fp16 with ``auto_cast`` (DeepSpeed's): floating inputs, nested too, reach the fp16 model in fp16 (before,
    an fp32 input met fp16 weights: "mat1 and mat2 must have the same dtype"); integer ones keep their dtype."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    cfg = {"fp16": {"enabled": True, "auto_cast": True}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    with offload.initialize(model, {**cfg, "offload": {"device": "cpu"}}) as engine:
        out = engine(torch.randn(2, 8))
        assert seen == [torch.float16] and out.dtype == torch.float16
        engine.backward(out.float().pow(2).mean())
        engine.step()
        assert engine._move_inputs(model, ({"ids": torch.arange(3), "x": [torch.ones(1)]},), {})[0][0]["ids"].dtype \
            == torch.int64


@pytest.mark.parametrize("state", ["cpu", "none", "nvme"])
def test_host_buffers_are_made_on_the_host_whatever_the_default_device(tmp_path, monkeypatch, state):
    """Inside ``with torch.device("cuda")`` (the habit ``offload.init`` documents) or after
    ``torch.set_default_device("cuda")``, a factory call without ``device=`` makes a CUDA tensor: the buffers the
    engine means for the host (the CPU Adam kernel's warm-up at initialize, checkpoint reads, downloads, the staged
    state of a device optimizer, checksums of the start-up sync) must name the CPU. The meta device stands in for
    CUDA here, on every machine; ``state`` "none" keeps the optimizer state on the device (the CUDA path's fused
    Adam, on the CPU through STAGE_ON_CPU); "nvme": stage 3 with the optimizer and the parameters on NVMe (the
    swap engine's staging, the parameters' fetches, the update's writes), edited in a gathered block and exported."""
    monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    cfg = {"zero_optimization": {"sub_group_size": 4096, "offload_optimizer": {"device": state}}}
    if state == "nvme":
        cfg = {"zero_optimization": {"stage": 3, "sub_group_size": 4096, "stage3_max_live_parameters": 8192,
                                     "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                                     "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}},
               "aio": {"block_size": 1 << 16}}
    model, data = make(), batches(2)
    with torch.device("meta"):
        engine = offload.initialize(model, cfg)
    with engine:
        x, y = data[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        with torch.device("meta"):
            assert engine.last_grad_norm is not None
            engine.save_checkpoint(tmp_path / "ck")
            engine.load_checkpoint(tmp_path / "ck")
            with engine.gathered(model.head.weight):
                model.head.weight.data.mul_(0.5)
            weights = engine.consolidated_state_dict()
            engine.save_safetensors(tmp_path / "st")
        assert all(t.device.type == "cpu" and bool(t.isfinite().all()) for t in weights.values())
        x, y = data[1]
        engine.backward(lm_loss(engine(x), y))  # the state read back is whole
        engine.step()


def test_device_key_names_what_is_allowed(tmp_path):
    for bad in ("tpu", "cuda:x", "gpu", 3):
        with pytest.raises(ValueError, match=r"offload\.device must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""):
            offload.initialize(make(), config(tmp_path, device=bad))
    with offload.initialize(make(), config(tmp_path, device="cpu")) as engine:
        assert engine.device == torch.device("cpu")
        assert next(engine.module.parameters()).device.type == "cpu"
    if not CUDA:
        with pytest.raises(ValueError, match="offload.device is 'cuda' but there is no CUDA device"):
            offload.initialize(make(), config(tmp_path, device="cuda"))
        return
    for spec in ("cuda", "cuda:0"):
        with offload.initialize(make(), config(tmp_path, device=spec)) as engine:
            assert engine.device == torch.device("cuda", 0)
            assert next(engine.module.parameters()).device == torch.device("cuda", 0)


def test_a_gpu_of_its_own_per_rank_is_cuda_0(monkeypatch):
    """A launcher that makes one GPU visible to each process (SLURM's --gpus-per-task=1): every rank trains on its
    cuda:0. The same count of one GPU without CUDA_VISIBLE_DEVICES is one GPU shared by the ranks: an error. (The
    machine's CUDA is stood in for: the rule is about what the process sees.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    for spec in ("auto", "cuda", "cuda:0"):
        assert resolve_device(spec, local_rank=2, local_world_size=4) == torch.device("cuda", 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match="4 ranks on this machine but 1 CUDA device"):
        resolve_device("auto", local_rank=2, local_world_size=4)
    with pytest.raises(ValueError, match="names one GPU for all 4 ranks"):
        resolve_device("cuda:0", local_rank=2, local_world_size=4)


def test_more_ranks_than_gpus_is_an_error_that_names_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # one GPU named there reads as one GPU per process
    assert resolve_device("cpu", local_rank=5, local_world_size=8) == torch.device("cpu")
    if not CUDA:
        assert resolve_device("auto", local_rank=3, local_world_size=4) == torch.device("cpu")
        return
    n = torch.cuda.device_count()
    assert resolve_device("auto", local_rank=n - 1, local_world_size=n) == torch.device("cuda", n - 1)
    with pytest.raises(RuntimeError, match=rf"{n + 1} ranks on this machine but {n} CUDA device.*--nproc-per-node "
                                           rf"{n}.*offload.device to \"cpu\""):
        resolve_device("auto", local_rank=0, local_world_size=n + 1)
    with pytest.raises(ValueError, match="names one GPU for all 2 ranks"):
        resolve_device("cuda:0", local_rank=0, local_world_size=2)


def test_step_phases_are_checked(tmp_path):
    x, y = batches(1)[0]
    with offload.initialize(make(), config(tmp_path)) as engine:
        assert engine.phase is offload.Phase.IDLE
        with pytest.raises(RuntimeError, match=r"engine.step\(\) called before engine.backward"):
            engine.step()
        engine.backward(lm_loss(engine(x), y))
        assert engine.phase is offload.Phase.ACCUMULATING
        engine.step()
        assert engine.phase is offload.Phase.IDLE
        with pytest.raises(RuntimeError, match="called twice without an engine.backward"):
            engine.step()
        loss = lm_loss(engine(x), y)
        bad = loss.register_hook(lambda g: engine.step())  # a step from inside backward
        with pytest.raises(RuntimeError, match=r"engine.step\(\) called while the engine is in phase 'backward'"):
            engine.backward(loss)
        bad.remove()
    assert engine.phase is offload.Phase.CLOSED
    with pytest.raises(RuntimeError, match="closed"):
        engine.backward(loss)


def test_plan_says_what_was_chosen_and_why(tmp_path):
    cfg = config(tmp_path)
    cfg["gradient_clipping"] = 1.0
    with offload.initialize(make(), cfg) as engine:
        plan = engine.plan()
        text = plan.describe()
    assert plan.optimizer_tier is offload.Tier.HOST and plan.param_tier is offload.Tier.DEVICE
    assert not plan.overlap and "gradient clipping needs the global norm first" in text
    assert f"device {DEVICE}" in text and "host budget" in text


def test_a_failure_inside_initialize_surfaces_as_itself(tmp_path, monkeypatch):
    """The third parameter written to its NVMe home fails: initialize raises that error (not one from the
    cleanup), and nothing is left behind: no threads, no swap files, the model whole and usable."""
    writes = 0
    original = SwapEngine.write

    def failing(self, key, tensor):
        nonlocal writes
        if key.startswith("param/"):
            writes += 1
            if writes == 3:
                raise OSError(28, "injected: no space left for the third parameter")
        return original(self, key, tensor)

    monkeypatch.setattr(SwapEngine, "write", failing)
    model = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = {"zero_optimization": {"stage": 3, "sub_group_size": 4096,
                                 "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p")},
                                 "stage3_param_persistence_threshold": 100}}
    with pytest.raises(OSError, match="injected: no space left for the third parameter"):
        offload.initialize(model, cfg)
    assert not [t for t in threading.enumerate() if t.name.startswith(("offload", "nvme_swapper"))]
    assert list((tmp_path / "p").iterdir()) == []
    for n, p in model.named_parameters():  # every parameter holds its value again, as a plain tensor
        assert torch.equal(p.detach().cpu(), before[n].to(p.dtype)), n
    model.to(DEVICE)  # on a GPU those handed back are there already, the rest still on the CPU
    x, y = on_device(batches(1)[0])
    lm_loss(model(x), y).backward()


@pytest.mark.skipif(not CUDA, reason="page-locked memory is registered with CUDA")
def test_pinned_host_memory_is_exactly_what_was_asked():
    gc.collect()  # buffers of earlier tests waiting in reference cycles would unregister during the count
    base = pinned_bytes()
    sizes = [1000, 4096, (3 << 20) + 5, 100 << 20]
    bufs = [aligned_tensor(n, torch.uint8, pin_memory=True) for n in sizes]
    assert all(b.is_pinned() and b.data_ptr() % 4096 == 0 for b in bufs)
    assert pinned_bytes() - base == sum(-(-n // 4096) * 4096 for n in sizes)  # pages, not powers of two
    view = bufs[2][10:20]
    del bufs
    assert pinned_bytes() - base == -(-sizes[2] // 4096) * 4096  # the view keeps its region registered
    del view
    assert pinned_bytes() == base


@pytest.mark.skipif(not CUDA, reason="asynchronous copies from pinned memory need CUDA")
def test_gradient_copies_do_not_block_the_compute_stream(tmp_path):
    """With the optimizer on the host, backward issues the gradients' device-to-host copies on a side stream:
    the engine reports whole buckets sent, and the result equals the serial reference (test_engine)."""
    x, y = batches(1)[0]
    cfg = config(tmp_path)
    cfg["bf16"] = {"enabled": True}
    with offload.initialize(make(), cfg) as engine:
        for _ in range(2):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        copies = engine.stats()["gradient_copies"]
        report = engine.memory_report()
    assert copies["buckets"] > 0 and copies["pieces"] == 0
    assert report["host"]["pinned"] > 0


# One engine per placement, three steps each, in a child process (the sanitizer is switched on for a whole process).
SANITIZED = """
import json, sys
sys.path.insert(0, {tests!r})
import offload
from models import batches, lm_loss, make
for name, cfg in json.loads({configs!r}).items():
    with offload.initialize(make(), cfg) as engine:
        for x, y in batches(3 * cfg.get("gradient_accumulation_steps", 1)):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    print("clean:", name, flush=True)
"""


def sanitizer_configs(root: Path) -> dict[str, dict]:
    """The placements whose copies cross streams: gradients through device buckets (accumulated too), updated
    parameters uploaded from pinned staging (waited for as the next forward reaches them, too), a delayed update,
    parameters fetched into a window from host and NVMe homes (landing included), and state left on the device
    beside NVMe homes."""
    def zero(opt: str, param: str | None = None, **extra) -> dict:
        z = {"stage": 3 if param else 2, "sub_group_size": 4096,
             "offload_optimizer": {"device": opt, "nvme_path": str(root / "opt"), **extra}}
        if param:
            z.update(offload_param={"device": param, "nvme_path": str(root / "param")},
                     stage3_max_live_parameters=10_000, stage3_prefetch_bucket_size=4_000,
                     stage3_param_persistence_threshold=100)
        return z
    bf16 = {"bf16": {"enabled": True}, "aio": {"block_size": 1 << 16}}
    return {
        "optimizer on the host": {"zero_optimization": zero("cpu"), **bf16},
        "the next forward beside the updates": {"zero_optimization": zero("cpu", overlap_forward=True), **bf16},
        "micro-batches accumulated": {"zero_optimization": zero("cpu"), "gradient_accumulation_steps": 2, **bf16},
        "delayed update": {"zero_optimization": zero("cpu", delayed_update=True), **bf16},
        "parameters on the host": {"zero_optimization": zero("cpu", "cpu"), **bf16},
        "everything on NVMe": {"zero_optimization": zero("nvme", "nvme"), **bf16},
        "state on the device, parameters on NVMe": {"zero_optimization": zero("none", "nvme"), **bf16},
    }


@pytest.mark.skipif(not CUDA, reason="torch's CUDA stream sanitizer checks the ordering of CUDA streams")
@pytest.mark.timeout(900)
def test_no_stream_race_under_the_cuda_sanitizer(tmp_path):
    """torch's stream sanitizer (TORCH_CUDA_SANITIZER) follows every kernel the training thread launches and every
    event: a device tensor written on one stream and used on another without an event between them fails the run.
    (The worker threads' copies are not followed: the sanitizer's dispatch mode is per thread.)"""
    configs = sanitizer_configs(tmp_path)
    script = SANITIZED.format(tests=str(Path(__file__).resolve().parent), configs=json.dumps(configs))
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0 and "CSAN" not in done.stderr, done.stdout[-1000:] + done.stderr[-6000:]
    assert done.stdout.count("clean:") == len(configs)
