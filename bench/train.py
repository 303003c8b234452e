"""Training steps of a GPT with parameters and Adam state on NVMe, against the disk's floor measured in the same run.

A GPT-style model (offload/models.py) of ``--params`` parameters (or ``--layers`` x ``--width``) trains on the demo's
synthetic task (each next token a fixed permutation of the current one) with ZeRO-3-style placement: bf16
parameters homed on NVMe and fetched through a window of ``--live`` elements, fp32 master weights and Adam moments
(12 B/param) on NVMe, gradients in host RAM. Per step it reports the time (forward+backward, optimizer step), the
loss, the bytes the swap engines read and wrote, and where the time went:

  compute   forward+backward minus the time waiting for reads during it
  adam      CPU Adam inside engine.step() (Adam that ran during backward, overlapped, is reported apart)
  stalled   time waiting for NVMe reads (parameter fetches, optimizer state)
  i/o       the rest of engine.step(): write-backs draining, parameters written to their homes, bookkeeping

With the optimizer overlapping backward (the default), its waits during backward happen on the optimizer thread
and are counted in "stalled" too, so "compute" is then a lower bound; --no-overlap makes the split exact.

The floor: the disk measured in this run (a sequential O_DIRECT write then read of ``--probe-size`` bytes through a
SwapEngine with the same AioConfig in the same directory, before and after training; the best of each) gives
floor = bytes read / read GB/s + bytes written / write GB/s per step (this disk does not overlap reads with writes,
docs/benchmarks.md), and the ratio step time / floor says how close a step comes to the disk's limit.

Memory: the model is built inside ``offload.init`` (its fp32 parameters go to a file arena on the NVMe directory as
modules are built: the peak RSS of construction is printed) and moves into its homes at initialize; host RAM then
holds the gradients (2 B/param), the optimizer's staging buffers and the device window. Sizes not given
(``--sub-group``, ``--buffers``, ``--live``) are the plan's, derived from the budgets and the model
(offload/plan.py). The plan (offload.estimate, the same arithmetic) is printed first, and a plan that does not fit
in MemAvailable stops the run. A ~3.8B model: ``python bench/train.py --params 3.8e9 --nvme-dir /local_nvme``
needs about 57 GiB of disk and 11 GiB of RAM.

    python bench/train.py [--params 1e8 | --layers L --width W] [--steps 4] [--warmup 1] [--tokens 64] [--batch 1]
                          [--nvme-dir DIR] [--aio FILE] [--sub-group N] [--buffers N] [--live N] [--prefetch N]
                          [--build init|bf16] [--probe-size 1GiB] [--no-overlap] [--one-batch]
                          [--out results/train.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _common import (add_gpt_flags, byte_count, check_live, count, exit_on_sigterm, gpt_heads, huge_pages,  # noqa: E402
                     largest_fetched, mem_available, out_help, peak_rss, proc_bytes, reset_peak_rss, shape_for)

import offload  # noqa: E402
from nvme_swapper import AioConfig, aligned_tensor  # noqa: E402
from nvme_swapper._tune import measure  # noqa: E402
from offload._device import fast_bf16  # noqa: E402
from offload.memory import fmt_bytes  # noqa: E402
from offload.models import GPT, GPTConfig, synthetic_batches  # noqa: E402


def probe(directory: Path, aio: AioConfig, nbytes: int) -> tuple[float, float]:
    """The disk alone: (write, read) GB/s of one sequential pass through a SwapEngine, write as an overwrite."""
    buf = aligned_tensor(nbytes, pin_memory=False)
    buf.random_(0, 256)
    write, read, _ = measure(directory, aio, buf)
    return write, read


def swap_bytes(engine: offload.Engine) -> tuple[int, int]:
    """Bytes read and written so far by the engine's swap engines (optimizer state, and parameter homes)."""
    stats = engine.stats()
    swaps = [stats["nvme"], stats["params"]["nvme"] if stats["params"] else None]
    return (sum(s["bytes_read"] for s in swaps if s), sum(s["bytes_written"] for s in swaps if s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt_flags(ap, params=10**8, vocab=8192, tokens=64, batch=1, steps=4, warmup=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--nvme-dir", default=None, help="where the swap files go (default: a temp dir in cwd)")
    ap.add_argument("--aio", default=None, help="a JSON file with an aio section (python -m offload tune --out)")
    ap.add_argument("--sub-group", type=count(1), default=None,
                    help="zero_optimization.sub_group_size (elements; default: the plan's)")
    ap.add_argument("--buffers", type=count(1, 64), default=None,
                    help="offload_optimizer.buffer_count (default: the plan's)")
    ap.add_argument("--live", type=count(1), default=None,
                    help="stage3_max_live_parameters (elements; default: the plan's)")
    ap.add_argument("--prefetch", type=count(1), default=None,
                    help="stage3_prefetch_bucket_size (elements; default: the plan's)")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="training dtype; auto: bf16 where this CPU runs it at full speed (offload._device.fast_bf16), "
                    "else fp32 (torch's bf16 matmuls are ~100x slower there)")
    ap.add_argument("--build", choices=["init", "bf16"], default="init",
                    help="init: inside offload.init (fp32 in a file arena); bf16: in RAM in bf16 (as before "
                         "offload.init)")
    ap.add_argument("--probe-size", type=byte_count, default="1GiB",
                    help="bytes of the disk probe before and after training")
    ap.add_argument("--no-overlap", action="store_true", help="offload_optimizer.overlap_step false")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one-batch", action="store_true",
                    help="train on one batch throughout (the overfit check): its loss falls within a few steps, where "
                         "fresh batches of the synthetic task need dozens of steps to show learning")
    ap.add_argument("--out", default="results/train.json", help=out_help("train"))
    args = ap.parse_args()
    if (args.width is not None) and args.layers is None:
        ap.error("--width needs --layers")
    probe_bytes = args.probe_size
    if probe_bytes < 1 << 20 or probe_bytes % 4096:
        ap.error(f"--probe-size must be at least 1MiB and a multiple of 4KiB, got {probe_bytes} bytes")
    aio_section: dict[str, Any] = {"block_size": 4 << 20, "queue_depth": 8, "thread_count": 1}
    try:
        if args.aio:
            fragment = json.loads(Path(args.aio).read_text())
            if not isinstance(fragment, dict):
                raise ValueError(f"a JSON object with an aio section expected, got {type(fragment).__name__}")
            aio_section = fragment.get("aio", {})
        aio = AioConfig.from_dict(aio_section)
    except (OSError, ValueError) as exc:
        ap.error(f"--aio {args.aio}: {exc}")

    if args.layers is not None:
        layers, width = args.layers, args.width or 768
    else:
        layers, width = shape_for(args.params, args.vocab, args.tokens)
    cfg = GPTConfig(vocab_size=args.vocab, context=args.tokens, layers=layers, heads=gpt_heads(ap, width), width=width)
    n = cfg.num_parameters
    sub_group = args.sub_group
    live = min(args.live, n) if args.live is not None else None
    base = Path(args.nvme_dir) if args.nvme_dir else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype if args.dtype != "auto" else "bf16" if fast_bf16(torch.device("cpu")) else "fp32"
    if args.build == "bf16" and dtype != "bf16":
        sys.exit("error: --build bf16 builds the model in bf16: it needs --dtype bf16")
    with torch.device("meta"):
        shape = GPT(cfg)
        plan = next(e for e in offload.estimate(model=shape, sub_group_size=sub_group, buffer_count=args.buffers,
                                                max_live_parameters=live, cuda=False,
                                                dtype_bytes=2 if dtype == "bf16" else 4)
                    if e.placement == "optimizer + parameters on nvme")
    if live is not None and plan.plan is not None:
        check_live(ap, live, largest_fetched(shape, plan.plan.persistence_threshold))
    avail, free = mem_available(), shutil.disk_usage(base).free
    print(f"train bench: GPT {layers} layers x {width} wide, {n / 1e9:.3g}B parameters, {args.tokens} tokens x "
          f"{args.batch}, {dtype}; plan per tier: device {fmt_bytes(plan.device)}, host {fmt_bytes(plan.host)}, nvme "
          f"{fmt_bytes(plan.nvme)}; the model is built "
          + (f"inside offload.init (fp32 in a file arena, {fmt_bytes(4 * n)})" if args.build == "init" else
             f"in RAM in bf16 ({fmt_bytes(2 * n)})")
          + f"; RAM available {fmt_bytes(avail)}, disk free {fmt_bytes(free)} at {base}", flush=True)
    need_ram = plan.host + plan.device + probe_bytes + (2 * n if args.build == "bf16" else 0)
    if need_ram > avail:
        sys.exit(f"error: the run needs about {fmt_bytes(need_ram)} of RAM (host plan + device window + the probe "
                 f"buffer) but {fmt_bytes(avail)} is available; lower --sub-group, --buffers, --live or "
                 "--probe-size, or the model size")
    # the arena (4 B/param) sits beside the optimizer state while initialize writes it, then gives its space back
    # parameter by parameter as the parameters' homes are written
    disk_need = max(plan.nvme, 12 * n + (4 * n if args.build == "init" else 0)) + probe_bytes
    if disk_need > free * 0.95:
        sys.exit(f"error: the run needs about {fmt_bytes(disk_need)} of disk (the swap files, and the construction "
                 f"arena during initialize) but {base} has {fmt_bytes(free)} free; pass --nvme-dir on a larger disk "
                 "or a smaller model")

    work = Path(tempfile.mkdtemp(prefix="bench-train-", dir=base))
    disk: list[tuple[float, float]] = []
    rows: list[dict[str, float]] = []
    try:
        disk.append(probe(work, aio, probe_bytes))
        print(f"disk before training: write {disk[0][0]:.2f} GB/s, read {disk[0][1]:.2f} GB/s", flush=True)
        zero: dict[str, Any] = {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(work / "optimizer"),
                                  "overlap_step": not args.no_overlap},
            "offload_param": {"device": "nvme", "nvme_path": str(work / "params")},
        }
        if sub_group is not None:
            zero["sub_group_size"] = sub_group
        if args.buffers is not None:
            zero["offload_optimizer"]["buffer_count"] = args.buffers
        if live is not None:
            zero["stage3_max_live_parameters"] = live
        if args.prefetch is not None:
            zero["stage3_prefetch_bucket_size"] = args.prefetch
        config = {
            "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01, "betas": [0.9, 0.95]}},
            "zero_optimization": zero,
            "aio": aio_section,
        }
        torch.manual_seed(args.seed)
        # the probe's buffer set the high-water mark; restarted here, it is construction's own
        peak_before_build, reset = peak_rss(), reset_peak_rss()
        rss_before, t = proc_bytes("/proc/self/status", "VmRSS")[0], time.perf_counter()
        if args.build == "init":
            with offload.init(config):
                model = GPT(cfg)
        else:
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = GPT(cfg)
            finally:
                torch.set_default_dtype(default_dtype)
        # the kernel keeps RSS in per-CPU counters that lag by a few hundred KiB on a many-core machine, so the
        # high-water mark can read just below the RSS read after the reset: a growth within that slack is none
        build = {"seconds": time.perf_counter() - t, "peak_rss": peak_rss(),
                 "rss_growth": max(peak_rss() - rss_before, 0) if reset else None}
        where = "inside offload.init" if args.build == "init" else "in RAM"
        growth = (f"{fmt_bytes(build['rss_growth'])} more than before" if reset else
                  "its growth not measured: /proc/self/clear_refs refused to reset the high-water mark")
        print(f"built {where}: {build['seconds']:.1f} s, peak RSS {fmt_bytes(build['peak_rss'])} "
              f"({growth}; the model's fp32 parameters are {fmt_bytes(4 * n)})", flush=True)
        t = time.perf_counter()
        engine = offload.initialize(model, config)
        del model  # the engine holds the module; its parameters now live on NVMe
        init_s = time.perf_counter() - t
        anon, huge = huge_pages()
        print(f"initialize: {init_s:.1f} s (parameters and optimizer state written to {work}; peak RSS "
              f"{fmt_bytes(peak_rss())} since the build; {fmt_bytes(huge)} of {fmt_bytes(anon)} anonymous memory in "
              "huge pages)\n"
              + engine.plan().describe(), flush=True)
        try:
            data = synthetic_batches(cfg.vocab_size, args.batch, args.tokens, args.seed)
            if args.one_batch:
                data = itertools.repeat(next(data))
            print(f"\n{'step':>5s} {'seconds':>8s} {'fwd+bwd':>8s} {'step()':>8s} {'loss':>8s} {'read GB':>8s} "
                  f"{'write GB':>9s} {'stalled':>8s} {'adam':>7s}", flush=True)
            for i in range(args.warmup + args.steps):
                x, y = next(data)
                s0, io0 = engine.stats(), swap_bytes(engine)
                t0 = time.perf_counter()
                loss = GPT.loss(engine(x), y)
                engine.backward(loss)
                t1 = time.perf_counter()
                s1 = engine.stats()
                engine.step()
                t2 = time.perf_counter()
                s2, io2 = engine.stats(), swap_bytes(engine)
                row = {
                    "step": i + 1, "warmup": i < args.warmup, "seconds": t2 - t0, "fwd_bwd": t1 - t0,
                    "optimizer_step": t2 - t1, "loss": loss.item(),
                    "bytes_read": io2[0] - io0[0], "bytes_written": io2[1] - io0[1],
                    "stalled_fwd_bwd": s1["stall_seconds"] - s0["stall_seconds"],
                    "stalled_step": s2["stall_seconds"] - s1["stall_seconds"],
                    "adam_step": (s2["adam_seconds"] - s1["adam_seconds"])
                    - (s2["adam_seconds_overlapped"] - s1["adam_seconds_overlapped"]),
                    "adam_overlapped": s2["adam_seconds_overlapped"] - s0["adam_seconds_overlapped"],
                }
                stalled_fb = min(row["stalled_fwd_bwd"], row["fwd_bwd"])
                stalled_st = min(row["stalled_step"], row["optimizer_step"])
                adam = min(row["adam_step"], row["optimizer_step"] - stalled_st)
                row["breakdown"] = {"compute": row["fwd_bwd"] - stalled_fb, "adam": adam,
                                    "stalled": stalled_fb + stalled_st,
                                    "io": row["optimizer_step"] - stalled_st - adam}
                rows.append(row)
                print(f"{i + 1:5d} {row['seconds']:8.2f} {row['fwd_bwd']:8.2f} {row['optimizer_step']:8.2f} "
                      f"{row['loss']:8.4f} {row['bytes_read'] / 1e9:8.2f} {row['bytes_written'] / 1e9:9.2f} "
                      f"{row['breakdown']['stalled']:8.2f} {row['breakdown']['adam']:7.2f}"
                      f"{'  (warm-up)' if row['warmup'] else ''}", flush=True)
            stats, report = engine.stats(), engine.memory_report()
        finally:
            engine.close()
        disk.append(probe(work, aio, probe_bytes))
        print(f"\ndisk after training: write {disk[1][0]:.2f} GB/s, read {disk[1][1]:.2f} GB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    measured = [r for r in rows if not r["warmup"]]
    med = {k: statistics.median(r[k] for r in measured)
           for k in ("seconds", "fwd_bwd", "optimizer_step", "bytes_read", "bytes_written")}
    write_bw, read_bw = max(w for w, _ in disk), max(r for _, r in disk)
    floor = med["bytes_read"] / (read_bw * 1e9) + med["bytes_written"] / (write_bw * 1e9)
    summary = {
        "step_seconds": med["seconds"], "floor_seconds": floor, "step_over_floor": med["seconds"] / floor,
        "read_gbps": read_bw, "write_gbps": write_bw,
        "bytes_read_per_step": med["bytes_read"], "bytes_written_per_step": med["bytes_written"],
        "read_bytes_per_param": med["bytes_read"] / n, "written_bytes_per_param": med["bytes_written"] / n,
        "breakdown": {k: statistics.median(r["breakdown"][k] for r in measured)
                      for k in ("compute", "adam", "stalled", "io")},
        "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
    }
    print(f"\nmedians over {len(measured)} steps: step {med['seconds']:.2f} s; read {med['bytes_read'] / 1e9:.2f} GB "
          f"({summary['read_bytes_per_param']:.1f} B/param), written {med['bytes_written'] / 1e9:.2f} GB "
          f"({summary['written_bytes_per_param']:.1f} B/param)")
    print(f"disk (best of the probes): read {read_bw:.2f} GB/s, write {write_bw:.2f} GB/s")
    print(f"floor = read / read bw + written / write bw = {floor:.2f} s;  step / floor = "
          f"{summary['step_over_floor']:.2f}")
    b = summary["breakdown"]
    print(f"where a step went: compute {b['compute']:.2f} s, Adam {b['adam']:.2f} s, stalled {b['stalled']:.2f} s, "
          f"i/o {b['io']:.2f} s  (Adam overlapped with backward: "
          f"{statistics.median(r['adam_overlapped'] for r in measured):.2f} s)")
    print(f"loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": {"layers": layers, "width": width, "vocab": args.vocab, "params": n, "tokens": args.tokens,
                  "batch": args.batch},
        "config": config, "init_seconds": init_s, "build": build,
        "peak_rss": max(peak_before_build, peak_rss()),
        "plan": {k: v for k, v in plan.__dict__.items() if k != "plan"},
        "disk_probes": [{"write_gbps": w, "read_gbps": r} for w, r in disk], "probe_bytes": probe_bytes,
        "steps": rows, "summary": summary, "engine_stats": stats, "memory_report": report,
    }, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
