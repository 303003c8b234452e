"""Bytes communicated per optimizer step per rank, ZeRO stages 1, 2 and 3, against the ZeRO paper's figures.

The paper (Rajbhandari et al., 2020, section 7) counts, per rank and step, in parameters Psi: stages 1 and 2 move
2 Psi (a reduce-scatter of the gradients and an all-gather of the parameters; the same as plain data parallelism),
stage 3 moves 3 Psi (parameters all-gathered in forward and again in backward, gradients reduce-scattered). This
runs N gloo ranks of this machine (it launches itself N times with torchrun's environment variables, or runs
under torchrun), trains a bf16 GPT a few steps per stage, and reads ``engine.stats()["comm"]["last_step"]``:
payload (the size of the buffers the collectives are about: the paper's measure) and ring wire bytes (what each
rank sends with ring collectives: (N-1)/N of it). Stages 1-2 run twice, with ``overlap_comm`` on and off: the
time backward waits for gradient reduces with it on, against all of it waited for with it off, is the share of
communication hidden behind backward. Per rank: the partition size (equal to within one alignment unit) and the
optimizer's time per step. Last, a 50k-row embedding whose batch touches 5% of its rows, with
``sparse_gradients`` on and off: the gradient bytes each rank sends per step, as rows against dense. And the
start of every run with several ranks (``offload.dist.agree_with_rank0``: tensors hashed, only those that differ
from rank 0's broadcast) on an fp32 model of ``--sync-mb`` MB, built with the same seed on every rank and with a
seed per rank, against broadcasting the whole model (what DDP does at start) in the same run; medians of
``--sync-repeats``.

    python bench/dist_comm.py [--ranks 2] [--layers 4] [--width 256] [--steps 3] [--sync-mb 1024]
                              [--out results/dist_comm.json]
    torchrun --nproc-per-node 2 bench/dist_comm.py --worker ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _common import count, gpt_heads  # noqa: E402

from offload._progress import progress  # noqa: E402

PAPER = {1: 2.0, 2: 2.0, 3: 3.0}


def config(stage: int, width: int, overlap: bool = True) -> dict:
    zero = {"stage": stage, "sub_group_size": 1 << 20, "overlap_comm": overlap, "reduce_bucket_size": 1 << 18,
            "offload_optimizer": {"device": "cpu"}}
    if stage == 3:  # every parameter partitioned; a window too small to keep forward's parameters for backward
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0,
                    stage3_max_live_parameters=8 * width * width, stage3_prefetch_bucket_size=4 * width * width)
    return {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": zero, "offload": {"comm_timeout": 60, "device": "cpu"}}


def worker(args: argparse.Namespace) -> None:
    import offload
    from offload.models import GPT, GPTConfig

    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # the engines join this group (and leave it up): rank 0 gathers every rank's figures over it
        dist.init_process_group("gloo")
    rows = []
    for stage, overlap in progress(((1, True), (1, False), (2, True), (2, False), (3, True)), "configs"):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=512, context=64, layers=args.layers, heads=max(1, args.width // 64),
                        width=args.width)
        model = GPT(cfg)
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(rank))
        with offload.initialize(model, config(stage, args.width, overlap)) as engine:
            backward = 0.0
            for step in range(args.steps + 1):  # the first is a warm-up
                if step == 1:
                    stats0 = engine.stats()
                loss = GPT.loss(engine(x), x)
                t = time.perf_counter()
                engine.backward(loss)
                backward += time.perf_counter() - t if step else 0.0
                engine.step()
            stats = engine.stats()
            last, world = stats["comm"]["last_step"], engine.world_size
            red0, red = stats0["reduce"], stats["reduce"]
            exposed = (red["exposed_seconds"] - red0["exposed_seconds"]) / args.steps if red else None
            adam = (stats["adam_seconds"] - stats0["adam_seconds"]) / args.steps
            owned = sum(sg.numel for sg in engine.layout.sub_groups)
        size = 2  # bf16: parameters and gradients move in the training dtype
        mine = {"stage": stage, "overlap_comm": overlap, "ranks": world, "psi": psi,
                "payload_bytes": last["payload_bytes"], "wire_bytes": last["wire_bytes"],
                "payload_psi": last["payload_bytes"] / (psi * size), "wire_psi": last["wire_bytes"] / (psi * size),
                "paper_psi": PAPER[stage], "backward_seconds": backward / args.steps, "exposed_seconds": exposed,
                "adam_seconds": adam, "owned_numel": owned,
                "peak_buffers": red["peak_buffers"] if red else None}
        rows.append(gather_rows(mine, world))
    sparse = [gather_rows(embedding_run(rank, world, args.steps, sparse), world)[0] for sparse in (True, False)]
    start = start_sync_run(rank, world, args.sync_mb, args.sync_repeats) if world > 1 and args.sync_mb else []
    if rank == 0:
        report(rows, args.out, sparse, start)
    if world > 1:
        dist.destroy_process_group()


class _Embedding(torch.nn.Module):
    """A 50k x 64 embedding and a small head: each rank's batch touches 5% of the rows (2,500 distinct ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, 64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(0, keepdim=True))


