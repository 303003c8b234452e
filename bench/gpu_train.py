"""Training steps on one GPU: plain torch and each offload placement, same model and batches, beside DeepSpeed.

Every run trains the same GPT (offload/models.py) on the same synthetic batches, each in its own process (so host
peak RSS, GPU peak and pinned memory are the run's own, and an out-of-memory run does not end the others):

  plain            torch alone: fp32 parameters on the device, bf16 autocast, fused AdamW (16 B/param on the GPU)
  opt-host         ZeRO-2 offload: bf16 parameters on the device, fp32 Adam state and CPU Adam on the host
  opt-host-overlap the same with the next forward beside the step's updates (overlap_forward; ours only)
  opt+params-host  ZeRO-3 offload: parameters homed on the host too, a window fetched to the device
  opt-nvme         ZeRO-Infinity: Adam state on NVMe (parameters on the device)
  opt+params-nvme  ZeRO-Infinity: Adam state and parameters on NVMe

(``--dtype fp32``, the default on a CPU without native bf16, where torch's bf16 matmuls are ~100x slower: fp32
parameters everywhere and no autocast.) Each run by this library and by the peers that implement the placement
(none is a dependency; each runs where it can, and ``--deepspeed``/``--fsdp``/``--torchao off`` leave it out):

  deepspeed  every placement but opt-host-overlap, when ``deepspeed`` is importable and CUDA is there
  fsdp       opt+params-host: torch's FSDP2 (``fully_shard`` per block and at the root) with ``CPUOffloadPolicy``
             (fp32 parameters, gradients and torch's fused AdamW on the host, bf16 compute through its
             ``MixedPrecisionPolicy``); on one rank, NCCL on CUDA and gloo on a CPU
  torchao    opt-host: torchao's ``CPUOffloadOptimizer`` around torch's fused AdamW (fp32 parameters on the device
             under bf16 autocast, the fp32 state and the step on the host), when ``torchao`` is importable and CUDA
             is there (it supports nothing else)

DeepSpeed gets the same keys (``overlap_comm`` and ``contiguous_gradients`` on for both, as
DeepSpeed's ZeRO-Offload tutorial sets them; with Adam state on NVMe DeepSpeed also gets its own advice, sub-groups
of 1e8 and pipelined reads and writes). DeepSpeed's ops (CPU Adam, AIO) are built first, in a run of their own with
``--build-timeout``, so no placement pays for or times out in the compile. Per run: median step time (forward +
backward + optimizer step, after warm-up), tokens/s, GPU peak (torch's allocator), host peak RSS (VmHWM) and pinned
bytes, the loss per step, and the parts of a step from the engine's counters (CPU Adam, the share of it hidden in
backward, bytes to and from the device, NVMe stalls). The host peak is also set against ``offload.estimate``: the
RSS the run added above the process before the model was built (CUDA's context included there), and the part of it
that building the model and ``initialize`` added, against the estimate's bytes in RAM (the host tier; on a CPU
device also the device tier, with activations on top). The JSON, summary included, is written after every run, so a
bench cut short keeps what it measured; a SIGTERM (a time limit around the bench) also prints the summary so far,
and each run's process group (a compiler it started included) goes at its ``--timeout``.

Bounds measured in the same run, each in a process of its own: ``compute`` (forward + backward of the bf16 model,
no optimizer; absent when it does not fit) and ``pcie`` (the gradient bytes device-to-host and the parameter bytes
host-to-device through pinned memory on two streams at once). For opt-host (and opt-host-overlap) the target is
step <= 1.15 x max(compute, CPU Adam, pcie). Without CUDA everything runs on the CPU (the device tier is then host
memory and pcie a memcpy): that is how the memory issue's target is measured here, a ~100M GPT with everything on
NVMe and no size configured against plain torch (``--params 1e8 --placements plain,opt+params-nvme``: host peak RSS
<= 0.5x, step <= 1.15x).

This library's runs build the model inside ``offload.init`` (with NVMe placements the parameters go to a file
arena as modules are built) and set no size: every size is derived from the budgets (offload/plan.py).

    python bench/gpu_train.py [--params 1e9 | --layers L --width W] [--tokens 512] [--batch 4] [--steps 5]
                              [--warmup 2] [--placements plain,opt-host,...] [--deepspeed auto|off]
                              [--fsdp auto|off] [--torchao auto|off]
                              [--rounds 1] [--compile] [--nvme-dir DIR] [--timeout 900] [--build-timeout 420]
                              [--out results/gpu_train.json]

``--compile`` runs every model through ``torch.compile`` (ours: the compiled model handed to ``initialize``;
DeepSpeed: its ``engine.compile()``), compute bound included.

``--rounds R`` runs the placements R times in turn (plain, ours, plain, ours, ...) and quotes the median of the
R rounds' ratios: on a shared machine the speed drifts by 10-25% within minutes, and a ratio of two runs taken
minutes apart measures that drift as much as the code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _common import add_gpt_flags, count, gpt_heads, number, out_help, peak_rss, proc_bytes, shape_for  # noqa: E402

import offload  # noqa: E402
from nvme_swapper import aligned_tensor, pinned_bytes  # noqa: E402
from offload.models import GPT, GPTConfig, synthetic_batches  # noqa: E402
from offload._device import fast_bf16  # noqa: E402
from offload._progress import progress  # noqa: E402

PLACEMENTS = {  # name: (ZeRO stage, offload_optimizer.device, offload_param.device); None: plain torch
    "plain": None,
    "opt-host": (2, "cpu", "none"),
    "opt+params-host": (3, "cpu", "cpu"),
    "opt-nvme": (3, "nvme", "none"),  # DeepSpeed offloads optimizer state to NVMe only in stage 3
    "opt+params-nvme": (3, "nvme", "nvme"),
    # ours only: opt-host with the next forward beside the step's updates (offload_optimizer.overlap_forward, off by
    # default), so one run shows what that buys
    "opt-host-overlap": (2, "cpu", "none"),
}
# the placements each peer framework implements
PEERS = {"deepspeed": set(PLACEMENTS) - {"plain", "opt-host-overlap"}, "fsdp": {"opt+params-host"},
         "torchao": {"opt-host"}}
LR = 3e-4


def config_for(placement: str, work: Path, batch: int, dtype: str = "bf16", clip: float = 0.0) -> dict[str, Any]:
    stage, opt, par = PLACEMENTS[placement]
    # overlap_comm and contiguous_gradients as DeepSpeed's ZeRO-Offload tutorial sets them (DeepSpeed turns
    # overlap_comm on by default in stage 3 only; ours by default always): both frameworks get the same
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "offload_optimizer": {"device": opt, "pin_memory": True}}
    if placement == "opt-host-overlap":
        zero["offload_optimizer"]["overlap_forward"] = True
    if opt == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(work / "opt")
    if par != "none":
        zero["offload_param"] = {"device": par, "pin_memory": True}
        if par == "nvme":
            zero["offload_param"]["nvme_path"] = str(work / "param")
    return {"train_micro_batch_size_per_gpu": batch, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "betas": [0.9, 0.95]}},
            "gradient_clipping": clip, "zero_optimization": zero}


def build(cfg: GPTConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> GPT:
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return GPT(cfg)
    finally:
        torch.set_default_dtype(default)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# one run, in a child process ----------------------------------------------------------------------------------------

def child(spec: dict[str, Any]) -> dict[str, Any]:
    cfg = GPTConfig(**spec["model"])
    device = offload.default_device()
    if device.type == "cuda":
        torch.empty(1, device=device)  # CUDA's context is part of the process's start, not of the run
        torch.cuda.reset_peak_memory_stats(device)
    base_rss = proc_bytes("/proc/self/status", "VmRSS")[0]  # before the model: torch, CUDA, this script
    kind, placement = spec["kind"], spec["placement"]
    if kind == "pcie":
        return pcie(cfg.num_parameters, device)
    if kind == "deepspeed-build":
        return _build_deepspeed_ops(spec["nvme"])
    data = synthetic_batches(cfg.vocab_size, spec["batch"], spec["tokens"], seed=0)
    batches = [next(data) for _ in range(spec["warmup"] + spec["steps"])]
    work = Path(spec["work"])
    low = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    compiled = torch.compile if spec.get("compile") else (lambda m: m)  # --compile: every framework's forward
    clip = spec.get("clip", 0.0)  # --clip: every framework's gradient clipping
    if kind == "compute":
        model = build(cfg, low, device)
        step, close, parts = _compute_step(compiled(model)), (lambda: None), None
    elif kind == "plain":
        model = build(cfg, torch.float32, device)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95),
                                fused=device.type == "cuda")
        step, close, parts = _plain_step(compiled(model), opt, device, low, clip), (lambda: None), None
    elif kind == "ours":
        config = config_for(placement, work, spec["batch"], spec["dtype"], clip)
        with offload.init(config):  # NVMe placements: the model is built in a file arena, never whole in RAM
            model = build(cfg, torch.float32)
        engine = offload.initialize(compiled(model), config)
        del model
        step, close, parts = _engine_step(engine), engine.close, _Parts(engine)
        estimate = _estimate_for(engine, cfg, placement)
    elif kind == "fsdp":
        step, close, parts = _fsdp(cfg, device, low, compiled, clip)
    elif kind == "torchao":
        step, close, parts = _torchao(cfg, device, low, compiled, clip)
    else:
        step, close, parts = _deepspeed(cfg, placement, work, spec["batch"], spec["dtype"], bool(spec.get("compile")),
                                        clip)
    setup_rss = peak_rss()  # the model built and handed to its framework, before any step
    setup_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    times, losses, per_step = [], [], []
    try:
        for i, (x, y) in enumerate(batches):
            if parts is not None:
                parts.mark()
            sync(device)
            t = time.perf_counter()
            loss = step(x.to(device), y.to(device))
            sync(device)
            times.append(time.perf_counter() - t)
            losses.append(loss)
            if parts is not None and i >= spec["warmup"]:
                per_step.append(parts.delta())
        result: dict[str, Any] = {"status": "ok"}
        if parts is not None:
            result["engine"], result["estimate"] = parts.final(), estimate
        # before close, which frees the pinned buffers and removes the swap files
        pinned = pinned_bytes() if kind == "ours" else _torch_pinned()
        on_disk = sum(f.stat().st_blocks * 512 for f in work.rglob("*") if f.is_file())
    finally:
        close()
    measured = times[spec["warmup"]:]
    result.update(step_seconds=statistics.median(measured), seconds=times, losses=losses,
                  tokens_per_s=spec["batch"] * spec["tokens"] / statistics.median(measured),
                  gpu_peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                  gpu_setup_peak=setup_gpu, host_peak_rss=peak_rss(), host_base_rss=base_rss,
                  host_setup_rss=setup_rss, pinned=pinned, nvme_on_disk=on_disk,
                  parts={k: statistics.median(s[k] for s in per_step) for k in per_step[0]} if per_step else None)
    return result


def _estimate_for(engine: offload.Engine, cfg: GPTConfig, placement: str) -> dict[str, int]:
    """What ``offload estimate`` says of this placement's peak per tier, given the budgets this engine resolved
    (as ``--gpu-mem``, ``--host-mem`` and ``--nvme-free``): both then derive the same sizes. Without them the
    estimate derives a small parameter window, where initialize, given a whole GPU, keeps every parameter on it."""
    plan = engine.plan()
    _, opt, par = PLACEMENTS[placement]
    budgets = {t.value: b for t, b in plan.budgets.items()}
    with torch.device("meta"):
        est = offload.estimate(model=GPT(cfg), cuda=plan.device.type == "cuda", dtype_bytes=plan.dtype_bytes,
                               gpu_mem=budgets["device"], host_mem=budgets["host"], nvme_free=budgets["nvme"])
    e = next(e for e in est if (e.optimizer, e.params) == (opt, par))
    return {"device": e.device, "host": e.host, "nvme": e.nvme, "host_budget": budgets["host"]}


def _torch_pinned() -> int | None:
    """The most bytes torch's pinned (caching host) allocator held, cached blocks included, where this torch reports
    it (the key changed between releases)."""
    try:
        stats = torch.cuda.memory.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    for key in ("allocated_bytes.peak", "reserved_bytes.peak", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


def _compute_step(model: GPT) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = GPT.loss(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _plain_step(model: GPT, opt: torch.optim.Optimizer, device: torch.device, dtype: torch.dtype,
                clip: float) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = GPT.loss(model(x), y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _engine_step(engine: offload.Engine) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = GPT.loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


class _Parts:
    """A step's parts from the engine's counters: CPU Adam (and the share overlapped with backward), the wait of
    the forward for the last step's updates, NVMe stalls, bytes to and from the device."""

    def __init__(self, engine: offload.Engine) -> None:
        self.engine, self._last = engine, engine.stats()

    def mark(self) -> None:
        self._last = self.engine.stats()

    def delta(self) -> dict[str, float]:
        now, last = self.engine.stats(), self._last
        moved = {k: now["bytes_moved"].get(k, 0) - last["bytes_moved"].get(k, 0) for k in now["bytes_moved"]}
        gate, gate_last = now["update_beside_forward"], last["update_beside_forward"]
        return {"adam": now["adam_seconds"] - last["adam_seconds"],
                # the last step's updates finishing beside this forward: the time its modules waited for them
                "update_wait": gate["wait_seconds"] - gate_last["wait_seconds"] if gate else 0.0,
                "adam_overlapped": now["adam_seconds_overlapped"] - last["adam_seconds_overlapped"],
                "stalled": now["stall_seconds"] - last["stall_seconds"],
                "d2h_bytes": moved.get("device->host", 0), "h2d_bytes": moved.get("host->device", 0),
                "nvme_read_bytes": moved.get("nvme->host", 0), "nvme_write_bytes": moved.get("host->nvme", 0)}

    def final(self) -> dict[str, Any]:
        report = self.engine.memory_report()
        return {"memory_report": report, "plan": self.engine.plan().describe(),
                "gradient_copies": self.engine.stats()["gradient_copies"]}


