"""What the swap engine's block checksums cost: read and write GB/s with AioConfig(checksum=True) and False.

Workload: ``--tensors`` page-aligned tensors of ``--mib`` MiB each, all written and then all read back (O_DIRECT,
kernel AIO where available), issued at once so the queue stays full. The two settings alternate within every
round, in a shuffled order, because this disk is shared and noisy; the table reports medians over rounds and the
ratio checksum-on / checksum-off (1.00 = free). Also reported: the checksum alone on one core (GB/s), and
zlib.crc32 for comparison, on the same data.

    python bench/checksum.py [--dir DIR] [--rounds 7] [--tensors 16] [--mib 64] [--out results/checksum.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _common import byte_count, check_aio, count, exit_on_sigterm  # noqa: E402

from nvme_swapper import AioConfig, SwapEngine, aligned_tensor  # noqa: E402
from nvme_swapper._native import checksum, checksum_isa, checksum_kind, memory_at  # noqa: E402


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def one_pass(directory: Path, tensors: list[torch.Tensor], outs: list[torch.Tensor], cfg: AioConfig
             ) -> tuple[float, float]:
    """Write GB/s and read GB/s of one engine over all tensors (space reserved first: writes are overwrites)."""
    total = sum(t.numel() for t in tensors)
    with SwapEngine(directory, cfg) as engine:
        engine.reserve(total)
        t0 = time.perf_counter()
        for h in [engine.write(f"t{i}", t) for i, t in enumerate(tensors)]:
            h.wait()
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        for h in [engine.read(f"t{i}", o) for i, o in enumerate(outs)]:
            h.wait()
        read = time.perf_counter() - t0
    for t, o in zip(tensors, outs):
        assert torch.equal(t, o)
    return gbps(total, write), gbps(total, read)


def hash_rate(t: torch.Tensor, block: int) -> tuple[float, float]:
    """GB/s of the engine's checksum and of zlib.crc32 over ``t`` in ``block``-byte blocks, one core."""
    n = t.numel()
    t0 = time.perf_counter()
    for o in range(0, n, block):
        checksum(t.data_ptr() + o, min(block, n - o))
    ours = gbps(n, time.perf_counter() - t0)
    view = memory_at(t.data_ptr(), n)
    t0 = time.perf_counter()
    for o in range(0, n, block):
        zlib.crc32(view[o : o + block])
    return ours, gbps(n, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--rounds", type=count(1), default=7)
    ap.add_argument("--tensors", type=count(1), default=16)
    ap.add_argument("--mib", type=count(1), default=64)
    ap.add_argument("--block-size", type=byte_count, default=1 << 20)
    ap.add_argument("--queue-depth", type=count(1), default=8)
    ap.add_argument("--threads", type=count(1), default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    check_aio(ap, "--block-size/--queue-depth/--threads", block_size=args.block_size, queue_depth=args.queue_depth,
              thread_count=args.threads)

    nbytes = args.mib << 20
    g = torch.Generator().manual_seed(0)
    tensors = [aligned_tensor(nbytes, torch.uint8, pin_memory=False) for _ in range(args.tensors)]
    for t in tensors:
        t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    outs = [aligned_tensor(nbytes, torch.uint8, pin_memory=False) for _ in range(args.tensors)]
    configs = {on: AioConfig(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads,
                             checksum=on) for on in (False, True)}
    samples: dict[bool, dict[str, list[float]]] = {on: {"write": [], "read": []} for on in configs}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-checksum-") as tmp:
        one_pass(Path(tmp), tensors[:2], outs[:2], configs[True])  # warm-up: build the helper, touch the disk
        for _ in range(args.rounds):
            order = list(configs)
            rng.shuffle(order)
            for on in order:
                w, r = one_pass(Path(tmp), tensors, outs, configs[on])
                samples[on]["write"].append(w)
                samples[on]["read"].append(r)
        with SwapEngine(Path(tmp), configs[True]) as probe:
            backend, direct = probe.backend, probe.stats()["o_direct"]
    ours, crc = hash_rate(tensors[0], args.block_size)

    med = {on: {op: statistics.median(v) for op, v in s.items()} for on, s in samples.items()}
    ratio = {op: med[True][op] / med[False][op] for op in ("write", "read")}
    result = {
        "checksum": checksum_kind(), "isa": checksum_isa(), "backend": backend, "o_direct": direct,
        "rounds": args.rounds,
        "bytes_per_pass": args.tensors * nbytes, "block_size": args.block_size, "queue_depth": args.queue_depth,
        "thread_count": args.threads, "gbps_median": {"off": med[False], "on": med[True]},
        "ratio_on_over_off": ratio, "samples": {"off": samples[False], "on": samples[True]},
        "hash_gbps_one_core": {checksum_kind(): ours, "zlib.crc32": crc},
    }
    print(f"{args.tensors} x {args.mib} MiB, block {args.block_size >> 10} KiB, depth {args.queue_depth}, "
          f"{args.threads} thread(s), backend {backend}, O_DIRECT {direct}, medians of {args.rounds} rounds")
    print(f"{'':10}{'checksum off':>14}{'checksum on':>14}{'on/off':>9}")
    for op in ("write", "read"):
        print(f"{op + ' GB/s':10}{med[False][op]:14.2f}{med[True][op]:14.2f}{ratio[op]:9.3f}")
    print(f"checksum alone, one core: {checksum_kind()} ({checksum_isa()}) {ours:.1f} GB/s; "
          f"zlib.crc32 {crc:.1f} GB/s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
