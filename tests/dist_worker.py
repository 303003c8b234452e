"""One rank of a distributed test (tests/test_dist.py starts N of these, with torchrun's environment variables).

``python dist_worker.py SPEC.json``: SPEC holds ``out`` (a folder for results), ``init`` ("self": this script
initializes torch.distributed, so the engine joins it; "engine": the engine initializes it from the environment)
and ``runs``, each trained in turn: ``name``, ``config`` (the engine's), ``steps``, ``gas``, and optionally ``load``
(a checkpoint folder to resume from), ``save`` (a folder to save into after ``save_after`` steps), ``die``
({"rank": r, "at_step": s, "how": "exit" | "hang" | "diverge"}: that rank stops mid-step, after its backward;
"diverge": it makes a collective first, a broadcast where the others step), ``staged``
(gradients through the CUDA path's device buckets, on the CPU: offload.plan.STAGE_ON_CPU), ``model`` ("bag": the
50k-row embedding model of the sparse-gradient runs), ``sparse_module`` (its nn.Embedding(sparse=True)),
``seed_by_rank`` (each rank builds the model from its own seed, with a frozen parameter ``frozen`` and a buffer
``mask``, as nanoGPT seeds by rank), ``frozen_base`` (the embedding, tied to the head, and the first block
frozen, as under adapters), ``edit`` (rank 0 alone re-initialises two parameters in an ``engine.gathered()``
block before training: test_params.edit), ``nan_at`` (before that step, rank 1 alone gets a batch whose labels
are all ignored, a NaN loss: every rank's backward must refuse it, and the loop skips it), ``fail_save`` (rank 0's
checkpoint writes of frozen parameters fail with ENOSPC, or with "commit" its rename of the written directory
into place fails with EIO, or with "safetensors" its write of the second shard of an export fails with ENOSPC; with
"oom" rank 1 runs out of device memory for the second gather of a whole frozen parameter that a save reads, with
"masters" rank 0 cannot allocate the third fp32 master an export keeps, with "after-gather" rank 0 fails right
after the second gather of a frozen parameter an export reads (with "ckpt-after-gather" rank 1, in a checkpoint):
the save must raise on every rank, the error's type recorded as ``save_error``), ``safetensors`` (a folder every
rank exports into with ``engine.save_safetensors(..., max_shard_size="24KB")`` after training),
``reference`` (a forward-only engine of ``make(seed=1)``, all of it frozen, made beside the trained one under the
same config; the trained one is closed first, then the reference runs forwards and rank r writes
``<name>.reference.rank<r>.pt``, its outputs on its slice of the first two batches, and
``<name>.groups.rank<r>.json``, whether torch.distributed was still initialized after each close) and ``differ``
(a model that differs across ranks: "shape", rank r's vocabulary is 96 + r; "count", rank 1 has one more buffer).

Each rank trains on its 1/N slice of a global batch of 6 sequences (so any N in 1, 2, 3 sees the same global
batch), writes ``<name>.rank<r>.json`` (memory report, communication counters, the swap counters of stage 3's
parameter pieces on NVMe, the start's sync from rank 0, the values of ``frozen`` and ``mask``) and rank 0 writes
``<name>.pt``, the consolidated state dict.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import offload  # noqa: E402
import offload.plan  # noqa: E402
from models import bag_batches, bag_loss, batches, lm_loss, make, make_bag  # noqa: E402
from test_params import edit  # noqa: E402

GLOBAL_BATCH = 6
GRAD_BUCKET = offload.plan.GRAD_BUCKET


def run(spec: dict, r: dict, rank: int, world: int, out: Path) -> None:
    if r.get("model") == "bag":  # a 50k-row embedding (sparse gradients), ``sparse_module``: sparse=True
        data, model, loss_fn = bag_batches(r["steps"] * r["gas"]), make_bag(sparse=r.get("sparse_module", False)), \
            bag_loss
    else:
        data, loss_fn = batches(r["steps"] * r["gas"], bsz=GLOBAL_BATCH), lm_loss
        model = make(seed=rank if r.get("seed_by_rank") else 0, vocab=96 + rank if r.get("differ") == "shape" else 96)
    if r.get("frozen_base"):
        for p in [model.tok.weight, *model.blocks[0].parameters()]:
            p.requires_grad_(False)
    if r.get("differ") == "count" and rank == 1:
        model.register_buffer("extra", torch.zeros(2))
    if r.get("seed_by_rank"):  # and a frozen parameter and a buffer, made from this rank's seed too
        model.frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        model.register_buffer("mask", torch.randn(3))
    per = GLOBAL_BATCH // world
    offload.plan.STAGE_ON_CPU = bool(r.get("staged"))
    offload.plan.GRAD_BUCKET = 1000 if r.get("staged") else GRAD_BUCKET
    engine = offload.initialize(model, r["config"])
    ref = offload.initialize(make(seed=1).requires_grad_(False), r["config"]) if r.get("reference") else None
    save_error = None
    from offload.persist import _export, _save, _tensors
    from offload.persist._format import TensorFile

    rename, write, write_temp = os.rename, TensorFile.write, _export.write_temp  # put back after the run
    aligned, host_value = _tensors.aligned_tensor, _tensors.host_value
    from offload.params._shards import ParamShards

    read_buffers, wait, shard_read = ParamShards._read_buffers, ParamShards._wait_reads, ParamShards.read
    from offload.optim.offloaded import OffloadedAdam

    read_state = OffloadedAdam.read_state
    if r.get("fail_save") == "oom" and rank == 1:
        reads = []

        def short_of_memory(self, i):
            reads.append(i)
            if len(reads) == 2:  # what the CPU's allocator raises (CUDA's OutOfMemoryError is a RuntimeError too)
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
            return read_buffers(self, i)

        ParamShards._read_buffers = short_of_memory
    elif r.get("fail_save") == "masters" and rank == 0:
        masters = []

        def no_room(*args, **kwargs):
            masters.append(args)
            if len(masters) == 3:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
            return aligned(*args, **kwargs)

        _tensors.aligned_tensor = no_room
    elif (r.get("fail_save"), rank) in (("after-gather", 0), ("ckpt-after-gather", 1)):
        frozen_reads = []

        def fails_after(engine, t):
            value = host_value(engine, t)
            frozen_reads.append(t)
            if len(frozen_reads) == 2:
                raise RuntimeError("injected after the gather")
            return value

        _tensors.host_value = _save.host_value = fails_after  # (an export's read, a save's)
    elif r.get("fail_save") == "piece-read" and rank == 1:
        piece_reads, inside = [], []

        def reading(self, i):
            inside.append(i)
            try:
                return shard_read(self, i)
            finally:
                inside.pop()

        def failing_wait(self, handles):  # a save's second piece read: done, then reported failed
            wait(self, handles)
            if inside:
                piece_reads.append(handles)
                if len(piece_reads) == 2:
                    raise OSError(errno.EIO, "Input/output error (injected)")

        ParamShards._wait_reads, ParamShards.read = failing_wait, reading
    elif r.get("fail_save") == "read-state" and rank == 1:
        state_reads = []

        def failing_read(self, sg):
            state_reads.append(sg)
            if len(state_reads) == 2:
                raise OSError(errno.EIO, "Input/output error (injected)")
            return read_state(self, sg)

        OffloadedAdam.read_state = failing_read
    elif r.get("fail_save") == "safetensors" and rank == 0:
        calls = []

        def failing_write_temp(folder, name, *args):
            calls.append(name)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return write_temp(folder, name, *args)

        _export.write_temp = failing_write_temp
    elif r.get("fail_save") == "commit" and rank == 0:
        def failing_rename(src, dst):
            raise OSError(errno.EIO, "Input/output error (injected)")

        os.rename = failing_rename
    elif r.get("fail_save") and rank == 0:

        def failing(self, name, *args):
            if name.startswith("frozen/"):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return write(self, name, *args)

        TensorFile.write = failing
    try:
        if r.get("edit"):
            with engine.gathered([model.blocks[1].fc.weight, model.pos, model.blocks[0].fc.weight]):
                if rank == 0 or r.get("frozen_base"):  # a frozen base: every rank edits it, each differently
                    edit(model, rank)
        client = None
        if r.get("load"):
            client = engine.load_checkpoint(r["load"])[1]
        start, norms = engine.global_steps, []
        for step in range(start, r["steps"]):
            if r.get("nan_at") == step:
                x, y = data[0]
                labels = torch.full_like(y, -100) if rank == 1 else y
                try:
                    engine.backward(torch.nn.functional.cross_entropy(
                        engine(x[rank * per : (rank + 1) * per]).flatten(0, 1),
                        labels[rank * per : (rank + 1) * per].flatten().to(engine.device)))
                except FloatingPointError as exc:
                    print(f"rank {rank} skipped: {str(exc)[:60]}", flush=True)
                else:
                    raise AssertionError(f"rank {rank}: the NaN loss of rank 1 was not refused here")
            for m in range(r["gas"]):
                x, y = data[step * r["gas"] + m]
                loss = loss_fn(engine(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
                engine.backward(loss)
                die = r.get("die")
                if die and die["rank"] == rank and die["at_step"] == step:
                    print(f"rank {rank} stopping ({die['how']}) mid-step {step}", flush=True)
                    if die["how"] == "exit":
                        os._exit(3)
                    if die["how"] == "diverge":  # a collective the others do not make (they step)
                        engine.comm.rank0s([step])
                    time.sleep(3600)
                engine.step()
            norms.append(engine.last_grad_norm)
            if r.get("save") and step + 1 == r["save_after"]:
                try:  # the loop's own values, rank 0's kept (DeepSpeed's client_state)
                    engine.save_checkpoint(r["save"], client_state={"step": step + 1, "rank": rank})
                except (OSError, RuntimeError) as exc:
                    if not r.get("fail_save"):
                        raise
                    save_error = f"{type(exc).__name__}: {exc}"
        if r.get("safetensors"):
            try:
                engine.save_safetensors(r["safetensors"], max_shard_size="24KB")
            except (OSError, RuntimeError) as exc:
                if not r.get("fail_save"):
                    raise
                save_error = f"{type(exc).__name__}: {exc}"
        state = engine.consolidated_state_dict()
        extras = {k: state.pop(k).tolist() for k in ("frozen", "mask") if k in state}
        if rank == 0:
            torch.save(state, out / f"{r['name']}.pt")
        stats = engine.stats()
        zero = r["config"]["zero_optimization"]
        roots = {Path(s["nvme_path"]) / f"rank{rank}" for s in (zero.get("offload_param", {}),
                                                                zero["offload_optimizer"]) if s.get("device") == "nvme"}
        (out / f"{r['name']}.rank{rank}.json").write_text(json.dumps({
            "swap_files": sum(f.stat().st_size for root in roots for f in root.rglob("swap.*")),
            "report": engine.memory_report(), "comm": stats["comm"], "steps": engine.global_steps,
            "pieces_nvme": stats["params"]["pieces_nvme"] if stats["params"] else None, "reduce": stats["reduce"],
            "numel": sum(p.numel() for p in engine.layout.params), "flat_numel": sum(engine.layout.group_numel),
            "start_sync": stats["start_sync"], "extras": extras, "save_error": save_error, "grad_norms": norms,
            "client_state": client}))
        if ref is not None:  # the engine that created the default group is closed: the reference's group lives on
            engine.close()
            with torch.no_grad():
                outs = [ref(x[rank * per : (rank + 1) * per]).cpu() for x, _ in data[:2]]
            torch.save(outs, out / f"{r['name']}.reference.rank{rank}.pt")
            alive = dist.is_initialized()
            ref.close()
            (out / f"{r['name']}.groups.rank{rank}.json").write_text(json.dumps(
                {"after_first_close": alive, "after_last_close": dist.is_initialized()}))
    finally:
        os.rename, TensorFile.write, _export.write_temp = rename, write, write_temp
        _tensors.aligned_tensor, _tensors.host_value, _save.host_value = aligned, host_value, host_value
        ParamShards._read_buffers, OffloadedAdam.read_state = read_buffers, read_state
        ParamShards._wait_reads, ParamShards.read = wait, shard_read
        engine.close()
        if ref is not None:
            ref.close()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    if spec["init"] == "self":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for r in spec["runs"]:
        run(spec, r, rank, world, out)
    if spec["init"] == "self":
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