def _deepspeed(cfg: GPTConfig, placement: str, work: Path, batch: int, dtype: str,
               compile_forward: bool, clip: float) -> tuple[Any, Any, None]:
    import deepspeed  # noqa: PLC0415 - optional, imported only for its runs

    _one_rank_env()
    deepspeed.init_distributed()
    model = build(cfg, torch.bfloat16 if dtype == "bf16" else torch.float32)
    ds_config = config_for(placement, work, batch, dtype, clip)
    zero = ds_config["zero_optimization"]
    if zero["offload_optimizer"]["device"] == "nvme":  # DeepSpeed's own advice for NVMe: sub-groups of 1e8 (its
        zero["sub_group_size"] = int(1e8)  # default, 1e9, is one sub-group for a 1B model: nothing to pipeline),
        zero["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)  # reads and writes pipelined;
        # pipelined, three sub-groups are in flight (the next one read, this one updated, the last one written), each
        # holding a pinned buffer for its fp32 parameter, exp_avg, exp_avg_sq and gradient: with the default of 4
        # buffers its swapper fails its first step (`assert new_alloc_buffers is not None`, seen on an H200)
        zero["offload_optimizer"]["buffer_count"] = 12
    if "nvme" in json.dumps(zero):
        ds_config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if compile_forward:
        engine.compile()  # DeepSpeed's own torch.compile of the wrapped module

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = GPT.loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step, (lambda: None), None


def _one_rank_env() -> None:
    """The environment of a one-rank process group (a peer framework that expects a launcher)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _fsdp(cfg: GPTConfig, device: torch.device, low: torch.dtype, compiled: Any, clip: float) -> tuple[Any, Any, None]:
    """FSDP2 with CPU offload, as its documentation sets it up: each block and then the root ``fully_shard``-ed,
    the fp32 parameters (and their gradients) on the host, pinned on CUDA, the optimizer stepping there (torch's
    fused CPU AdamW), the compute in ``low`` (``MixedPrecisionPolicy``), gradients reduced in fp32."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    _one_rank_env()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    model = build(cfg, torch.float32)
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=cuda),
              "mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)}
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95), fused=True)
    # no autocast: the policy casts the parameters it gathers
    return _plain_step(compiled(model), opt, device, torch.float32, clip), dist.destroy_process_group, None


