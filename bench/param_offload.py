"""Forward + backward with parameters homed on NVMe, beside the same model without offload and the parameter
reads alone, in the same run.

  offload   the engine with offload_param on NVMe (bf16): each step fetches, through the prefetching window, every
            parameter it does not find there, in forward and again in backward: up to twice the parameters' bytes,
            less as the window keeps some from the step before and from forward to backward (none when it holds
            the model); optimizer state on the host (its step is not timed)
  plain     the same model in bf16, all parameters in memory: compute alone
  reads     the bytes the offloaded forward+backward read the last time it ran (its swap engine's counter; the
            count varies a few % from step to step), read from the same swap engine: parameter keys in forward
            order, each pass over them all in flight, as many passes as those bytes take: the disk's share alone

Target: offload <= 1.2 x max(plain, reads). Rounds interleave the three; medians. The JSON records the bytes every
offloaded step and every reads-alone run read.

``--decode N`` adds a generation loop (N greedy tokens from an 8-token prompt, one forward of the whole sequence
per token, under no_grad) run two ways: through the window, which fetches the model from NVMe once per token, and
inside ``engine.gathered()``, which fetches it once (a forward-only use: DPO references, RL rollouts).

    python bench/param_offload.py [--layers 8] [--width 1024] [--tokens 64] [--live 6e7] [--bucket 6e7] [--rounds 5]
                                  [--decode 0] [--nvme-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
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
from _common import check_live, count, exit_on_sigterm, gpt_heads, largest_fetched, out_help  # noqa: E402

import offload  # noqa: E402
from nvme_swapper import aligned_tensor  # noqa: E402
from offload.models import GPT, GPTConfig  # noqa: E402
from offload._progress import progress  # noqa: E402


PERSISTENCE = 100_000  # stage3_param_persistence_threshold: smaller parameters stay on the device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=count(1), default=8)
    ap.add_argument("--width", type=count(1), default=1024)
    ap.add_argument("--vocab", type=count(1), default=8192)
    ap.add_argument("--tokens", type=count(1), default=64, help="tokens per step (batch 1)")
    ap.add_argument("--live", type=count(1), default=6 * 10**7,
                    help="stage3_max_live_parameters: the window, in elements (default 6e7)")
    ap.add_argument("--bucket", type=count(1), default=None,
                    help="stage3_prefetch_bucket_size: elements in flight (default: --live, the whole window)")
    ap.add_argument("--rounds", type=count(1), default=5)
    ap.add_argument("--decode", type=count(0), default=0, help="tokens of the generation loop (0: none)")
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--out", default="results/param_offload.json", help=out_help("param_offload"))
    args = ap.parse_args()

    cfg = GPTConfig(vocab_size=args.vocab, context=max(args.tokens, 8 + args.decode, 64), layers=args.layers,
                    heads=gpt_heads(ap, args.width), width=args.width)
    torch.manual_seed(0)
    model = GPT(cfg)
    largest = largest_fetched(model, PERSISTENCE)
    if not largest:
        ap.error(f"--width {args.width} and --vocab {args.vocab}: no parameter of this GPT has more than "
                 f"{PERSISTENCE} elements, so all stay on the device and none is offloaded; raise them")
    check_live(ap, args.live, largest)
    nvme = Path(tempfile.mkdtemp(prefix="bench-params-", dir=args.nvme_dir or Path.cwd()))
    x = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    y = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    samples: dict[str, list[float]] = {"offload": [], "plain": [], "reads": []}
    step_bytes: list[int] = []  # read by each measured offloaded forward+backward
    reads_bytes: list[int] = []  # by each reads-alone run: whole keys, from the offloaded step's last count
    try:
        plain = GPT(cfg).to(torch.bfloat16)
        engine = offload.initialize(model, {
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3, "sub_group_size": 50_000_000,
                "offload_optimizer": {"device": "cpu", "overlap_step": False},
                "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                "stage3_max_live_parameters": args.live,
                "stage3_prefetch_bucket_size": args.bucket or args.live,
                "stage3_param_persistence_threshold": PERSISTENCE},
            "aio": {"block_size": 1 << 20, "queue_depth": 8}})
        po = engine.weights.params
        managed = [r for r in po.params if not r.persistent]
        param_bytes = sum(r.numel for r in managed) * 2
        bufs = [aligned_tensor(r.numel, torch.bfloat16, pin_memory=False) for r in managed]
        parts = [(po.homes.key(r, start), b[start : start + n]) for r, b in zip(managed, bufs) for start, n in r.parts]

        def bytes_read() -> int:
            return po.stats()["nvme"]["bytes_read"]

        def offloaded() -> int:
            """One forward+backward; the bytes it read from the parameters' homes."""
            before = bytes_read()
            loss = GPT.loss(engine(x), y)
            engine.backward(loss)
            return bytes_read() - before

        def baseline() -> None:
            GPT.loss(plain(x), y).backward()
            plain.zero_grad(set_to_none=True)

        def read_passes(nbytes: int) -> tuple[list[list[tuple[str, torch.Tensor]]], int]:
            """Passes over the parts in forward order, each part once a pass, until ``nbytes`` are read; the bytes
            they read (whole keys: up to one key more)."""
            out, left = [], nbytes
            while left > 0 and parts:
                out.append([])
                for key, buf in parts:
                    if left <= 0:
                        break
                    out[-1].append((key, buf))
                    left -= buf.numel() * buf.element_size()
            return out, sum(buf.numel() * buf.element_size() for one in out for _, buf in one)

        def reads() -> int:
            for one in passes:
                for h in [po.homes.space.read(key, buf) for key, buf in one]:
                    h.wait()
            return passes_bytes

        for _ in range(2):  # warm-up: traces recorded, kernels built; the second step reads about what later ones do
            warm_bytes = offloaded()
            engine.step()
            baseline()
        passes, passes_bytes = read_passes(warm_bytes)
        runs = {"offload": offloaded, "plain": baseline, "reads": reads}
        po.reset_counters()
        for r in progress(range(args.rounds), "rounds"):
            for name in random.Random(r).sample(list(runs), 3):
                t = time.perf_counter()
                got = runs[name]()
                samples[name].append(time.perf_counter() - t)
                if name == "offload":
                    step_bytes.append(got)
                    passes, passes_bytes = read_passes(got)
                    engine.step()  # untimed: new parameters go back to their NVMe homes, as in training
                elif name == "reads":
                    reads_bytes.append(got)
        pstats = po.stats()
        decode = {"window": [], "gathered": []}

        def generate(gathered: bool) -> torch.Tensor:
            ids = x[:, :8]
            with torch.no_grad(), engine.gathered() if gathered else contextlib.nullcontext():
                for _ in range(args.decode):
                    ids = torch.cat([ids, engine(ids)[:, -1].argmax(-1, keepdim=True).to(ids.device)], 1)
            return ids

        for r in progress(range(args.rounds if args.decode else 0), "decode rounds"):
            made = {}
            for name in random.Random(r).sample(list(decode), 2):
                t = time.perf_counter()
                made[name] = generate(name == "gathered")
                decode[name].append(time.perf_counter() - t)
            assert torch.equal(made["window"], made["gathered"]), "the two generation loops disagree"
        engine.close()
    finally:
        shutil.rmtree(nvme, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    bound = max(med["plain"], med["reads"])
    per_step, read_alone = int(statistics.median(step_bytes)), int(statistics.median(reads_bytes))
    print(f"\nparam offload bench: GPT {cfg.layers}x{cfg.width}, {cfg.num_parameters / 1e6:.0f}M parameters, "
          f"{param_bytes / 1e6:.0f} MB of bf16 parameters on NVMe, of which forward+backward read "
          f"{per_step / 1e6:.0f} MB a step ({per_step / param_bytes:.2f}x; window {args.live:.3g} elements), "
          f"{args.tokens} tokens, {args.rounds} rounds, medians, torch threads {torch.get_num_threads()}\n")
    print(f"{'measurement':12s} {'seconds':>8s}")
    for k, v in med.items():
        print(f"{k:12s} {v:8.3f}")
    if read_alone:
        print(f"\n  reads alone: {read_alone / 1e6:.0f} MB (what the offloaded step read before them, "
              f"{min(step_bytes) / 1e6:.1f}-{max(step_bytes) / 1e6:.1f} MB a step) at "
              f"{read_alone / med['reads'] / 1e9:.2f} GB/s")
    else:
        print("\n  reads alone: nothing to read (the window keeps every parameter from step to step)")
    print(f"  offload / max(plain, reads) = {med['offload'] / bound:.3f}  (target <= 1.2)")
    print(f"  prefetch: {pstats['hit_rate']:.3f} of fetches resident or in flight, "
          f"{pstats['trace_invalidations']} trace invalidations")
    decoded = {k: statistics.median(v) for k, v in decode.items() if v}
    if decoded:
        print(f"\n{args.decode} greedy tokens, no_grad ({args.rounds} rounds, medians)")
        print(f"{'generation':12s} {'seconds':>8s}")
        for k, v in decoded.items():
            print(f"{k:12s} {v:8.3f}")
        print(f"  window / gathered = {decoded['window'] / decoded['gathered']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": cfg.__dict__, "param_bytes": param_bytes, "live": args.live,
                               "bytes_read_per_step": per_step, "bytes_read_per_step_samples": step_bytes,
                               "bytes_read_warmup": warm_bytes, "reads_bytes": read_alone,
                               "reads_bytes_samples": reads_bytes, "samples": samples,
                               "medians": med, "ratio": med["offload"] / bound, "prefetch": pstats,
                               "decode": {"tokens": args.decode, "samples": decode, "medians": decoded}}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
