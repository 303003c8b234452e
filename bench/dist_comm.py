"""Bytes communicated per optimizer step per rank, ZeRO stages 1, 2 and 3, against the ZeRO paper's figures.

The paper (Rajbhandari et al., 2020, section 7) counts, per rank and step, in parameters Psi: stages 1 and 2 move
2 Psi (a reduce-scatter of the gradients and an all-gather of the parameters; the same as plain data parallelism),
stage 3 moves 3 Psi (parameters all-gathered in forward and again in backward, gradients reduce-scattered). This
runs N gloo ranks of this machine (it launches itself N times with torchrun's environment variables, or runs
under torchrun), trains a bf16 GPT a few steps per stage, and reads ``engine.stats()["comm"]["last_step"]``:
payload (the size of the buffers the collectives are about: the paper's measure) and ring wire bytes (what each
rank sends with ring collectives: (N-1)/N of it).

    python bench/dist_comm.py [--ranks 2] [--layers 4] [--width 256] [--steps 3] [--out results/dist_comm.json]
    torchrun --nproc-per-node 2 bench/dist_comm.py --worker ...
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

PAPER = {1: 2.0, 2: 2.0, 3: 3.0}


def config(stage: int, width: int) -> dict:
    zero = {"stage": stage, "sub_group_size": 1 << 20,
            "offload_optimizer": {"device": "cpu"}}
    if stage == 3:  # every parameter partitioned; a window too small to keep forward's parameters for backward
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0,
                    stage3_max_live_parameters=8 * width * width, stage3_prefetch_bucket_size=4 * width * width)
    return {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": zero, "offload": {"comm_timeout": 60}}


def worker(args: argparse.Namespace) -> None:
    import offload
    from offload.models import GPT, GPTConfig

    rank = int(os.environ.get("RANK", "0"))
    rows = []
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=512, context=64, layers=args.layers, heads=max(1, args.width // 64),
                        width=args.width)
        model = GPT(cfg)
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(rank))
        with offload.initialize(model, config(stage, args.width)) as engine:
            for _ in range(args.steps):
                engine.backward(GPT.loss(engine(x), x))
                engine.step()
            last = engine.stats()["comm"]["last_step"]
            world = engine.world_size
        size = 2  # bf16: parameters and gradients move in the training dtype
        rows.append({"stage": stage, "ranks": world, "psi": psi, "payload_bytes": last["payload_bytes"],
                     "wire_bytes": last["wire_bytes"], "payload_psi": last["payload_bytes"] / (psi * size),
                     "wire_psi": last["wire_bytes"] / (psi * size), "paper_psi": PAPER[stage]})
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"bench": "dist_comm", "rows": rows}, indent=1))
        print(f"{'stage':>5} {'ranks':>5} {'params (Psi)':>12} {'payload/step':>13} {'x Psi':>6} {'paper':>6} "
              f"{'wire/step':>11} {'x Psi':>6}")
        for r in rows:
            print(f"{r['stage']:>5} {r['ranks']:>5} {r['psi']:>12,} {r['payload_bytes'] / 1e6:>10.2f} MB "
                  f"{r['payload_psi']:>6.2f} {r['paper_psi']:>6.1f} {r['wire_bytes'] / 1e6:>8.2f} MB "
                  f"{r['wire_psi']:>6.2f}")
        print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="results/dist_comm.json")
    ap.add_argument("--worker", action="store_true", help="be one rank (set by the launcher, or use torchrun)")
    args = ap.parse_args()
    if args.worker or "RANK" in os.environ:
        worker(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(args.ranks):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--ranks", str(args.ranks), "--layers",
                                       str(args.layers), "--width", str(args.width), "--steps", str(args.steps),
                                       "--out", args.out], env=env))
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