def _torchao(cfg: GPTConfig, device: torch.device, low: torch.dtype, compiled: Any,
             clip: float) -> tuple[Any, Any, None]:
    """torchao's CPU-offload optimizer as its README sets it up: the model (fp32) on the device, torch's fused
    AdamW on the host copies, gradients copied out on a side stream as they arrive; bf16 through autocast."""
    from torchao.optim import CPUOffloadOptimizer  # noqa: PLC0415 - optional, imported only for its runs

    model = build(cfg, torch.float32, device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
    return _plain_step(compiled(model), opt, device, low, clip), (lambda: None), None


def _build_deepspeed_ops(nvme: bool) -> dict[str, Any]:
    """DeepSpeed compiles its CPU Adam (and, for NVMe, its AIO) op on first use; built here, in a run of its own,
    the compile is neither timed nor charged to a placement's time limit (a compile killed there would leave
    torch's build lock behind for every later run)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder  # noqa: PLC0415

    t = time.perf_counter()
    for builder in [CPUAdamBuilder()] + ([AsyncIOBuilder()] if nvme else []):
        builder.load()
    return {"status": "ok", "seconds": time.perf_counter() - t}


def pcie(n: int, device: torch.device, repeats: int = 3) -> dict[str, Any]:
    """The bytes a ZeRO-2 offload step moves, alone: n bf16 gradients device-to-host and n bf16 parameters
    host-to-device, through pinned memory, each alone and both at once on two streams (best of ``repeats``)."""
    host_g, host_p = aligned_tensor(n, torch.bfloat16), aligned_tensor(n, torch.bfloat16)
    dev_g = torch.ones(n, dtype=torch.bfloat16, device=device)
    dev_p = torch.empty(n, dtype=torch.bfloat16, device=device)
    cuda = device.type == "cuda"
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)

    def timed(d2h: bool, h2d: bool) -> float:
        best = float("inf")
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            for want, stream, dst, src in ((d2h, streams[0], host_g, dev_g), (h2d, streams[1], dev_p, host_p)):
                if want:
                    if cuda:
                        with torch.cuda.stream(stream):
                            dst.copy_(src, non_blocking=True)
                    else:
                        dst.copy_(src)
            sync(device)
            best = min(best, time.perf_counter() - t)
        return best

    return {"status": "ok", "d2h": timed(True, False), "h2d": timed(False, True), "both": timed(True, True),
            "bytes_each_way": 2 * n}


# the parent -------------------------------------------------------------------------------------------------------

_running: list[tuple[subprocess.Popen, str]] = []  # the child now running and its folder: a SIGTERM to the bench
# takes its process group and the folder too


def launch(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs ``spec`` in a child process of its own session: at the time limit the whole group goes (a compiler
    the child started included), and the result says what the child had printed last."""
    with tempfile.TemporaryDirectory(prefix="gpu-bench-", dir=spec["nvme_dir"]) as work:
        spec = {**spec, "work": work}
        proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        _running[:] = [(proc, work)]
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            timed_out = True
        finally:
            _running.clear()
    result = _result_in(stdout)  # a child that printed its result and then hung at exit counts
    if result is not None:
        return result
    if timed_out:
        tail = " | ".join((stderr or "").strip().splitlines()[-2:])[-300:]
        return {"status": f"timed out after {timeout:.0f} s" + (f": {tail}" if tail else "")}
    text = stderr or stdout
    if "out of memory" in text.lower() or "OutOfMemoryError" in text:
        return {"status": "out of memory"}
    if proc.returncode == -9:
        return {"status": "killed (SIGKILL: the host out of memory?)"}
    tail = text.strip().splitlines()[-3:]
    return {"status": f"failed (exit {proc.returncode}): {' | '.join(tail)[-300:]}"}


def _result_in(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt_flags(ap, params=10**9, vocab=32000, tokens=512, batch=4, steps=5, warmup=2)
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="training dtype (plain torch: autocast to it); auto: bf16 where the device runs it at full "
                    "speed (offload._device.fast_bf16), else fp32")
    ap.add_argument("--deepspeed", choices=["auto", "off"], default="auto",
                    help="auto: DeepSpeed beside ours when it is importable and CUDA is there")
    ap.add_argument("--fsdp", choices=["auto", "off"], default="auto",
                    help="auto: torch's FSDP2 with CPU offload beside ours in opt+params-host")
    ap.add_argument("--torchao", choices=["auto", "off"], default="auto",
                    help="auto: torchao's CPUOffloadOptimizer beside ours in opt-host, when it is importable and CUDA "
                    "is there")
    ap.add_argument("--nvme-dir", default=None, help="where swap files go (default: a temporary directory)")
    ap.add_argument("--rounds", type=count(1), default=1,
                    help="run every placement this many times, round-robin, and quote the median of each round's "
                    "ratios (a shared machine's slow spells then hit ours and the baseline alike)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model in every run (plain torch, "
                    "compute bound, ours, DeepSpeed's engine.compile())")
    ap.add_argument("--clip", type=number(0), default=0.0, help="gradient clipping for every framework alike (0: off; "
                    "transformers' Trainer clips at 1.0 by default, which stops the optimizer from overlapping "
                    "backward: the norm must be known first)")
    ap.add_argument("--timeout", type=number(0, inclusive=False), default=900, help="seconds per run")
    ap.add_argument("--build-timeout", type=number(0, inclusive=False), default=420,
                    help="seconds for DeepSpeed to build its ops (CPU Adam; AIO with NVMe placements) before the runs, "
                    "once")
    ap.add_argument("--out", default="results/gpu_train.json", help=out_help("gpu_train"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child)), default=str), flush=True)
        os._exit(0)  # a peer's communicator or I/O threads may hang the exit; the result is out
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    unknown = [p for p in placements if p not in PLACEMENTS]
    if unknown or not placements:
        ap.error(f"--placements must name placements among {', '.join(PLACEMENTS)}; "
                 + (f"unknown: {', '.join(unknown)}" if unknown else f"got {args.placements!r}"))
    if args.width is not None and args.layers is None:
        ap.error("--width needs --layers")
    layers, width = (args.layers, args.width or 768) if args.layers else shape_for(args.params, args.vocab,
                                                                                     args.tokens)
    cfg = GPTConfig(vocab_size=args.vocab, context=args.tokens, layers=layers, heads=gpt_heads(ap, width),
                    width=width)
    n = cfg.num_parameters
    if args.nvme_dir:
        Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    device = offload.default_device()
    has_ds = args.deepspeed == "auto" and _importable("deepspeed") and device.type == "cuda"
    no_ds = _why_not(args.deepspeed, "deepspeed", device)  # why it sits out, said in the header
    # torchao copies each gradient to the host as backward makes it, so a clip after backward would not reach the
    # step: it sits out clipped runs rather than run unclipped
    has_ao = args.torchao == "auto" and _importable("torchao") and device.type == "cuda" and args.clip == 0
    peers = {"deepspeed": has_ds, "fsdp": args.fsdp == "auto", "torchao": has_ao}  # who runs beside ours
    dtype = args.dtype if args.dtype != "auto" else "bf16" if fast_bf16(device) else "fp32"
    base = {"model": cfg.__dict__, "batch": args.batch, "tokens": args.tokens, "steps": args.steps,
            "warmup": args.warmup, "nvme_dir": args.nvme_dir, "dtype": dtype, "compile": args.compile,
            "clip": args.clip}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA)"
    print(f"gpu bench: GPT {layers} x {width}, {n / 1e9:.3g}B parameters, {args.batch} x {args.tokens} tokens, "
          f"on {name}, {dtype}{', compiled' if args.compile else ''}"
          f"{f', clipping at {args.clip:g}' if args.clip > 0 else ''}; "
          f"DeepSpeed {'beside ours' if has_ds else f'not run ({no_ds})'}; FSDP2 "
          f"{'beside ours' if peers['fsdp'] else 'not run (--fsdp off)'}; torchao "
          f"{'beside ours' if has_ao else 'not run (' + _why_not(args.torchao, 'torchao', device, args.clip) + ')'}",
          flush=True)
    printed: list[str] = []  # the summary lines of what ran so far
    _on_sigterm(printed)
    bounds = {"compute": launch({**base, "kind": "compute", "placement": "compute"}, args.timeout),
              "pcie": launch({**base, "kind": "pcie", "placement": "pcie"}, args.timeout)}
    if has_ds:
        nvme = any("nvme" in p for p in placements)
        bounds["deepspeed_build"] = launch({**base, "kind": "deepspeed-build", "placement": "build", "nvme": nvme},
                                           args.build_timeout)
        built = bounds["deepspeed_build"]
        print(f"  DeepSpeed's ops (CPU Adam{', AIO' if nvme else ''}): {built['status']}"
              + (f", built in {built['seconds']:.0f} s" if "seconds" in built else ""), flush=True)
        peers["deepspeed"] = built["status"] == "ok"  # else each DeepSpeed run would fail alike, at its time limit
    runs: list[dict[str, Any]] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> dict[str, Any]:
        """After every run, with the summary of what ran so far: a bench cut short keeps what it measured."""
        summary = _rounds_summary(runs, bounds, n, max(1, min(args.rounds, 1 + runs[-1]["round"])))
        printed[:] = summary["lines"]
        out.write_text(json.dumps({"model": {**cfg.__dict__, "params": n, "batch": args.batch, "tokens": args.tokens},
                                   "device": name, "dtype": dtype, "compile": args.compile, "clip": args.clip,
                                   "bounds": bounds,
                                   "runs": runs,
                                   "summary": {k: v for k, v in summary.items() if k != "lines"},
                                   "complete": complete}, indent=2,
                                  default=str))
        return summary

    order = [(r, p) for r in range(args.rounds) for p in placements]
    for rnd, placement in progress(order, "placements"):
        kinds = ["plain"] if placement == "plain" else \
            ["ours"] + [peer for peer, on in peers.items() if on and placement in PEERS[peer]]
        for kind in kinds:
            result = launch({**base, "kind": kind, "placement": placement}, args.timeout)
            runs.append({"framework": {"plain": "torch", "ours": "offload"}.get(kind, kind), "placement": placement,
                         "round": rnd, **result})
            _row(runs[-1])
            write(False)
    for line in write(True)["lines"]:
        print(line)
    print(f"\nwrote {out}")
    failed = [r for r in runs if r["framework"] == "offload" and r["status"] != "ok"]
    if failed:  # the library's own runs: a peer's failure, or plain torch out of memory, is a finding, not ours
        print(f"{len(failed)} run(s) of offload did not finish: " + "; ".join(
            f"{r['placement']} (round {r['round']}): {r['status']}" for r in failed), file=sys.stderr)
        sys.exit(1)