ROWS = 50_000


def embedding_run(rank: int, world: int, steps: int, sparse: bool) -> dict:
    """Stage 2 on the embedding model, gradients synced as rows (``sparse_gradients``) or dense: bytes sent per
    step for gradients, counted on this rank."""
    import offload

    torch.manual_seed(0)
    cfg = config(2, 64)
    cfg["sparse_gradients"] = sparse
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(rank))[: ROWS // 20]
    with offload.initialize(_Embedding(), cfg) as engine:
        for step in range(steps + 1):
            if step == 1:
                before = dict(engine.stats()["comm"]["payload_bytes"])
            engine.backward(engine(ids).float().pow(2).mean())
            engine.step()
        after = engine.stats()["comm"]["payload_bytes"]
    grads = sum(after.get(op, 0) - before.get(op, 0) for op in ("reduce", "all_to_all", "all_reduce")) / steps
    return {"sparse": sparse, "ranks": world, "rows": ROWS, "occupancy": 0.05, "grad_bytes_per_step": grads,
            "dense_embedding_bytes": ROWS * 64 * 2}


def start_sync_run(rank: int, world: int, megabytes: int, repeats: int) -> list[dict]:
    """The start's sync on a model of ``megabytes`` (4096-wide fp32 Linears) built from seed 0 on every rank, then
    from seed ``rank``; the baseline broadcasts every tensor from rank 0, whole, on the same model."""
    import torch.distributed as dist

    from offload.dist import Comm, agree_with_rank0, join

    comm = Comm(join(600, "cpu"))
    layers = max(1, round(megabytes * 1e6 / (4 * 4096 * 4097)))
    rows = []
    try:
        for seeded in (False, True):
            synced, whole, report = [], [], None
            for _ in range(repeats):
                torch.manual_seed(rank if seeded else 0)
                model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(layers)])
                comm.barrier()
                t = time.perf_counter()
                report = agree_with_rank0(model, comm)
                comm.barrier()
                synced.append(time.perf_counter() - t)
                t = time.perf_counter()
                for tensor in model.state_dict().values():
                    dist.broadcast(tensor, group_src=0, group=comm.pg.group)
                comm.barrier()
                whole.append(time.perf_counter() - t)
                del model
            assert report is not None
            rows.append({"seed_by_rank": seeded, "ranks": world, "model_bytes": layers * 4096 * 4097 * 4,
                         "copied": report.copied, "tensors": report.tensors, "copied_bytes": report.copied_bytes,
                         "sync_seconds": statistics.median(synced), "broadcast_seconds": statistics.median(whole),
                         "sync_runs": synced, "broadcast_runs": whole})
    finally:
        comm.close()
    return rows


def gather_rows(mine: dict, world: int) -> list[dict]:
    """Every rank's row (rank 0 reports the spread of partition sizes and optimizer time)."""
    import torch.distributed as dist

    if world == 1:
        return [mine]
    out: list = [None] * world
    dist.all_gather_object(out, mine)
    return out


