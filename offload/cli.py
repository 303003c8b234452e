"""``python -m offload``: the command line. The only module that prints; the library logs.

    python -m offload demo [--layers 6] [--width 512] [--steps 30] [--placement nvme|cpu] [--config FILE]
    python -m offload estimate (--params N | --model config.json|module:callable) [--gpu-mem 24GiB] ...
    python -m offload tune --nvme-path DIR [--size 1GiB] [--quick] [--out aio.json]
    python -m offload bench {adam,nvme,step,params,train,gpu,load} [--out results/] [script flags ...]
    python -m offload export CHECKPOINT OUT [--format auto|safetensors|torch] [--max-shard-size 5GB] [--model CFG]

``demo`` trains a GPT (offload/models.py) that is larger than the device budget it is given, with optimizer
state and parameters offloaded (NVMe by default), on a synthetic task it can learn (each next token is a fixed
function of the current one), shows progress, and ends with a memory report per tier and where the time went.
``tune`` measures a directory's disk over block sizes, queue depths and thread counts with the swap engine and
writes the fastest as an ``aio`` config section. ``bench`` runs a script of bench/ (flags after the name go to
it), which writes JSON under --out, and draws PNG plots of it there (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from nvme_swapper import OWNER, remove_left_behind, write_owner

from ._device import default_device, fast_bf16
from ._progress import bar, interactive
from .config import OffloadConfig, is_auto, parse_bytes, read_json, without_auto
from .memory import Tier, fmt_bytes
from .persist import export, make_folder, save_checkpoint_folder


def _demo_config(args: argparse.Namespace, swap: Path, bf16: bool) -> dict[str, Any]:
    """Where things live and the budgets; every size (sub-groups, staging buffers, the parameter window, the
    prefetch) is left to the plan, which derives it from the budgets and the model. ``bf16``: where the device
    computes it at full speed, else fp32."""
    home = {"device": args.placement, "nvme_path": str(swap / "params")} if args.placement != "none" else {}
    return {
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01, "betas": [0.9, 0.95]}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": args.placement if args.placement != "none" else "cpu",
                                  "nvme_path": str(swap / "optimizer")},
            "offload_param": home or {"device": "none"},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8},
        "offload": {"device_memory_budget": parse_bytes(args.device_budget, "--device-budget")},
    }


def _user_config(path: str, swap: Path) -> dict[str, Any]:
    """``--config``: the user's JSON, with the demo's swap folder as the nvme_path of a section on NVMe that names
    none (the folder the demo makes and removes)."""
    config = read_json(path)
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    for name in ("offload_optimizer", "offload_param"):
        section = zero.get(name) if isinstance(zero, dict) else None
        if isinstance(section, dict) and section.get("device") == "nvme" and not section.get("nvme_path"):
            section["nvme_path"] = str(swap / name)
    return config


DEMO_PREFIX = "offload-demo-"  # the demo's swap folder, marked with its owner: a later demo removes a dead one's


def demo(args: argparse.Namespace) -> int:
    """Trains the demo model; SIGTERM (a timeout, a job scheduler) ends it like Ctrl-C, through the cleanup that
    closes the engine and removes the swap folder."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _demo(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _demo(args: argparse.Namespace) -> int:
    import offload
    from offload.models import GPT, GPTConfig, synthetic_batches

    for flag in ("layers", "width", "vocab", "tokens", "batch", "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    heads = max(1, args.width // 64)
    if args.width % heads:
        raise ValueError(f"--width {args.width} does not split into {heads} attention heads (one per 64): give a "
                         f"multiple of {heads}, e.g. {args.width - args.width % heads}")
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=args.vocab, context=max(args.tokens, 16), layers=args.layers, heads=heads,
                    width=args.width)
    n = cfg.num_parameters
    root = Path(args.swap_dir) if args.swap_dir else Path(tempfile.gettempdir())
    make_folder(root, "--swap-dir")
    remove_left_behind(root, f"{DEMO_PREFIX}*")  # demos killed before their cleanup (SIGKILL): their space is ours
    need = 16 * n + 12 * n // 4 * 4  # state + parameters + staging spares, generously
    free = shutil.disk_usage(root).free
    if not args.config and args.placement == "nvme" and need > free * 0.9:  # (a config's NVMe: initialize checks)
        print(f"error: the demo needs about {fmt_bytes(need)} of swap space but {root} has {fmt_bytes(free)} free; "
              "pass --swap-dir on a larger disk or a smaller --layers/--width", file=sys.stderr)
        return 2
    swap = Path(tempfile.mkdtemp(prefix=DEMO_PREFIX, dir=root))
    try:
        write_owner(swap)
        bf16 = fast_bf16(default_device())
        config = _user_config(args.config, swap) if args.config else _demo_config(args, swap, bf16)
        with offload.initialize(GPT(cfg), config) as engine:
            budget = engine.memory_report()["device"]["budget"]
            plan = engine.plan()
            param_bytes = plan.dtype_bytes
            state = (12 + param_bytes) * n  # parameters, fp32 master weights and moments
            print(f"offload demo: GPT {cfg.layers} layers x {cfg.width} wide, {n / 1e6:.1f}M parameters; "
                  f"parameters + Adam state = {fmt_bytes(state)}, device budget {fmt_bytes(budget)}"
                  + ((f" ({state / budget:.1f}x smaller)" if state > budget else " (the model fits it: raise "
                      "--layers or --width, or lower --device-budget, to exceed it)") if budget else "")
                  + f"; optimizer state on {plan.optimizer_tier.value}, parameters on {plan.param_tier.value}"
                  + (f" (from {args.config}: its placement, budgets and lr, not --placement, --device-budget "
                     "and --lr)" if args.config else "")
                  + f"; {str(engine.dtype).removeprefix('torch.')}"
                  + ("" if bf16 or args.config else " (no native bf16 on this CPU: fp32 is ~100x faster here)")
                  + f"; swap under {swap}")
            data = synthetic_batches(cfg.vocab_size, args.batch, args.tokens, args.seed)
            first = last = None
            t_start = time.perf_counter()
            compute = stepping = 0.0
            steps = bar(args.steps, "train", "step")
            for step in range(1, args.steps + 1):
                x, y = next(data)
                t = time.perf_counter()
                loss = GPT.loss(engine(x), y)
                engine.backward(loss)
                t_step = time.perf_counter()
                compute += t_step - t
                engine.step()
                stepping += time.perf_counter() - t_step
                last = loss.item()
                first = last if first is None else first
                elapsed = time.perf_counter() - t_start
                moved = engine.stats()["bytes_moved"]
                gb = " ".join(f"{k} {v / 1e9:.2f}GB" for k, v in sorted(moved.items()))
                rate = step * args.batch * args.tokens / elapsed
                norm = engine.last_grad_norm
                norm_text = "-" if norm is None else f"{norm:.4f}"
                if steps.disable:  # not a terminal: one plain line per step
                    print(f"step {step:4d}/{args.steps}  loss {last:7.4f}  grad norm {norm_text:>7}  {rate:8.0f} "
                          f"tok/s  {gb}", file=sys.stderr, flush=True)
                else:
                    steps.set_postfix_str(f"loss {last:.4f}, grad norm {norm_text}, {rate:.0f} tok/s, {gb}",
                                          refresh=False)
                    steps.update()
            steps.close()
            total = time.perf_counter() - t_start
            stats, report, plan = engine.stats(), engine.memory_report(), engine.plan()
            swap_files = sum(f.stat().st_size for f in swap.rglob("swap.*"))
    finally:
        _remove_demo_folder(swap)
    print(f"\nloss {first:.4f} -> {last:.4f} over {args.steps} steps ({total:.1f} s)")
    print("\nthe plan (sizes derived from the budgets and the model):\n  " + plan.describe().replace("\n", "\n  "))
    print("\nmemory per tier        current        peak      budget")
    for tier, r in report.items():
        print(f"  {tier:8s} {fmt_bytes(r['current']):>14s} {fmt_bytes(r['peak']):>11s} {fmt_bytes(r['budget']):>11s}")
    print(f"  host peak = {report['host']['peak'] / state:.2f} x the {fmt_bytes(state)} of parameters and optimizer "
          "state")
    if swap_files:
        offloaded = report["nvme"]["optimizer_state"] + (param_bytes * n if plan.param_tier is Tier.NVME else 0)
        print(f"  swap files {fmt_bytes(swap_files)} = {swap_files / offloaded:.2f} x the {fmt_bytes(offloaded)} "
              "offloaded to NVMe")
    stall, adam = stats["stall_seconds"], stats["adam_seconds"]
    print("\nwhere the time went")
    print(f"  forward+backward   {compute:7.2f} s  (parameter fetches, gradient streaming and, overlapped, "
          f"{stats['overlap_fraction']:.0%} of the Adam work)")
    print(f"  optimizer step     {stepping:7.2f} s  (the rest of the Adam work, state read/written on NVMe)")
    print(f"  CPU Adam (total)   {adam:7.2f} s  on the optimizer thread; waiting for I/O {stall:.2f} s in all")
    if stats["params"]:
        print(f"  parameter fetches found resident or in flight: {stats['params']['hit_rate']:.1%}")
    return 0 if last is not None and last < first else 1


