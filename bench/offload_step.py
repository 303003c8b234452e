"""The offloaded optimizer step, beside each of its parts timed alone in the same run.

NVMe: an engine whose Adam state (12 B/param: fp32 master, exp_avg, exp_avg_sq) lives on NVMe takes optimizer
steps over ``--params`` parameters (bf16 model, bf16 host gradients). Beside it, interleaved in every round:

  read     every sub-group's state read into the staging buffers (the store's prefetching pipeline, no Adam)
  write    every sub-group's state written from the staging buffers
  disk     read and write together, as the step issues them (this disk does not overlap the two: see the note)
  adam     the CPU Adam kernel (with the in-pass bf16 copy) over the same number of parameters, in RAM

HOST: the same step with state in RAM (``--host-params``), beside ``offload.CPUAdam`` over the same parameters.

    python bench/offload_step.py [--params 1e9] [--host-params 2e8] [--rounds 3] [--nvme-dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _common import count, exit_on_sigterm, out_help  # noqa: E402

import offload  # noqa: E402
from nvme_swapper import aligned_tensor  # noqa: E402
from offload.ops import adam_step  # noqa: E402
from offload._progress import progress  # noqa: E402

CHUNK = 50_000_000  # elements per parameter tensor of the synthetic model


class Bag(torch.nn.Module):
    """``n`` trainable parameters in tensors of CHUNK elements: the optimizer step does not care what model."""

    def __init__(self, n: int) -> None:
        super().__init__()
        sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(s).uniform_(-0.02, 0.02)) for s in sizes)


def engine_for(n: int, device: str, nvme: Path, sub_group: int, buffers: int) -> offload.Engine:
    cfg = {"bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"sub_group_size": sub_group,
                                 "offload_optimizer": {"device": device, "nvme_path": str(nvme),
                                                       "buffer_count": buffers,
                                                       "overlap_step": False}},  # whole gradient buffers
           "aio": {"block_size": 4 << 20, "queue_depth": 8, "thread_count": 1}}
    engine = offload.initialize(Bag(n), cfg)
    for g in engine.optimizer.grads.whole:
        g.normal_(0, 1e-3)  # as if backward had streamed them in
    return engine


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def read_all(engine: offload.Engine, write_back: bool = False) -> None:
    """Every sub-group's state through the prefetching pipeline; with ``write_back``, what the step does to the
    disk (read ahead, write back behind) without the Adam in between."""
    opt, store = engine.optimizer, engine.store
    sgs = engine.layout.sub_groups
    for i, sg in enumerate(sgs):
        store.acquire(opt._key(sg))
        for nxt in sgs[i + 1 :]:
            if store.fetch(opt._key(nxt)) is None:
                break
        if write_back:
            store.evict(opt._key(sg))
        else:
            store.release(opt._key(sg))
    store.drain()


def write_all(engine: offload.Engine) -> None:
    opt, store = engine.optimizer, engine.store
    for sg in engine.layout.sub_groups:
        store.stage(opt._key(sg))  # a full buffer with no read: the write alone
        store.evict(opt._key(sg))
    store.drain()


def adam_alone(n: int, sub_group: int):
    block = aligned_tensor(3 * sub_group, torch.float32)
    grad = aligned_tensor(sub_group, torch.bfloat16).normal_(0, 1e-3)
    out = aligned_tensor(sub_group, torch.bfloat16)

    def run() -> None:
        done = 0
        while done < n:
            k = min(sub_group, n - done)
            adam_step(block[:k], grad[:k], block[sub_group : sub_group + k], block[2 * sub_group : 2 * sub_group + k],
                      step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, out=out[:k])
            done += k
    return run


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=count(1), default=10**9, help="parameters of the NVMe engine (default 1e9)")
    ap.add_argument("--host-params", type=count(1), default=2 * 10**8,
                    help="parameters of the HOST engine (default 2e8)")
    ap.add_argument("--sub-group", type=count(1), default=10**8, help="sub_group_size (default 1e8)")
    ap.add_argument("--buffers", type=count(1, 64), default=4, help="offload_optimizer.buffer_count (default 4)")
    ap.add_argument("--rounds", type=count(1), default=3)
    ap.add_argument("--nvme-dir", default=None, help="where the swap files go (default: a temp dir in cwd)")
    ap.add_argument("--quick", action="store_true", help="1e8 / 5e7 parameters, 2 rounds")
    ap.add_argument("--out", default="results/offload_step.json", help=out_help("offload_step"))
    args = ap.parse_args()
    if args.quick:
        args.params, args.host_params, args.sub_group, args.rounds = 10**8, 5 * 10**7, 25 * 10**6, 2
    n, n_host, sub = args.params, args.host_params, args.sub_group
    nvme = Path(tempfile.mkdtemp(prefix="bench-step-", dir=args.nvme_dir or Path.cwd()))
    torch.manual_seed(0)
    results: dict[str, list[float]] = {}
    try:
        free = shutil.disk_usage(nvme).free
        need = 12 * n + args.buffers * 12 * sub
        if need > free * 0.9:
            n = int((free * 0.9 - args.buffers * 12 * sub) / 12 // CHUNK * CHUNK)
            if n < 1:
                sys.exit(f"error: {nvme.parent} has {free / 1e9:.3g} GB free, too little for --params {args.params} "
                         f"(12 B/param of Adam state and {args.buffers} --buffers of --sub-group {sub} parameters); "
                         "pass --nvme-dir on a larger disk")
            print(f"the disk holds less than --params needs: using {n:.3g} parameters", file=sys.stderr)
        engine = engine_for(n, "nvme", nvme, sub, args.buffers)
        adam = adam_alone(n, sub)
        breakdown: dict[str, list[float]] = {"adam": [], "stalled": []}

        def step() -> None:
            """One optimizer step, with the Adam time and the time stalled on reads it contained."""
            before = engine.stats()
            engine.optimizer.step(grad_scale=1.0)
            after = engine.stats()
            breakdown["adam"].append(after["adam_seconds"] - before["adam_seconds"])
            breakdown["stalled"].append(after["stall_seconds"] - before["stall_seconds"])

        parts = {"step": step, "read": lambda: read_all(engine),
                 "write": lambda: write_all(engine), "disk": lambda: read_all(engine, write_back=True), "adam": adam}
        step()  # warm-up: the kernel is built, every extent has been rewritten
        for samples in breakdown.values():
            samples.clear()
        for r in progress(range(args.rounds), "rounds"):
            order = list(parts)
            random.Random(r).shuffle(order)
            for name in order:
                results.setdefault(f"nvme {name}", []).append(timed(parts[name]))
            print(f"nvme round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        nvme_stats = engine.stats()
        engine.close()

        host = engine_for(n_host, "cpu", nvme, sub, args.buffers)
        torch.manual_seed(0)
        plain_params = [torch.nn.Parameter(aligned_tensor(min(CHUNK, n_host - i), torch.float32))
                        for i in range(0, n_host, CHUNK)]
        for p in plain_params:
            p.grad = aligned_tensor(p.numel(), torch.float32).normal_(0, 1e-3)
        cpu_adam = offload.CPUAdam(plain_params, lr=1e-4, weight_decay=0.01)
        cpu_adam.step()
        host.optimizer.step(grad_scale=1.0)
        hparts = {"step": lambda: host.optimizer.step(grad_scale=1.0), "cpuadam": cpu_adam.step}
        for r in range(args.rounds * 2):
            for name in random.Random(r).sample(list(hparts), 2):
                results.setdefault(f"host {name}", []).append(timed(hparts[name]))
        host.close()
    finally:
        shutil.rmtree(nvme, ignore_errors=True)

    med = {k: median(v) for k, v in results.items()}
    state_gb = 12 * n / 1e9
    print(f"\noffload step bench: {n:.3g} params on NVMe ({state_gb:.1f} GB of Adam state), {n_host:.3g} on HOST, "
          f"sub_group_size {sub:.3g}, {args.buffers} buffers, {args.rounds} rounds, medians, "
          f"torch threads {torch.get_num_threads()}\n")
    print(f"{'measurement':16s} {'seconds':>8s} {'GB/s of state':>14s}")
    for k, v in med.items():
        per = (state_gb if k.startswith("nvme") else 12 * n_host / 1e9) / v
        print(f"{k:16s} {v:8.3f} {per:14.2f}")
    largest = max(("read", "write", "adam"), key=lambda part: med[f"nvme {part}"])
    summary = {
        "nvme_step_s": med["nvme step"],
        "largest_part": largest,
        "nvme_step_over_largest_part": med["nvme step"] / med[f"nvme {largest}"],
        "nvme_step_over_disk_read_plus_write": med["nvme step"] / med["nvme disk"],
        "read_plus_write_alone_over_disk": (med["nvme read"] + med["nvme write"]) / med["nvme disk"],
        "host_step_over_cpuadam": med["host step"] / med["host cpuadam"],
    }
    print("\nsummary")
    print(f"  {f'NVMe step / largest part alone ({largest})':40s} {summary['nvme_step_over_largest_part']:.3f}  "
          "(target <= 1.15)")
    print(f"  NVMe step / disk read+write as issued    {summary['nvme_step_over_disk_read_plus_write']:.3f}")
    print(f"  (read alone + write alone) / disk        {summary['read_plus_write_alone_over_disk']:.3f}  "
          "(~1: the disk does not overlap reads and writes)")
    print(f"  HOST step / plain CPUAdam                {summary['host_step_over_cpuadam']:.3f}  (target <= 1.1)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    step_parts = {k: median(v) for k, v in breakdown.items()}
    step_parts["other"] = max(0.0, med["nvme step"] - step_parts["adam"] - step_parts["stalled"])
    print(f"  NVMe step: Adam {step_parts['adam']:.3f} s, stalled on reads {step_parts['stalled']:.3f} s, "
          f"other (write-backs draining, bookkeeping) {step_parts['other']:.3f} s")
    out.write_text(json.dumps({"params_nvme": n, "params_host": n_host, "sub_group_size": sub,
                               "buffer_count": args.buffers, "rounds": args.rounds, "samples": results, "medians": med,
                               "step_breakdown": step_parts, "step_breakdown_samples": breakdown,
                               "summary": summary, "nvme_engine_stats": nvme_stats}, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
