"""Swap-engine throughput against the disk's own limit, measured in the same run.

Workloads: one 2 GiB tensor (--size), and 64 tensors of 1/64 of that in flight at once; block sizes 256 KiB /
1 MiB / 4 MiB and queue depths 1 / 8 / 32 (--blocks, --depths); the engine's kernel-AIO backend ("aio") and the
portable aiofiles backend, both moving bytes only (AioConfig(checksum=False)); and the default configuration users
get, with per-block checksums, at 4 MiB and depths 8 and 32 ("checksummed aio").

The limit: fio (direct=1; libaio and io_uring; queue depths 1 and 8; 1 and 4 MiB blocks; --iomem=shmhuge huge-page
buffers, which need vm.nr_hugepages: set here when run as root, restored after) and a plain single-threaded
O_DIRECT pread/pwrite loop over a huge-page buffer. The limit per direction is the best median of those.

Without fio (--no-fio, not installed, or failing) no limit is measured, and none is reported: the one-request loop
alone is far below what the disk does with several requests in flight (the engine beat it 1.66x on writes). The
engine is compared instead with a "baseline" that keeps requests in flight without the engine's code: the same
O_DIRECT loop run by 1 and by 8 threads (one request each; os.preadv/pwritev release the GIL), with 1 and 4 MiB
requests over huge-page buffers, the best median per direction. The table and the JSON label it "baseline", and the
summary gives the engine against it without judging the limit's target.

Beside the limit, a reference ("tensor-sized pread-loop"): the same loop with 4 MiB requests, but moving the bytes
into and out of the 2 GiB tensor the engine moves, instead of one reused buffer. On this virtual disk, reads land
about 20% faster in a buffer of 8 MiB or less than in anything of 16 MiB or more (fio too: qd 1 x 4 MiB buffers
read faster than qd 8 x 4 MiB), so fio's reads are partly a cache effect that no read into a large tensor can have;
the summary gives the engine against both.

This disk is shared and noisy, so every round runs all probes and all engine configurations in a shuffled order,
and the table reports medians over rounds. Writes are steady-state overwrites for everyone: fio overwrites the file
it laid out, and the engine first reserves (writes) the space its copy-on-write extents will take.

    python bench/nvme_swapper.py [--dir DIR] [--rounds 3] [--quick] [--size 2GiB] [--blocks 256KiB,1MiB,4MiB]
                                 [--depths 1,8,32] [--no-fio] [--out results/nvme_swapper.json]

``--requests 1MiB,4MiB,16MiB,64MiB`` measures instead the knee that sizes the optimizer's sub-groups: throughput
against the size of one request, each request waited alone (the worst case of the optimizer's pipeline, which
moves one sub-group per request), with the configuration training uses by default (AioConfig(): 1 MiB blocks,
queue depth 8, checksums on), --size bytes per measurement, rounds interleaved; the knee is the smallest size
within 10% of the best (score: the harmonic mean of write and read, as a step writes and reads the same bytes).

``python -m offload bench nvme`` runs this script and plots throughput against block size and queue depth from
its JSON (the engine's sweep over --blocks x --depths).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import byte_count, check_aio, count, exit_on_sigterm, listed, out_help  # noqa: E402
from nvme_swapper import AioConfig, SwapEngine, aligned_tensor  # noqa: E402
from nvme_swapper._native import memory_at  # noqa: E402
from nvme_swapper._tune import drop_cache  # noqa: E402
from offload._progress import progress  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def human(nbytes: int) -> str:
    """2GiB, 32MiB, 256KiB: the workload names in the table and the JSON."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


# the limit ---------------------------------------------------------------------------------------------------------