def _remove_demo_folder(swap: Path) -> None:
    """The demo's swap folder removed, its owner record last: a demo killed midway through this leaves a folder
    the next one still knows for a dead demo's (without the record it would never be touched)."""
    for entry in swap.iterdir() if swap.is_dir() else ():
        if entry.name == OWNER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    shutil.rmtree(swap, ignore_errors=True)


def _load_model(spec: str) -> torch.nn.Module:
    """A model on the meta device (no memory) from a transformers config.json or a ``module:callable``."""
    import importlib

    with torch.device("meta"):
        if spec.endswith(".json") or Path(spec).is_dir():
            import transformers

            path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or "model_type" not in data:
                raise ValueError(f"--model {path}: a transformers config.json names its architecture under "
                                 "\"model_type\" (e.g. \"llama\"); this one has none")
            cfg = transformers.AutoConfig.for_model(**data)
            return transformers.AutoModelForCausalLM.from_config(cfg)
        module, _, name = spec.partition(":")
        if not name:
            raise ValueError(f"--model {spec!r}: give a config.json path or module:callable")
        return getattr(importlib.import_module(module), name)()


def _memory(text: str | None, flag: str, *, machine: bool = True) -> int | None:
    """A machine's memory or disk (``machine``), or other bytes, from a flag: 0 (with a unit or without) is none of
    it; another bare number below 1 MiB is taken for a unit left out."""
    if not text:
        return None
    n = parse_bytes(text, flag)
    if 0 < n < 1 << 20:
        bare = text.strip().replace(".", "", 1).isdigit()
        if bare or machine:
            raise ValueError(f"{flag} {text} is {n} bytes: " + (f"give a unit, e.g. {text}GiB" if bare else
                                                                "a machine has at least 1 MiB; give its size"))
    return n