def report(rows: list[list[dict]], out: str, sparse: list[dict], start: list[dict]) -> None:
    by = {(r[0]["stage"], r[0]["overlap_comm"]): r for r in rows}
    for ranks in rows:
        r = ranks[0]
        sync = by.get((r["stage"], False))
        if r["overlap_comm"] and sync and r["exposed_seconds"] is not None and sync[0]["exposed_seconds"]:
            # what backward hid: the wait left with overlap, against all of it waited for without
            exposed = statistics.median(x["exposed_seconds"] for x in ranks)
            waited = statistics.median(x["exposed_seconds"] for x in sync)
            r["hidden_share"] = max(0.0, 1 - exposed / waited)
        owned = [x["owned_numel"] for x in ranks]
        adam = [x["adam_seconds"] for x in ranks]
        r["owned_spread"] = max(owned) - min(owned)
        r["adam_per_rank"] = adam
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    saved = sparse[1]["grad_bytes_per_step"] / max(sparse[0]["grad_bytes_per_step"], 1)
    Path(out).write_text(json.dumps({"bench": "dist_comm", "rows": rows, "sparse": sparse,
                                     "sparse_saving": saved, "start_sync": start}, indent=1))
    print(f"{'stage':>5} {'overlap':>7} {'ranks':>5} {'Psi':>10} {'payload/step':>13} {'x Psi':>6} {'paper':>6} "
          f"{'wire x Psi':>10} {'reduce wait':>11} {'hidden':>7} {'owned spread':>12} {'adam s/rank':>16}")
    for ranks in rows:
        r = ranks[0]
        wait = f"{r['exposed_seconds'] * 1e3:.1f} ms" if r["exposed_seconds"] is not None else "-"
        hidden = f"{r['hidden_share']:.0%}" if "hidden_share" in r else "-"
        adam = " ".join(f"{a:.3f}" for a in r["adam_per_rank"])
        print(f"{r['stage']:>5} {'on' if r['overlap_comm'] else 'off':>7} {r['ranks']:>5} {r['psi']:>10,} "
              f"{r['payload_bytes'] / 1e6:>10.2f} MB {r['payload_psi']:>6.2f} {r['paper_psi']:>6.1f} "
              f"{r['wire_psi']:>10.2f} {wait:>11} {hidden:>7} {r['owned_spread']:>12} {adam:>16}")
    print(f"embedding {ROWS:,} x 64, each rank's batch touching 5% of the rows, stage 2: gradient bytes sent per "
          f"step and rank {sparse[0]['grad_bytes_per_step'] / 1e6:.3f} MB as rows, "
          f"{sparse[1]['grad_bytes_per_step'] / 1e6:.3f} MB dense ({saved:.1f}x fewer)")
    if start:
        print(f"\n{'start, model built':>26} {'model':>9} {'copied':>9} {'sync':>8} {'whole broadcast':>15} "
              f"{'sync / broadcast':>16}")
    for r in start:
        how = "with a seed per rank" if r["seed_by_rank"] else "with the same seed"
        print(f"{how:>26} {r['model_bytes'] / 1e9:>6.2f} GB {r['copied']:>3}/{r['tensors']:<5} "
              f"{r['sync_seconds']:>6.2f} s {r['broadcast_seconds']:>13.2f} s "
              f"{r['sync_seconds'] / r['broadcast_seconds']:>16.2f}")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=count(1), default=2)
    ap.add_argument("--layers", type=count(1), default=4)
    ap.add_argument("--width", type=count(1), default=256)
    ap.add_argument("--steps", type=count(1), default=3)
    ap.add_argument("--sync-mb", type=count(0), default=1024, help="model size for the start's sync (0: skip it)")
    ap.add_argument("--sync-repeats", type=count(1), default=3)
    ap.add_argument("--out", default="results/dist_comm.json")
    ap.add_argument("--worker", action="store_true", help="be one rank (set by the launcher, or use torchrun)")
    args = ap.parse_args()
    gpt_heads(ap, args.width)
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
                                       "--sync-mb", str(args.sync_mb), "--sync-repeats", str(args.sync_repeats),
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
