"""Forward + backward with parameters homed on NVMe, beside the same model without offload and the parameter
reads alone, in the same run.

  offload   the engine with offload_param on NVMe (bf16): each step fetches every parameter twice (forward,
            backward) through the prefetching window; optimizer state on the host (its step is not timed)
  plain     the same model in bf16, all parameters in memory: compute alone
  reads     every parameter's key read twice from the same swap engine, all in flight: the disk's share alone

Target: offload <= 1.2 x max(plain, reads). Rounds interleave the three; medians.

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
from _common import exit_on_sigterm, out_help  # noqa: E402

import offload  # noqa: E402
from nvme_swapper import aligned_tensor  # noqa: E402
from offload.models import GPT, GPTConfig  # noqa: E402
from offload._progress import progress  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per step (batch 1)")
    ap.add_argument("--live", type=float, default=6e7, help="stage3_max_live_parameters")
    ap.add_argument("--bucket", type=float, default=None,
                    help="stage3_prefetch_bucket_size: elements in flight (default: --live, the whole window)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode", type=int, default=0, help="tokens of the generation loop (0: none)")
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--out", default="results/param_offload.json", help=out_help("param_offload"))
    args = ap.parse_args()

    cfg = GPTConfig(vocab_size=args.vocab, context=max(args.tokens, 8 + args.decode, 64), layers=args.layers,
                    heads=max(1, args.width // 64), width=args.width)
    nvme = Path(tempfile.mkdtemp(prefix="bench-params-", dir=args.nvme_dir or Path.cwd()))
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    y = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    samples: dict[str, list[float]] = {"offload": [], "plain": [], "reads": []}
    try:
        plain = GPT(cfg).to(torch.bfloat16)
        model = GPT(cfg)
        engine = offload.initialize(model, {
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3, "sub_group_size": 50_000_000,
                "offload_optimizer": {"device": "cpu", "overlap_step": False},
                "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                "stage3_max_live_parameters": int(args.live),
                "stage3_prefetch_bucket_size": int(args.bucket or args.live),
                "stage3_param_persistence_threshold": 100_000},
            "aio": {"block_size": 1 << 20, "queue_depth": 8}})
        po = engine.weights.params
        managed = [r for r in po.params if not r.persistent]
        param_bytes = sum(r.numel for r in managed) * 2
        bufs = [aligned_tensor(r.numel, torch.bfloat16, pin_memory=False) for r in managed]

        def offloaded() -> None:
            loss = GPT.loss(engine(x), y)
            engine.backward(loss)

        def baseline() -> None:
            GPT.loss(plain(x), y).backward()
            plain.zero_grad(set_to_none=True)

        def reads() -> None:
            for _ in range(2):
                handles = [po._swap.read(po._key(r, start), b[start : start + n])
                           for r, b in zip(managed, bufs) for start, n in r.parts]
                for h in handles:
                    h.wait()

        runs = {"offload": offloaded, "plain": baseline, "reads": reads}
        for _ in range(2):  # warm-up: traces recorded, kernels built
            offloaded()
            engine.step()
            baseline()
        po.reset_counters()
        for r in progress(range(args.rounds), "rounds"):
            for name in random.Random(r).sample(list(runs), 3):
                t = time.perf_counter()
                runs[name]()
                samples[name].append(time.perf_counter() - t)
                if name == "offload":
                    engine.step()  # untimed: new parameters go back to their NVMe homes, as in training
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
    print(f"\nparam offload bench: GPT {cfg.layers}x{cfg.width}, {cfg.num_parameters / 1e6:.0f}M parameters, "
          f"{param_bytes / 1e6:.0f} MB of bf16 parameters on NVMe (read twice per step), {args.tokens} tokens, "
          f"{args.rounds} rounds, medians, torch threads {torch.get_num_threads()}\n")
    print(f"{'measurement':12s} {'seconds':>8s}")
    for k, v in med.items():
        print(f"{k:12s} {v:8.3f}")
    print(f"\n  reads alone: {2 * param_bytes / med['reads'] / 1e9:.2f} GB/s")
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
    out.write_text(json.dumps({"config": cfg.__dict__, "param_bytes": param_bytes, "samples": samples,
                               "medians": med, "ratio": med["offload"] / bound, "prefetch": pstats,
                               "decode": {"tokens": args.decode, "samples": decode, "medians": decoded}}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    exit_on_sigterm()
    main()