def estimate_command(args: argparse.Namespace) -> int:
    from .planner import DecoderShape, best, config_for, estimate, table

    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    cfg, auto = _estimate_config(args.config, args.gpus) if args.config else (None, [])
    knobs = _estimate_knobs(args, cfg)
    mem_flag, mem_text = ("--device-mem", args.device_mem) if args.device_mem is not None else \
        ("--gpu-mem", args.gpu_mem)
    gpu_mem, host_mem = _memory(mem_text, mem_flag), _memory(args.host_mem, "--host-mem")
    nvme_free = _memory(args.nvme_free, "--nvme-free")
    device = args.device
    if cfg is not None:  # its budgets are per rank; the flags' host and NVMe are the machine's
        budgets = cfg.offload
        gpu_mem = gpu_mem if gpu_mem is not None else budgets.device_memory_budget
        if host_mem is None and budgets.host_memory_budget:
            host_mem = budgets.host_memory_budget * args.gpus
        if nvme_free is None and budgets.nvme_memory_budget:
            nvme_free = budgets.nvme_memory_budget * args.gpus
        if device == "auto" and budgets.device != "auto":  # the config's device, unless --device says
            device = "cpu" if budgets.device == "cpu" else "cuda"
    cuda = device == "cuda" or (device == "auto" and (args.gpu_mem is not None or torch.cuda.is_available()))
    if device == "cuda" and gpu_mem is None and not torch.cuda.is_available():
        raise ValueError("--device cuda without CUDA here needs --gpu-mem (the memory of the GPU to plan for)")
    if gpu_mem is None and cuda:  # initialize's device budget there: sizes derive from it
        gpu_mem = torch.cuda.get_device_properties(0).total_memory
        print(f"--gpu-mem: {fmt_bytes(gpu_mem)}, this machine's {torch.cuda.get_device_name(0)} (the budget "
              "initialize takes on it; give --gpu-mem to plan for another)")
    elif not cuda:
        print("planned for the CPU as the device (" + ("--device cpu" if args.device == "cpu" else
                                                       "the config's offload.device" if device == "cpu" else
                                                       "no CUDA here")
              + "): its device tier is RAM too, so it counts under --host-mem with the host tier; "
              + (f"held to {fmt_bytes(gpu_mem)} (offload.device_memory_budget)" if gpu_mem is not None else
                 "--device-mem gives it a budget, as offload.device_memory_budget does") + ". Give --gpu-mem to "
              "plan for a GPU")
    kw = dict(gpus=args.gpus, cuda=cuda, gpu_mem=gpu_mem, host_mem=host_mem, nvme_free=nvme_free, **knobs)
    if args.largest_param is not None and args.model:
        raise ValueError("--largest-param goes with --params (a --model's parameters are known)")
    activations = _memory(args.activations, "--activations", machine=False) or 0
    if args.model:
        model = _load_model(args.model)
        ests = estimate(model=model, activations=activations, **kw)
        n = sum(p.numel() for p in model.parameters())
        name, biggest = max(((name, p.numel()) for name, p in model.named_parameters()), key=lambda item: item[1],
                            default=("none", 0))
        largest, whose = biggest, f"{biggest:,} elements, the model's own ({name})"
    else:
        n = _count(args.params, "--params", 1, 10**15, "a positive number of parameters such as 7e9")
        if args.largest_param is not None:
            largest = _count(args.largest_param, "--largest-param", 1, n, "a number of elements in [1, --params]")
            whose = f"{largest:,} elements, as given"
        else:  # a common decoder's: the whole model taken as one charged the device for a gradient of all of it
            shape = DecoderShape.typical(n)
            largest, whose = shape.largest_param, shape.describe()
        ests = estimate(n, largest_param=largest, activations=activations, **kw)
    ranks = f"{args.gpus} GPU(s)" if cuda else f"{args.gpus} rank(s) on the CPU"
    precision = "fp32" if knobs["dtype_bytes"] == 4 else "fp16" if knobs["fp16"] else "bf16"
    if auto:
        print(f"--config's {' and '.join(auto)} are \"auto\" (OffloadTrainer fills them from the TrainingArguments): "
              f"planned as {precision}; write true or false there to plan for the run's precision")
    gas = knobs["gradient_accumulation_steps"]
    print(f"{n / 1e9:.3g}B parameters, {precision} with fp32 Adam state, {ranks}"
          + (f", {gas} accumulation steps" if gas > 1 else "") + "; peak bytes per tier per rank:\n")
    print(table(ests))
    assumed = {
        "the largest parameter (--largest-param)" if not args.model else "the largest parameter": whose,
        "activations (--activations)": f"{fmt_bytes(activations)} at their peak, in the device column" if activations
        else "not counted; give their peak on the device (it grows with batch x sequence) to plan with them",
        "not counted": "the torch runtime, and a model built in RAM before initialize"
                       + (" (on the CPU, on top of host + device)" if not cuda else ""),
    }
    print("\nassumed:")
    for what, value in assumed.items():
        print(textwrap.fill(f"{what}: {value}", width=118, initial_indent="  ", subsequent_indent="    "))
    if args.json:
        rows = [{"placement": e.placement, "optimizer": e.optimizer, "params": e.params, "device_bytes": e.device,
                 "host_bytes": e.host, "nvme_bytes": e.nvme, "fits": e.fits, "limiting": e.limiting} for e in ests]
        Path(args.json).write_text(json.dumps({"params": n, "cuda": cuda, "gpus": args.gpus, "largest_param": largest,
                                               "activations_bytes": activations, "estimates": rows}, indent=2))
    choice = best(ests)
    if choice is None:
        print("\nnothing fits" if any(e.fits is not None for e in ests) else "\n(give --gpu-mem, --host-mem "
              "and --nvme-free to see what fits)")
        return 1 if any(e.fits is not None for e in ests) else 0
    print(f"\nbest: {choice.placement}\n{json.dumps(config_for(choice, precision=precision), indent=2)}")
    return 0