def _on_sigterm(lines: list[str]) -> None:
    """A time limit around the bench (SIGTERM): the run in progress goes, and what was measured is printed (the
    JSON already holds it)."""
    def handler(*_: Any) -> None:
        for proc, work in list(_running):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended as the signal came
                pass
            proc.wait()
            shutil.rmtree(work, ignore_errors=True)
        print("\nstopped (SIGTERM); measured so far:" + "".join(f"\n{line}" for line in lines), flush=True)
        os._exit(143)
    signal.signal(signal.SIGTERM, handler)


def _why_not(flag: str, module: str, device: torch.device, clip: float = 0.0) -> str:
    """Why a peer that needs CUDA and an importable module sits out, for the header (``clip``: torchao's)."""
    if flag == "off":
        return f"--{module} off"
    return ", ".join(why for why, lacking in (("not importable", not _importable(module)),
                                              ("no CUDA", device.type != "cuda"),
                                              ("--clip: no clipping reaches its step", clip > 0)) if lacking)


def _importable(name: str) -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec(name) is not None


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f} GiB"


def _row(r: dict[str, Any]) -> None:
    if r["status"] != "ok":
        print(f"  {r['framework']:9s} {r['placement']:16s} {r['status']}", flush=True)
        return
    gib = 1 << 30
    gpu = f"{r['gpu_peak'] / gib:7.2f}" if r["gpu_peak"] is not None else "      -"
    pinned = f"{r['pinned'] / gib:7.2f}" if r["pinned"] is not None else "      -"
    print(f"  {r['framework']:9s} {r['placement']:16s} {r['step_seconds']:8.3f} s {r['tokens_per_s']:9.0f} tok/s  "
          f"GPU {gpu} GiB  host {r['host_peak_rss'] / gib:7.2f} GiB  pinned {pinned} GiB  loss "
          f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", flush=True)


def _rounds_summary(runs: list[dict[str, Any]], bounds: dict[str, Any], n: int,
                    rounds: int) -> dict[str, Any]:
    """The summary of one round, or with several the median of each round's ratios (``per_round``: them all)."""
    each = [_summary([r for r in runs if r["round"] == k], bounds, n) for k in range(rounds)]
    if rounds == 1:
        return each[0]
    out: dict[str, Any] = {"params": n, "per_round": [{k: v for k, v in e.items() if k != "lines"} for e in each]}
    lines = [f"\nsummary: medians of {rounds} rounds (each round runs every placement once, in turn)"]
    for key in dict.fromkeys(k for e in each for k in e if k not in ("lines", "params")):
        got = [e[key] for e in each if key in e]
        if isinstance(got[0], dict):
            out[key] = {f: statistics.median(g[f] for g in got) if isinstance(got[0][f], (int, float)) else got[0][f]
                        for f in got[0]}
            shown = {f: [round(g[f], 3) for g in got] for f in got[0]
                     if f in ("ratio", "step", "host_peak_rss", "rss_ratio", "setup_rss_ratio")}
        else:
            out[key], shown = statistics.median(got), {"value": [round(g, 3) for g in got]}
        lines.append(f"  {key}: " + "; ".join(f"{f} median {statistics.median(v):.3f} (rounds: "
                                               f"{', '.join(str(x) for x in v)})" for f, v in shown.items()))
    out["lines"] = lines
    return out


def _summary(runs: list[dict[str, Any]], bounds: dict[str, Any], n: int) -> dict[str, Any]:
    """Ratios: ours against the bound (opt-host) and against DeepSpeed (each placement); each tier's peak against
    the estimate."""
    lines, out = ["\nsummary"], {}
    ok = {(r["framework"], r["placement"]): r for r in runs if r["status"] == "ok"}
    compute = bounds["compute"].get("step_seconds") if bounds["compute"]["status"] == "ok" else None
    transfer = bounds["pcie"].get("both") if bounds["pcie"]["status"] == "ok" else None
    for placement in ("opt-host", "opt-host-overlap"):
        ours = ok.get(("offload", placement))
        if not (ours and ours.get("parts")):
            continue
        parts = {"compute": compute, "adam": ours["parts"]["adam"], "pcie": transfer}
        bound = max(v for v in parts.values() if v is not None)
        key = "opt_host_bound" + placement[len("opt-host"):].replace("-", "_")
        out[key] = {**parts, "bound": bound, "ratio": ours["step_seconds"] / bound}
        # without CUDA (no GPU peak) the "pcie" bound is a host memcpy: named so where printed, the key kept
        names = {"pcie": "memcpy"} if ours["gpu_peak"] is None else {}
        shown = ", ".join(f"{names.get(k, k)} {'-' if v is None else f'{v:.3f}'}" for k, v in parts.items())
        lines.append(f"  {placement}: step {ours['step_seconds']:.3f} s / max({shown}) = {out[key]['ratio']:.2f}"
                     "  (target <= 1.15)")
    serial, beside = ok.get(("offload", "opt-host")), ok.get(("offload", "opt-host-overlap"))
    if serial and beside:
        out["overlap_forward_speedup"] = serial["step_seconds"] / beside["step_seconds"]
        lines.append(f"  overlap_forward: step() returning with every update done {serial['step_seconds']:.3f} s / "
                     f"the next forward beside the updates {beside['step_seconds']:.3f} s = "
                     f"{out['overlap_forward_speedup']:.2f}x")
    ds_host = ok.get(("deepspeed", "opt-host"))
    if beside and ds_host:
        out["speedup_vs_deepspeed/opt-host-overlap"] = ds_host["step_seconds"] / beside["step_seconds"]
        lines.append(f"  opt-host-overlap: DeepSpeed opt-host {ds_host['step_seconds']:.3f} s / ours "
                     f"{beside['step_seconds']:.3f} s = {out['speedup_vs_deepspeed/opt-host-overlap']:.2f}x")
    plain = ok.get(("torch", "plain"))
    for placement in ("opt-host", "opt-host-overlap", "opt+params-host", "opt-nvme", "opt+params-nvme"):
        r = ok.get(("offload", placement))
        if r and plain:
            ratios = {"host_peak_rss": r["host_peak_rss"] / plain["host_peak_rss"],
                      "step": r["step_seconds"] / plain["step_seconds"]}
            out[f"vs_plain/{placement}"] = ratios
            lines.append(f"  {placement}: host peak RSS {ratios['host_peak_rss']:.2f}x plain torch's, step "
                         f"{ratios['step']:.2f}x")
        for peer, name in (("deepspeed", "DeepSpeed"), ("fsdp", "FSDP2"), ("torchao", "torchao")):
            other = ok.get((peer, placement))
            if r and other:
                out[f"speedup_vs_{peer}/{placement}"] = other["step_seconds"] / r["step_seconds"]
                lines.append(f"  {placement}: {name} {other['step_seconds']:.3f} s / ours {r['step_seconds']:.3f} s "
                             f"= {other['step_seconds'] / r['step_seconds']:.2f}x")
        if r and "estimate" in r:
            e, report = r["estimate"], r["engine"]["memory_report"]
            store_peak = report["host"]["peak"]
            # what the run added to the process's RSS (the model built in RAM included) against what the estimate
            # puts in RAM: the host tier, and on a CPU device the device tier too (there activations come on top)
            added, setup = (r[k] - r["host_base_rss"] for k in ("host_peak_rss", "host_setup_rss"))
            in_ram = e["host"] + (e["device"] if r["gpu_peak"] is None else 0)
            out[f"host_estimate/{placement}"] = {"estimate": e["host"], "store_peak": store_peak,
                                                  "rss_peak": r["host_peak_rss"], "ratio": store_peak / e["host"],
                                                  "estimate_in_ram": in_ram, "rss_added": added,
                                                  "rss_ratio": added / in_ram, "setup_rss_added": setup,
                                                  "setup_rss_ratio": setup / in_ram}
            lines.append(f"  {placement}: host estimate {_gib(e['host'])} (budget {_gib(e['host_budget'])}), "
                         f"measured {_gib(store_peak)} (tier peak); RSS {_gib(r['host_peak_rss'])}. Against the "
                         f"estimate's {_gib(in_ram)} in RAM: building the model and initialize added {_gib(setup)} "
                         f"({setup / in_ram:.2f}x), the whole run {_gib(added)} ({added / in_ram:.2f}x)")
            # the device: the tier's peak and, on CUDA, what torch's allocator held after initialize (the model's
            # state and the engine's buffers, before any activation) and at its peak in the steps (activations on
            # top, which the estimate leaves to the user); NVMe: the swap files' blocks on disk after the steps
            dev = {"estimate": e["device"], "tier_peak": report["device"]["peak"],
                   "cuda_setup": r.get("gpu_setup_peak"), "cuda_peak": r["gpu_peak"]}
            nvme = {"estimate": e["nvme"], "tier_peak": report["nvme"]["peak"], "on_disk": r.get("nvme_on_disk")}
            out[f"device_estimate/{placement}"], out[f"nvme_estimate/{placement}"] = dev, nvme
            lines.append(f"  {placement}: device estimate {_gib(dev['estimate'])}, tier peak "
                         f"{_gib(dev['tier_peak'])}, CUDA after initialize {_gib(dev['cuda_setup'])}, in the steps "
                         f"{_gib(dev['cuda_peak'])} (activations on top); NVMe estimate {_gib(nvme['estimate'])}, "
                         f"tier peak {_gib(nvme['tier_peak'])}, files on disk {_gib(nvme['on_disk'])}")
    out["lines"] = lines
    out["params"] = n
    return out


if __name__ == "__main__":
    main()
