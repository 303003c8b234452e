"""Benchmark: the fused CPU Adam kernel against torch's CPU AdamW and against raw memory bandwidth.

The update is memory-bound, so the yardstick is in-place streaming (``a *= s``, one read and one write per element)
over the same buffers the update uses: the kernel should reach at least 90% of that, beat
``torch.optim.AdamW(fused=True)``, and write a bf16 copy of the new parameters for much less than a separate
``copy_`` costs. The gradient norm clipping needs before an update (``squared_norm``, one read of bf16 gradients)
is timed beside torch's ``vector_norm(dtype=torch.float32)``, which first widens them into an fp32 copy, and both
are compared with a float64 sum. Every variant runs on the same memory, one call each in round-robin order for
several rounds (the first round is a warm-up), and the median is reported: the host is shared, so single samples
are noisy.

    python bench/cpu_adam.py [--params 100000000] [--repeats 7] [--threads 1,2] [--out results/cpu_adam.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import count, exit_on_sigterm, listed, out_help  # noqa: E402
from nvme_swapper import aligned_tensor  # noqa: E402
from offload.ops import adam_step, cpu_adam_backend, host_stream_buffer, squared_norm  # noqa: E402
from offload._progress import progress  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BYTES_PLAIN = 28  # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq (fp32)
BYTES_COPY = 30  # ... and write a bf16 copy of the parameter
TARGETS = {
    "ours_vs_fused_speedup": (">=", 1.0),
    "ours_over_streaming": (">=", 0.9),
    "fused_copy_over_ours_copy": (">=", 1.2),
    "in_pass_copy_overhead": ("<=", 0.12),
}


class Buffers:
    """param, grad, exp_avg, exp_avg_sq for one memory layout."""

    def __init__(self, make: Callable[[int], torch.Tensor], n: int) -> None:
        self.param, self.grad, self.exp_avg, self.exp_avg_sq = (make(slot) for slot in range(4))
        gen = torch.Generator().manual_seed(0)
        self.param.copy_(torch.randn(n, generator=gen))
        self.grad.copy_(torch.randn(n, generator=gen))
        self.step = 0

    def ours(self, out: torch.Tensor | None = None) -> None:
        self.step += 1
        adam_step(self.param, self.grad, self.exp_avg, self.exp_avg_sq, step=self.step, out=out, **HP)


def torch_adamw(buffers: Buffers, **kwargs: bool) -> torch.optim.Optimizer:
    """torch.optim.AdamW on the same memory: its parameter, gradient and (after one step) state are our buffers."""
    param = torch.nn.Parameter(buffers.param)
    param.grad = buffers.grad
    opt = torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **kwargs)  # fmt: skip
    opt.step()
    opt.state[param]["exp_avg"] = buffers.exp_avg
    opt.state[param]["exp_avg_sq"] = buffers.exp_avg_sq
    return opt


def run(n: int, threads: list[int], repeats: int) -> dict:
    print(f"allocating buffers for {n:,} parameters ...", flush=True)
    staggered = Buffers(lambda slot: host_stream_buffer(n, slot=slot), n)
    same_offset = Buffers(lambda slot: aligned_tensor(n, torch.float32), n)
    plain = Buffers(lambda slot: torch.zeros(n), n)
    out = host_stream_buffer(n, torch.bfloat16, slot=4)
    fused = torch_adamw(staggered, fused=True)
    foreach = torch_adamw(staggered, foreach=True)
    fused_param = fused.param_groups[0]["params"][0]
    grads_bf16 = staggered.grad.to(torch.bfloat16)
    exact = sum(c.double().square().sum().item() for c in grads_bf16.split(1 << 24))
    norm_error = {"ours": abs(squared_norm(grads_bf16) - exact) / exact,
                  "torch": abs(torch.linalg.vector_norm(grads_bf16, dtype=torch.float32).item() ** 2 - exact) / exact}

    def stream() -> None:
        for t in (staggered.param, staggered.grad, staggered.exp_avg, staggered.exp_avg_sq):
            t.mul_(1.0000001)

    def fused_then_copy() -> None:
        fused.step()
        out.copy_(fused_param.detach())

    variants: dict[str, tuple[Callable[[], None], float]] = {
        "streaming a *= s": (stream, 0.0),
        "ours": (staggered.ours, BYTES_PLAIN),
        "ours + bf16 copy in-pass": (lambda: staggered.ours(out), BYTES_COPY),
        "torch AdamW fused": (fused.step, BYTES_PLAIN),
        "torch AdamW foreach": (foreach.step, BYTES_PLAIN),
        "torch AdamW fused + copy_ to bf16": (fused_then_copy, BYTES_COPY),
        "ours, huge pages, same page offset": (same_offset.ours, BYTES_PLAIN),
        "ours, plain torch.zeros buffers": (plain.ours, BYTES_PLAIN),
        "grad norm (bf16), ours": (lambda: squared_norm(grads_bf16), 2),
        "grad norm (bf16), torch vector_norm": (lambda: torch.linalg.vector_norm(grads_bf16, dtype=torch.float32), 2),
    }
    results: dict = {}
    for nthreads in progress(threads, "thread counts"):
        torch.set_num_threads(nthreads)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(repeats + 1):
            for name, (fn, _) in variants.items():
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                if round_:  # round 0 warms caches, page tables and the thread pool
                    samples[name].append(elapsed * 1e3)
        rows = {}
        for name, (_, bytes_per_param) in variants.items():
            ms = statistics.median(samples[name])
            moved = 4 * n * 8 if bytes_per_param == 0 else n * bytes_per_param
            rows[name] = {
                "ms": ms,
                "params_per_s": n / ms * 1e3 if bytes_per_param else None,
                "gb_per_s": moved / ms / 1e6,
                "samples_ms": samples[name],
            }
        ratios = {
            "ours_vs_fused_speedup": rows["torch AdamW fused"]["ms"] / rows["ours"]["ms"],
            "ours_over_streaming": rows["ours"]["gb_per_s"] / rows["streaming a *= s"]["gb_per_s"],
            "fused_copy_over_ours_copy": rows["torch AdamW fused + copy_ to bf16"]["ms"]
            / rows["ours + bf16 copy in-pass"]["ms"],
            "in_pass_copy_overhead": rows["ours + bf16 copy in-pass"]["ms"] / rows["ours"]["ms"] - 1,
            "same_offset_huge_over_staggered_ms": rows["ours, huge pages, same page offset"]["ms"] / rows["ours"]["ms"],
            "plain_over_staggered_ms": rows["ours, plain torch.zeros buffers"]["ms"] / rows["ours"]["ms"],
            "torch_norm_over_ours_ms": rows["grad norm (bf16), torch vector_norm"]["ms"]
            / rows["grad norm (bf16), ours"]["ms"],
            "norm_squares_rel_error_ours": norm_error["ours"],
            "norm_squares_rel_error_torch": norm_error["torch"],
        }
        met = {
            key: (ratios[key] >= bound if op == ">=" else ratios[key] <= bound) for key, (op, bound) in TARGETS.items()
        }
        results[str(nthreads)] = {"rows": rows, "ratios": ratios, "targets_met": met}
        print_table(n, nthreads, rows, ratios, met)
    return results


def print_table(n: int, nthreads: int, rows: dict, ratios: dict, met: dict) -> None:
    print(f"\n{n:,} parameters, {nthreads} thread(s); median of the rounds")
    print(f"{'variant':38s} {'ms/step':>9s} {'Mparam/s':>9s} {'GB/s':>7s}")
    for name, row in rows.items():
        rate = "" if row["params_per_s"] is None else f"{row['params_per_s'] / 1e6:9.0f}"
        print(f"{name:38s} {row['ms']:9.1f} {rate:>9s} {row['gb_per_s']:7.1f}")
    for key, value in ratios.items():
        target = ""
        if key in TARGETS:
            op, bound = TARGETS[key]
            target = f"  (target {op} {bound}: {'met' if met[key] else 'MISSED'})"
        print(f"  {key:36s} {value:8.4g}{target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=count(1), default=100_000_000, help="parameters per update (default 1e8)")
    parser.add_argument("--repeats", type=count(1), default=7,
                        help="timed rounds after one warm-up round (default 7)")
    parser.add_argument("--threads", type=listed(count(1)), default="1,2",
                        help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--out", type=Path, default=Path("results/cpu_adam.json"), help=out_help("cpu_adam"))
    args = parser.parse_args()
    backend = cpu_adam_backend()
    print(f"CPU Adam backend: {backend}; torch {torch.__version__}")
    results = run(args.params, args.threads, args.repeats)
    report = {
        "params": args.params,
        "repeats": args.repeats,
        "backend": backend,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "hyperparameters": HP,
        "targets": {k: {"op": op, "value": v} for k, (op, v) in TARGETS.items()},
        "threads": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