def _estimate_config(path: str, gpus: int) -> tuple[OffloadConfig, list[str]]:
    """``--config`` as a run on ``gpus`` ranks reads it: its sections that size memory, without "auto" values
    (OffloadTrainer fills those from the TrainingArguments; here they are the plan's or the defaults), and which
    of its precision switches were "auto" (read as off)."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path} must hold a JSON object, got {type(raw).__name__}")
    keep = ("zero_optimization", "offload", "fp16", "bf16", "bfloat16", "gradient_clipping", "train_batch_size",
            "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    auto = [f"{key}.enabled" for key in ("fp16", "bf16", "bfloat16")
            if isinstance(raw.get(key), dict) and is_auto(raw[key].get("enabled"))]
    return OffloadConfig.load(without_auto({k: v for k, v in raw.items() if k in keep})).for_world(gpus), auto


def _estimate_knobs(args: argparse.Namespace, cfg: OffloadConfig | None) -> dict[str, Any]:
    """The sizes a config sets (``--config``'s, each flag given over it), checked as initialize checks them."""
    knobs: dict[str, Any] = dict(dtype_bytes=2, gradient_accumulation_steps=1, sub_group_size=None,
                                 buffer_count=None, gradient_clipping=0.0, max_live_parameters=None,
                                 prefetch_bucket_size=None, persistence_threshold=None, fp16=False,
                                 overlap_step=True, delayed_update=False)
    if cfg is not None:
        zero = cfg.zero_optimization
        knobs.update(dtype_bytes=4 if cfg.dtype == torch.float32 else 2,
                     gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                     sub_group_size=zero.sub_group_size, buffer_count=zero.offload_optimizer.buffer_count,
                     gradient_clipping=cfg.gradient_clipping, max_live_parameters=zero.stage3_max_live_parameters,
                     prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
                     persistence_threshold=zero.stage3_param_persistence_threshold, fp16=cfg.fp16.enabled,
                     overlap_step=zero.offload_optimizer.overlap_step,
                     delayed_update=zero.offload_optimizer.delayed_update)
    if args.sub_group_size is not None:
        knobs["sub_group_size"] = _count(args.sub_group_size, "--sub-group-size", 1, 10**15,
                                         "a number of elements such as 1e8")
    if args.buffer_count is not None:
        knobs["buffer_count"] = _count(args.buffer_count, "--buffer-count", 1, 64, "an integer in [1, 64]")
    if args.gradient_accumulation_steps is not None:
        knobs["gradient_accumulation_steps"] = _count(args.gradient_accumulation_steps,
                                                      "--gradient-accumulation-steps", 1, 10**6,
                                                      "a positive integer")
    if args.gradient_clipping is not None:
        if not math.isfinite(args.gradient_clipping) or args.gradient_clipping < 0:
            raise ValueError(f"--gradient-clipping must be 0 (off) or a positive number, got {args.gradient_clipping}")
        knobs["gradient_clipping"] = args.gradient_clipping
    return knobs


def _count(text: Any, flag: str, lo: int, hi: int, what: str) -> int:
    """A whole number from a flag (``7e9`` spelling too), or ValueError naming the flag and what is allowed."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value != int(value) or not lo <= value <= hi:
        raise ValueError(f"{flag} must be {what}, got {text!r}")
    return int(value)


def _byte_list(text: str, flag: str) -> list[int]:
    return [parse_bytes(v.strip(), flag) for v in text.split(",") if v.strip()]


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers such as 1,8,32, got {text!r}") from None


def tune_command(args: argparse.Namespace) -> int:
    from nvme_swapper import AioConfig, grid, tune_aio

    size = parse_bytes(args.size, "--size") if args.size else (64 << 20 if args.quick else 1 << 30)
    if size < 1 << 20 or size % 4096:
        raise ValueError(f"--size must be at least 1MiB and a multiple of 4KiB, got {args.size}")
    blocks = _byte_list(args.block_sizes or ("1MiB,4MiB" if args.quick else "256KiB,1MiB,4MiB,8MiB"),
                        "--block-sizes")
    depths = _int_list(args.queue_depths or ("1,8,32" if args.quick else "1,4,16,32"), "--queue-depths")
    threads = _int_list(args.thread_counts or ("1" if args.quick else "1,2"), "--thread-counts")
    checks = [("--block-sizes", {"block_size": v}) for v in blocks] + \
        [("--queue-depths", {"queue_depth": v}) for v in depths] + \
        [("--thread-counts", {"thread_count": v, "queue_depth": max(v, 1)}) for v in threads]
    for flag, fields in checks:
        try:
            AioConfig(**fields)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    if not blocks or not depths or not threads:
        raise ValueError("--block-sizes, --queue-depths and --thread-counts each need at least one value")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if not 0 <= args.tolerance < 1:
        raise ValueError(f"--tolerance must be in [0, 1) (a fraction: 0.03 is 3%), got {args.tolerance}")
    n_settings = len(grid(blocks, depths, threads))
    if not n_settings:
        raise ValueError(f"--queue-depths {depths} are all below --thread-counts {threads}: each thread needs at "
                         "least one request slot")
    print(f"tune: {args.nvme_path}, {fmt_bytes(size)} written and read per measurement, {n_settings} settings x "
          f"{repeats} round(s)", file=sys.stderr, flush=True)

    measurements = bar(desc="measurements")

    def progress(done: int, total: int) -> None:
        measurements.total = total
        measurements.update(done - measurements.n)

    make_folder(Path(args.nvme_path), "tune --nvme-path")
    try:
        result = tune_aio(args.nvme_path, size=size, block_sizes=blocks, queue_depths=depths,
                          thread_counts=threads, repeats=repeats, tolerance=args.tolerance, progress=progress)
    finally:
        measurements.close()
    print(f"\nmedians of {repeats} round(s), GB/s = 10^9 B/s; score = 2 / (1/write + 1/read) (the optimizer step "
          f"writes and reads the same bytes); * chosen, + within {result.tolerance:.0%} of the best (the smallest "
          f"setting of those wins)\n")
    print(result.table())
    if not result.o_direct:
        print(f"\nwarning: {result.fallback_reason}: these are buffered (page cache) numbers", file=sys.stderr)
    fragment = json.dumps(result.fragment(), indent=2)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(fragment + "\n")
        print(f"\nwrote {out} ({result.seconds:.0f} s of measurement)")
    else:
        print(f"\n{fragment}")
    return 0


BENCHES = {"adam": "cpu_adam", "nvme": "nvme_swapper", "step": "offload_step", "params": "param_offload",
           "reads": "param_reads", "train": "train", "gpu": "gpu_train", "load": "load"}


def bench_command(args: argparse.Namespace) -> int:
    import subprocess

    from . import _plots

    extra = list(args.args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if "--no-plot" in extra:  # after the name too, as --out is
        extra.remove("--no-plot")
        args.no_plot = True
    out_dir = Path(args.out)
    for i, a in enumerate(extra):  # --out after the name: still the results folder (argparse hands it over)
        if a == "--out" and i + 1 < len(extra):
            out_dir = Path(extra[i + 1])
            del extra[i : i + 2]
            break
        if a.startswith("--out="):
            out_dir = Path(a.split("=", 1)[1])
            del extra[i]
            break
    script = Path(__file__).resolve().parent.parent / "bench" / f"{BENCHES[args.name]}.py"
    if not script.exists():
        raise RuntimeError(f"bench: {script} not found; the benchmarks ship with the source checkout, run from one")
    if "-h" in extra or "--help" in extra:
        return subprocess.run([sys.executable, str(script), "--help"], check=False).returncode
    if not args.no_plot:
        _plots._pyplot()  # fail before a long run, not after it
    make_folder(out_dir, "bench --out")
    result = out_dir / f"{BENCHES[args.name]}.json"
    cmd = [sys.executable, str(script), *extra, "--out", str(result)]
    print(f"bench {args.name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    before = result.stat().st_mtime_ns if result.exists() else None
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
        print(f"error: {script.name} exited with status {rc}", file=sys.stderr)
    fresh = result.exists() and result.stat().st_mtime_ns != before  # (not an earlier run's)
    try:
        data = json.loads(result.read_text()) if fresh else None
    except json.JSONDecodeError:  # cut short mid-write (a SIGTERM): nothing whole to plot
        data = None
    done = data is not None and (rc == 0 or (isinstance(data, dict) and data.get("complete")))
    if done and not args.no_plot:  # a bench that ended with some runs failed still plots the others
        try:
            paths = _plots.plot(args.name, data, out_dir)
        except ValueError as exc:
            if rc == 0:
                raise
            print(f"no plots: {exc}", file=sys.stderr)
        else:
            print("plots: " + ", ".join(str(p) for p in paths))
    return rc


_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def export_command(args: argparse.Namespace) -> int:
    """A checkpoint (written by any number of ranks) as the full fp32 model: a folder of safetensors (sharded with an
    index above --max-shard-size) that from_pretrained and offload.load_state_dict read, or one torch file."""
    out = Path(args.out)
    fmt = args.format if args.format != "auto" else "torch" if out.suffix in _TORCH_SUFFIXES else "safetensors"
    if fmt == "safetensors" and out.suffix == ".safetensors":
        raise ValueError(f"{out} names a file, but a safetensors export is a folder (model.safetensors, or shards and "
                         "their index, as from_pretrained reads them): give a folder, e.g. "
                         f"{out.with_suffix('')}")
    if parse_bytes(args.max_shard_size, "--max-shard-size") <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {args.max_shard_size!r}")
    if fmt == "torch":
        make_folder(out.parent, "export")
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(f"export: cannot write {out}: this process may not write in {out.parent}; give a "
                                  "path it can write")

        tag, count = export(Path(args.checkpoint), out, args.tag)
        print(f"wrote {out}: {count} tensors of checkpoint {tag} (torch.load({str(out)!r}, weights_only=True))")
        return 0
    if args.model:
        model, config = _load_model(args.model), _config_json(args.model)
    else:
        model, config = _model_beside(Path(args.checkpoint))
    written = bar(desc="export", unit="B", unit_scale=True)
    try:
        tag, files = save_checkpoint_folder(Path(args.checkpoint), out, args.tag, args.max_shard_size,
                                            progress=written.update, module=model)
    finally:
        written.close()
    total = sum(f.stat().st_size for f in files)
    if config is not None and model is not None and not (out / "config.json").exists():
        tmp = out / ".config.json.tmp"  # the model's config beside its weights: from_pretrained(out) reads both
        data = json.loads(Path(config).read_text())
        for key in ("torch_dtype", "dtype"):  # the weights written are the fp32 masters (dtype="auto" reads this)
            if key in data:
                data[key] = "float32"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, out / "config.json")
        files.append(out / "config.json")
    print(f"wrote {out}: {len(files)} file(s), {fmt_bytes(total)}, of checkpoint {tag} " +
          ("(from_pretrained or offload.load_state_dict read it)" if config is not None and model is not None else
           "(offload.load_state_dict, or from_pretrained with the model's config.json beside them)"))
    return 0


def _config_json(spec: str) -> Path | None:
    """The config.json a ``--model`` spec names (a file or its folder); None for ``module:callable``."""
    path = Path(spec)
    if path.is_dir():
        return path / "config.json"
    return path if spec.endswith(".json") else None


def _model_beside(checkpoint: Path) -> tuple[torch.nn.Module | None, Path | None]:
    """The model a checkpoint holds, on the meta device, and its config.json, where OffloadTrainer leaves it: in
    the checkpoint-N folder that holds ``offload_state`` (or in the checkpoint's own folder). (None, None) without
    one, or with one that does not build (said: the export then writes the tensors' own names)."""
    config = next((f / "config.json" for f in (checkpoint, checkpoint.parent) if (f / "config.json").is_file()), None)
    if config is None:
        return None, None
    try:
        return _load_model(str(config)), config
    except Exception as exc:  # noqa: BLE001 - found, not asked for: the export goes on under the model's names
        print(f"export: {config} does not build a transformers model ({exc}); writing the tensors' own names "
              "(--model CFG to choose one)")
        return None, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a model larger than the device budget with NVMe offload")
    d.add_argument("--layers", type=int, default=6)
    d.add_argument("--width", type=int, default=512)
    d.add_argument("--vocab", type=int, default=512)
    d.add_argument("--tokens", type=int, default=64, help="sequence length")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--lr", type=float, default=3e-4)
    d.add_argument("--placement", choices=["nvme", "cpu", "none"], default="nvme",
                   help="where parameters and optimizer state live (none: parameters on the device tier)")
    d.add_argument("--device-budget", default="24MiB", help="bytes the device tier may hold")
    d.add_argument("--swap-dir", default=None, help="where swap files go (default: $TMPDIR)")
    d.add_argument("--config", default=None, help="a DeepSpeed-shaped JSON config instead of the demo's")
    d.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("estimate", help="bytes per tier for each placement, and the one that fits")
    what = e.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="number of parameters (e.g. 7e9)")
    what.add_argument("--model", help="a transformers config.json (or its folder), or module:callable")
    e.add_argument("--largest-param", default=None, help="with --params: elements of the largest parameter (a "
                   "GPT's embedding, vocabulary x width: 525336576 for 128256 x 4096); default: that of a decoder "
                   "of --params shaped as Llama's (printed with the estimate)")
    e.add_argument("--activations", default=None, help="the activations' peak on the device, e.g. 6GiB: charged "
                   "to the device tier (default: not counted)")
    e.add_argument("--config", default=None, help="a DeepSpeed-shaped JSON config: its precision, accumulation "
                   "steps, sizes, clipping and offload budgets (per rank) are planned with; flags given win")
    e.add_argument("--gpus", type=int, default=1)
    e.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="plan for a GPU or for the "
                   "CPU as the device (default: a GPU where CUDA is here or --gpu-mem is given, else the CPU)")
    mem = e.add_mutually_exclusive_group()
    mem.add_argument("--gpu-mem", help="memory per GPU, e.g. 24GiB (default: this machine's first GPU, the budget "
                     "initialize takes there)")
    mem.add_argument("--device-mem", help="the device tier's budget, offload.device_memory_budget: the CPU's "
                     "where the plan is for the CPU (no CUDA here, or --device cpu), else the GPU's")
    e.add_argument("--host-mem", help="host RAM of the machine, e.g. 256GiB")
    e.add_argument("--nvme-free", help="free NVMe space, e.g. 2TB")
    e.add_argument("--sub-group-size", default=None, help="the config's sub_group_size (default: derived from the "
                   "budgets, as initialize derives it)")
    e.add_argument("--buffer-count", default=None, help="the config's offload_optimizer.buffer_count (default: "
                   "derived, as initialize derives it)")
    e.add_argument("--gradient-accumulation-steps", default=None, help="the config's gradient_accumulation_steps "
                   "(above 1 the gradients are held whole in fp32 until the step)")
    e.add_argument("--gradient-clipping", type=float, default=None, help="the config's gradient_clipping: above 0 "
                   "every gradient is held on the host until the step (else a few sub-groups' worth)")
    e.add_argument("--json", default=None, help="also write the estimates to this JSON file (bytes)")
    t = sub.add_parser("tune", help="measure a directory's disk and write the fastest aio settings as JSON")
    t.add_argument("--nvme-path", required=True, help="directory on the disk the swap files will use")
    t.add_argument("--size", default=None, help="bytes written and read per measurement (default 1GiB; 64MiB "
                   "with --quick)")
    t.add_argument("--block-sizes", default=None, help="comma-separated (default 256KiB,1MiB,4MiB,8MiB)")
    t.add_argument("--queue-depths", default=None, help="comma-separated (default 1,4,16,32)")
    t.add_argument("--thread-counts", default=None, help="comma-separated (default 1,2)")
    t.add_argument("--repeats", type=int, default=None, help="rounds over the grid; medians are compared "
                   "(default 3; 1 with --quick)")
    t.add_argument("--tolerance", type=float, default=0.03, help="settings this close to the best count as tied; "
                   "the smallest of them wins (default 0.03)")
    t.add_argument("--quick", action="store_true", help="a small grid, 64MiB, one round (a smoke test)")
    t.add_argument("--out", default=None, help="write the aio fragment here (default: print it)")
    b = sub.add_parser("bench", help="run a benchmark of bench/, write its JSON and PNG plots under --out",
                       description="Runs bench/<script>.py NAME with the flags after NAME (see each script's "
                       "--help), writes its JSON as OUT/<script>.json and draws PNG plots beside it.")
    b.add_argument("name", choices=sorted(BENCHES), help="adam: CPU Adam; nvme: swap engine; step: offloaded "
                   "optimizer step; params: parameter offload; reads: parameters read outside their module's "
                   "forward, found or declared; train: training steps of a GPT on NVMe; gpu: each placement on one "
                   "GPU beside plain torch and DeepSpeed; load: a sharded safetensors checkpoint loaded within a host "
                   "budget")
    b.add_argument("--out", default="results", help="results folder (default results/)")
    b.add_argument("--no-plot", action="store_true", help="JSON only")
    b.add_argument("args", nargs=argparse.REMAINDER, help="flags for the script")
    x = sub.add_parser("export", help="a checkpoint as the full fp32 model: safetensors (sharded) or one torch file")
    x.add_argument("checkpoint", help="the folder given to engine.save_checkpoint")
    x.add_argument("out", help="a folder for safetensors (model.safetensors, or shards and their index), or a "
                   ".pt/.pth/.bin file for torch.load")
    x.add_argument("--format", choices=["auto", "safetensors", "torch"], default="auto",
                   help="auto: torch for a .pt/.pth/.bin name, else safetensors")
    x.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    x.add_argument("--tag", default=None, help="which checkpoint (default: the latest)")
    x.add_argument("--model", default=None,
                   help="the model's transformers config.json (or its folder): safetensors in the Hub's layout, as "
                   "save_pretrained writes them (default: a config.json beside the checkpoint, as OffloadTrainer's "
                   "checkpoint-N folders hold; without one, the model's own names)")
    args = ap.parse_args(argv)
    commands = {"demo": demo, "estimate": estimate_command, "tune": tune_command, "bench": bench_command,
                "export": export_command}
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C: the command's cleanup has run as it unwound; one line, the shell's status
        print(("\n" if interactive() else "") + f"{ap.prog} {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except (ValueError, RuntimeError, OSError, TypeError, ImportError, AttributeError) as exc:
        message = str(exc)
        if args.command == "demo" and not args.config:  # the demo's own config: its flag sets that budget
            message = message.replace("offload.device_memory_budget", "--device-budget")
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