class HugePages:
    """Raises vm.nr_hugepages for fio's shmhuge buffers while the bench runs (root only), then restores it."""

    PATH = Path("/proc/sys/vm/nr_hugepages")

    def __init__(self, pages: int) -> None:
        self.pages, self.saved, self.ok = pages, None, False

    def __enter__(self) -> "HugePages":
        try:
            self.saved = int(self.PATH.read_text())
            if self.saved < self.pages:
                self.PATH.write_text(str(self.pages))
            self.ok = int(self.PATH.read_text()) >= self.pages
        except OSError:
            self.ok = False
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            try:
                self.PATH.write_text(str(self.saved))
            except OSError:
                pass


def fio(path: Path, size: int, rw: str, engine: str, depth: int, shmhuge: bool, block: int = MiB) -> float | None:
    cmd = ["fio", "--name=limit", f"--filename={path}", f"--size={size}", f"--bs={block}", "--direct=1",
           f"--ioengine={engine}", f"--iodepth={depth}", f"--rw={rw}", "--output-format=json", "--numjobs=1",
           "--end_fsync=0", "--invalidate=1"]
    if shmhuge:
        cmd.append("--iomem=shmhuge")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  fio {engine} qd{depth} {rw} failed: {done.stderr.strip()[:200]}", file=sys.stderr)
        return None
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def pread_loop(path: Path, size: int, is_write: bool, buffer, block: int = MiB, depth: int = 1) -> float:
    """The simplest thing that can reach the disk: O_DIRECT requests of ``block`` bytes, ``depth`` of them in flight
    (a thread each, thread i moving blocks i, i + depth, ...), cycling through ``buffer`` (``depth`` blocks long: one
    reused block per thread; ``size`` long: every byte in its own place)."""
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    span = buffer.numel() * buffer.element_size()
    views = [memory_at(buffer.data_ptr() + o, block) for o in range(0, span - block + 1, block)]
    move = os.pwritev if is_write else os.preadv

    def one_thread(first: int) -> None:
        for i in range(first, size // block, depth):
            move(fd, [views[i % len(views)]], i * block)

    try:
        with ThreadPoolExecutor(depth) as pool:
            t = time.perf_counter()
            list(pool.map(one_thread, range(depth)))
            return gbps(size, time.perf_counter() - t)
    finally:
        os.close(fd)


# the engine --------------------------------------------------------------------------------------------------------


def run_engine(directory: Path, backend: str, block: int, depth: int, big, smalls, outs_big, outs_small,
               threads: int, checksum: bool = False) -> dict[str, float]:
    cfg = AioConfig(backend=backend, block_size=block, queue_depth=depth, thread_count=min(threads, depth),
                    checksum=checksum)
    result = {}
    with SwapEngine(directory, cfg) as eng:
        nbig = big.numel() * big.element_size()
        for workload, srcs, outs in ((f"1x{human(nbig)}", [big], [outs_big]),
                                     (f"{len(smalls)}x{human(nbig // len(smalls))}", smalls, outs_small)):
            keys = [f"{workload}-{i}" for i in range(len(srcs))]
            nbytes = sum(s.numel() * s.element_size() for s in srcs)
            eng.reserve(nbytes)  # written space: the timed writes are overwrites, as fio's are
            t = time.perf_counter()
            for h in [eng.write(k, s) for k, s in zip(keys, srcs)]:
                h.wait()
            result[f"{workload} write"] = gbps(nbytes, time.perf_counter() - t)
            drop_cache(eng.directory / "swap.0")  # buffered backends must read from the disk
            t = time.perf_counter()
            for h in [eng.read(k, o) for k, o in zip(keys, outs)]:
                h.wait()
            result[f"{workload} read"] = gbps(nbytes, time.perf_counter() - t)
            for k in keys:
                eng.delete(k)
    return result


def request_sizes(directory: Path, total: int, sizes: list[int], rounds: int, out: Path) -> None:
    """The ``--requests`` mode (see the module docstring)."""
    buf = aligned_tensor(total)
    buf.random_(0, 256)
    samples: dict[str, list[float]] = {}
    with SwapEngine(directory, AioConfig()) as eng:
        eng.reserve(total + max(sizes))
        for r in progress(range(rounds), "rounds"):
            for size in random.Random(r).sample(sizes, len(sizes)):
                chunks = [buf[o : o + size] for o in range(0, total - size + 1, size)]
                moved = len(chunks) * size
                for direction in ("write", "read"):
                    t = time.perf_counter()
                    for i, c in enumerate(chunks):
                        (eng.write if direction == "write" else eng.read)(f"r{size}-{i}", c).wait()
                    samples.setdefault(f"{human(size)} {direction}", []).append(gbps(moved, time.perf_counter() - t))
                for i in range(len(chunks)):
                    eng.delete(f"r{size}-{i}")
    med = {k: statistics.median(v) for k, v in samples.items()}
    score = {s: 2 / (1 / med[f"{human(s)} write"] + 1 / med[f"{human(s)} read"]) for s in sizes}
    best = max(score.values())
    knee = min(s for s in sizes if score[s] >= 0.9 * best)
    print(f"\nrequest size knee: {total / GiB:.3g} GiB per measurement, {rounds} round(s), AioConfig() defaults, "
          f"medians in GB/s, dir {directory}\n")
    print(f"{'request':>10s} {'write':>8s} {'read':>8s} {'score':>8s}")
    for s in sizes:
        print(f"{human(s):>10s} {med[f'{human(s)} write']:8.2f} {med[f'{human(s)} read']:8.2f} {score[s]:8.2f}"
              f"{'  <- knee (within 10% of the best)' if s == knee else ''}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": "requests", "bytes_per_measurement": total, "rounds": rounds,
                               "sizes": sizes, "samples": samples, "medians": med, "score": score,
                               "knee_bytes": knee, "by_size": {  # in the order of ``sizes``, for the plot
                                   "write": [med[f"{human(s)} write"] for s in sizes],
                                   "read": [med[f"{human(s)} read"] for s in sizes],
                                   "score": [score[s] for s in sizes]}}, indent=2))
    print(f"\nwrote {out}")


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir in cwd)")
    ap.add_argument("--rounds", type=count(1), default=3)
    ap.add_argument("--quick", action="store_true", help="256 MiB instead of 2 GiB, 1 round (a smoke test)")
    ap.add_argument("--threads", type=count(1), default=1, help="engine thread_count (capped at the queue depth)")
    ap.add_argument("--size", type=byte_count, default=None, help="bytes per pass (default 2GiB; 256MiB with --quick); "
                    "a multiple of 4MiB")
    ap.add_argument("--blocks", type=listed(byte_count), default="256KiB,1MiB,4MiB",
                    help="engine block sizes to sweep (comma-separated)")
    ap.add_argument("--depths", type=listed(count(1)), default="1,8,32",
                    help="engine queue depths to sweep (comma-separated)")
    ap.add_argument("--no-fio", action="store_true",
                    help="skip fio: no limit is measured, the engine is compared with the pread/pwrite baseline")
    ap.add_argument("--requests", type=listed(byte_count), default=None,
                    help="request sizes: measure the knee instead (see above)")
    ap.add_argument("--out", default="results/nvme_swapper.json", help=out_help("nvme_swapper"))
    args = ap.parse_args()
    if args.requests:
        sizes = args.requests
        total = args.size if args.size is not None else 512 * MiB
        if any(v < 4 * KiB or v % (4 * KiB) or v > total for v in sizes):
            ap.error(f"--requests must be multiples of 4KiB no larger than --size ({human(total)}), got "
                     f"{', '.join(human(v) for v in sizes)}")
        work = Path(tempfile.mkdtemp(prefix="bench-nvme-", dir=Path(args.dir) if args.dir else Path.cwd()))
        try:
            request_sizes(work, total, sizes, 1 if args.quick else args.rounds, Path(args.out))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return

    total = args.size if args.size is not None else 256 * MiB if args.quick else 2 * GiB
    if total < 4 * MiB or total % (4 * MiB):
        ap.error(f"--size must be a multiple of 4MiB (64 tensors of whole 4 KiB pages, read and written by the "
                 f"limit loops in 4 MiB requests), got {human(total)}")
    rounds = 1 if args.quick else args.rounds
    small_count, small_size = 64, total // 64
    base = Path(args.dir) if args.dir else Path.cwd()
    blocks, depths = args.blocks, args.depths
    check_aio(ap, "--threads", thread_count=args.threads, queue_depth=args.threads)
    for b in blocks:
        check_aio(ap, "--blocks", block_size=b)
    for d in depths:
        check_aio(ap, f"--depths (with --threads {args.threads})", queue_depth=d, thread_count=min(args.threads, d))
    work = Path(tempfile.mkdtemp(prefix="bench-nvme-", dir=base))
    backends = ["aio", "aiofiles"]
    have_fio = shutil.which("fio") is not None and not args.no_fio
    no_limit = None if have_fio else "--no-fio" if args.no_fio else "fio not installed (Debian package 'fio')"

    big, out_big = aligned_tensor(total), aligned_tensor(total)
    big.random_(0, 256)
    smalls = [big[i * small_size:(i + 1) * small_size] for i in range(small_count)]  # page-aligned slices
    outs_small = [out_big[i * small_size:(i + 1) * small_size] for i in range(small_count)]
    probe_buf = aligned_tensor(8 * 4 * MiB)  # huge pages: a block of its own for each thread of the loops
    probe_file = work / "probe.dat"

    samples: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            samples.setdefault(name, []).append(value)

    try:
        with HugePages(128 if have_fio else 0) as huge:  # fio's --iomem=shmhuge only
            if have_fio and fio(probe_file, total, "write", "libaio", 8, False) is None:  # lays the probe file out
                have_fio, no_limit = False, "fio failed (above)"
            if not have_fio:
                with open(probe_file, "wb") as f:
                    f.truncate(total)
                pread_loop(probe_file, total, True, probe_buf)  # every probe write an overwrite
                print(f"no disk limit measured ({no_limit}): the engine is compared with a baseline, the O_DIRECT "
                      "pread/pwrite loop with 1 and 8 requests in flight", file=sys.stderr)
            # with fio, one loop request in flight takes part in the limit; without, 1 or 8 make the baseline
            role = "limit" if have_fio else "baseline"
            loops = [(MiB, 1)] if have_fio else [(bs, d) for bs in (MiB, 4 * MiB) for d in (1, 8)]
            for r in range(rounds):
                items: list[tuple] = [("tensor",)] + [("loop", bs, d) for bs, d in loops]
                if have_fio:
                    items += [("fio", e, d, bs) for e in ("libaio", "io_uring") for d in (1, 8)
                              for bs in (MiB, 4 * MiB)]
                items += [("engine", b, bs, d) for b in backends for bs in blocks for d in depths]
                items += [("checksum", "aio", 4 * MiB, d) for d in (8, 32)]  # what users get by default
                random.Random(r).shuffle(items)
                for item in items:
                    if item[0] == "loop":
                        _, bs, d = item
                        tag, buf = f"{role} pread-loop bs={bs // KiB}K qd={d}", probe_buf[: d * bs]
                        add(f"{tag} write", pread_loop(probe_file, total, True, buf, bs, d))
                        add(f"{tag} read", pread_loop(probe_file, total, False, buf, bs, d))
                    elif item[0] == "tensor":
                        add("tensor-sized pread-loop bs=4096K qd=1 write",
                            pread_loop(probe_file, total, True, big, 4 * MiB))
                        add("tensor-sized pread-loop bs=4096K qd=1 read",
                            pread_loop(probe_file, total, False, out_big, 4 * MiB))
                    elif item[0] == "fio":
                        _, eng_name, d, bs = item
                        tag = f"limit fio {eng_name} bs={bs // KiB}K qd={d}{' shmhuge' if huge.ok else ''}"
                        add(f"{tag} write", fio(probe_file, total, "write", eng_name, d, huge.ok, bs))
                        add(f"{tag} read", fio(probe_file, total, "read", eng_name, d, huge.ok, bs))
                    else:
                        kind, b, bs, d = item
                        res = run_engine(work, b, bs, d, big, smalls, out_big, outs_small, args.threads,
                                         checksum=kind == "checksum")
                        for k, v in res.items():
                            add(f"{'checksummed ' if kind == 'checksum' else ''}{b} bs={bs // KiB}K qd={d} {k}", v)
                print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    if have_fio and not any(k.startswith("limit fio") for k in med):
        no_limit = "fio failed in every probe (above)"  # the one-request loop alone is no limit

    def best(prefix: str, direction: str) -> tuple[str, float]:
        cands = [(k, v) for k, v in med.items() if k.startswith(prefix) and k.endswith(direction)]
        return max(cands, key=lambda kv: kv[1]) if cands else ("-", 0.0)

    limit = {} if no_limit else {d: best("limit", d)[1] for d in ("write", "read")}
    print(f"\nnvme_swapper bench: {total / GiB:.3g} GiB per pass, {rounds} round(s), medians in GB/s, dir {base}\n")
    print(f"{'configuration':44s} {'write':>8s} {'read':>8s}")
    names = sorted({k.rsplit(" ", 1)[0] for k in med})
    for name in names:
        w, r = med.get(f"{name} write"), med.get(f"{name} read")
        print(f"{name:44s} {w if w is not None else float('nan'):8.2f} {r if r is not None else float('nan'):8.2f}")
    summary = {}
    for d in ("write", "read"):
        k_ours, ours = best("aio ", d)  # the kernel-AIO backend's rows ("aiofiles ..." are the baseline's)
        k_base, base_v = best("aiofiles", d)
        _, ref = best("tensor-sized", d)
        k_loop, loop = best("baseline", d)
        summary[d] = {"limit_gbps": limit.get(d), "ours_best": k_ours, "ours_gbps": ours,
                      "ours_vs_limit": ours / limit[d] if limit.get(d) else None,
                      "target_met": ours >= 0.95 * limit[d] if limit.get(d) else None,
                      "baseline_best": None if limit else k_loop, "baseline_gbps": None if limit else loop,
                      "ours_vs_baseline": ours / loop if loop and not limit else None,
                      "tensor_sized_loop_gbps": ref, "ours_vs_tensor_sized_loop": ours / ref if ref else None,
                      "aiofiles_best": k_base, "aiofiles_gbps": base_v,
                      "ours_vs_aiofiles": ours / base_v if base_v else None}
    if limit:
        print("\nsummary (target: ours >= 0.95 x limit, and ours > aiofiles)")
    else:
        print(f"\nsummary (no disk limit measured: {no_limit}; the target ours >= 0.95 x limit is not judged; "
              "ours against the pread/pwrite baseline, and the target ours > aiofiles)")
    for d, s in summary.items():
        against = (f"limit {s['limit_gbps']:.2f}" if limit else f"baseline {s['baseline_gbps']:.2f} "
                   f"({s['baseline_best'].rsplit(' ', 1)[0]})")
        verdict = (f"{ratio(s['ours_vs_limit'])} x limit ({'met' if s['target_met'] else 'MISSED'})" if limit else
                   f"{ratio(s['ours_vs_baseline'])} x baseline (not a limit)")
        print(f"  {d:5s}: {against}  ours {s['ours_gbps']:.2f} ({s['ours_best']}) = {verdict}, "
              f"{ratio(s['ours_vs_aiofiles'])} x aiofiles ({s['aiofiles_gbps']:.2f}), "
              f"{ratio(s['ours_vs_tensor_sized_loop'])} x the tensor-sized loop ({s['tensor_sized_loop_gbps']:.2f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bytes_per_pass": total, "rounds": rounds, "block_sizes": blocks, "queue_depths": depths,
                               "thread_count": args.threads, "samples": samples, "medians": med,
                               "limit": limit, "no_limit_reason": no_limit, "summary": summary,
                               "hugepages_for_fio": huge.ok, "directory": str(base)}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
