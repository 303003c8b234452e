"""Loading a sharded safetensors checkpoint larger than the host budget, measured: the process's peak RSS against it.

A GPT of ``--params`` parameters is written as transformers writes a checkpoint (fp32, shards of ``--shard-size``
with ``model.safetensors.index.json``, or one file where it fits; the tied output head left out: it is the
embedding). Then, for each placement, a fresh process builds the same model inside ``offload.init`` (fp32
parameters in a file arena on the NVMe directory), ``offload.initialize``s it with ``offload.host_memory_budget`` =
a fraction (``--budget``) of the checkpoint's bytes, and loads the checkpoint into the engine
(``engine.load_state_dict``: tensor by tensor into the fp32 masters on NVMe and each parameter's home).

The check: the load must fit in the room the budget leaves: the host tier's bytes in use before it plus the RSS the
load adds (its high-water mark above the RSS before it, ``/proc/self/clear_refs`` resetting the mark) stay within
the budget. Beside it, the load against its bound, the RSS a tensor-by-tensor load needs whatever the checkpoint's
size: 1.5x the largest tensor (the tensor in fp32 and its bf16 copy) plus a fixed 4 MiB (LOAD_SLACK) for the pages
of code and libraries the load touches first (1.7-2.0 MiB measured), with the RSS the load leaves behind (the C
heap: glibc serves allocations from it once a large block was freed, and keeps its pages, 0-30 MiB at 1e8
parameters), reported, not judged. Where the largest tensor is a large share of a small checkpoint (the embedding:
40% of it at 1e7 parameters) the default fractions leave less room beside the tier than the bound: a budget
exceeded by a load within its bound says so, and about which fraction would hold it.

The peak RSS of building (inside ``offload.init``) and of ``initialize`` (which, on this CPU machine, also holds the
device tier, the C++ Adam and the swap engines) are reported beside it, from just after the imports.

  nvme   parameters and optimizer state on NVMe: the budget (default 0.75x) is below the checkpoint (the
         engine holds 2 B/param of gradients in RAM: half the fp32 checkpoint)
  host   bf16 parameters homed in host RAM, optimizer state on NVMe: the engine itself then holds 2 B/param of
         parameters and 2 B/param of gradients in RAM, as much as the fp32 checkpoint, so its budget (default
         1.25x) cannot be below the checkpoint; what the load adds on top of the initialized engine is reported

The loaded masters must equal the checkpoint (a sample of tensors).

    python bench/load.py [--params 1e8] [--shard-size 64MiB] [--budget nvme=0.75,host=1.25] [--nvme-dir DIR]
                         [--out results/load.json]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _common import byte_count, count, exit_on_sigterm, out_help, shape_for  # noqa: E402

from offload._progress import progress  # noqa: E402
from offload.memory import fmt_bytes  # noqa: E402
from offload.models import GPT, GPTConfig  # noqa: E402
from offload.persist._export import _unique, write_safetensors  # noqa: E402

VOCAB, CONTEXT = 8192, 64
LOAD_SLACK = 4 << 20  # the bound's fixed part: pages of code and libraries the load touches first (1.7-2.0 MiB)

CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch, offload
from offload.models import GPT, GPTConfig

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

cfg = GPTConfig(vocab_size={vocab}, context={context}, layers={layers}, heads={heads}, width={width})
config = {config}
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts from here
base = status("VmRSS")
with offload.init(config):
    model = GPT(cfg)
built = status("VmHWM") - base
engine = offload.initialize(model, config)
ready = status("VmHWM") - base
in_use = engine.memory_report()["host"]["current"]
open("/proc/self/clear_refs", "w").write("5")
before_load = status("VmRSS")
result = engine.load_state_dict({ckpt!r})
load_adds, load_leaves = status("VmHWM") - before_load, status("VmRSS") - before_load
from safetensors import safe_open
try:
    index = json.load(open({ckpt!r} + "/model.safetensors.index.json"))["weight_map"]
except FileNotFoundError:  # one shard: a single model.safetensors
    with safe_open({ckpt!r} + "/model.safetensors", framework="pt") as f:
        index = dict.fromkeys(f.keys(), "model.safetensors")
names = dict(engine.module.named_parameters())
sample = [n for n in list(index)[:: max(1, len(index) // 6)] if n in names]
equal = True
from offload.persist import engine_tensors
got = engine_tensors(engine, sample)
for n in sample:
    with safe_open({ckpt!r} + "/" + index[n], framework="pt") as f:
        equal &= bool(torch.equal(f.get_tensor(n), got[n]))
report = engine.memory_report()
engine.close()
print(json.dumps({{"built": built, "initialized": ready, "load_adds": load_adds, "load_leaves": load_leaves,
                  "host_in_use": in_use,
                  "missing": result.missing, "unexpected": result.unexpected, "equal": equal, "sampled": len(sample),
                  "host_tier_peak": report["host"]["peak"]}}))
"""


def placement_config(kind: str, nvme: Path, budget: int) -> dict:
    param = {"device": "cpu"} if kind == "host" else {"device": "nvme", "nvme_path": str(nvme / "params")}
    return {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_param": param,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme / "optimizer")}},
            "offload": {"host_memory_budget": budget, "device": "cpu"}}


def _fractions(text: str) -> dict[str, float]:
    """``--budget`` ("nvme=0.75,host=1.25") as {placement: fraction of the checkpoint}; an argparse ``type``."""
    out = {}
    for item in text.split(","):
        kind, _, value = (part.strip() for part in item.partition("="))
        try:
            fraction = float(value)
        except ValueError:
            fraction = math.nan
        if kind not in ("nvme", "host") or not fraction > 0 or math.isinf(fraction):
            raise argparse.ArgumentTypeError(f"takes placement=fraction pairs, placements nvme and host, fractions "
                                             f"positive numbers, such as nvme=0.75,host=1.25; got {item!r}")
        out[kind] = fraction
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=count(1), default=10**8, help="model size (default 1e8)")
    ap.add_argument("--shard-size", type=byte_count, default="64MiB")
    ap.add_argument("--budget", type=_fractions, default="nvme=0.75,host=1.25",
                    help="host budget per placement, as a fraction of the checkpoint's bytes")
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--out", default="results/load.json", help=out_help("load"))
    args = ap.parse_args()
    if args.shard_size < 1:
        ap.error(f"--shard-size must be at least 1 byte, got {args.shard_size}")
    fractions = args.budget
    layers, width = shape_for(args.params, VOCAB, CONTEXT)
    cfg = GPTConfig(vocab_size=VOCAB, context=CONTEXT, layers=layers, heads=width // 64, width=width)
    work = Path(tempfile.mkdtemp(prefix="offload-load-", dir=args.nvme_dir))
    try:
        torch.manual_seed(0)
        model = GPT(cfg)
        full = model.state_dict(keep_vars=True)  # the parameters themselves: a tied one is the same object
        state = {k: full[k].detach() for k in _unique({k: id(v) for k, v in full.items()})}  # tied weights once
        ckpt = work / "checkpoint"
        sizes = [(k, v.numel() * v.element_size()) for k, v in state.items()]
        write_safetensors(ckpt, sizes, lambda names: {n: state[n] for n in names}, args.shard_size)
        model = full = state = None  # the loading processes measure their own memory; this one's is freed
        ckpt_bytes = sum(n for _, n in sizes)
        largest_name, largest = max(sizes, key=lambda kv: kv[1])
        bound = int(1.5 * largest) + LOAD_SLACK
        shards = len(list(ckpt.glob("*.safetensors")))
        print(f"load bench: GPT {layers} x {width}, {cfg.num_parameters / 1e6:.0f}M parameters; checkpoint "
              f"{fmt_bytes(ckpt_bytes)} in {shards} shard(s) of <= {fmt_bytes(args.shard_size)}; largest tensor "
              f"{largest_name} {fmt_bytes(largest)} ({largest / ckpt_bytes:.0%} of it): the load's bound 1.5x it + "
              f"{fmt_bytes(LOAD_SLACK)} = {fmt_bytes(bound)}", flush=True)
        rows = {}
        for kind in progress(list(fractions), "placements"):
            budget = int(fractions[kind] * ckpt_bytes)
            nvme = work / kind
            nvme.mkdir()
            code = CHILD.format(root=str(Path(__file__).resolve().parent.parent), vocab=VOCAB, context=CONTEXT,
                                layers=layers, heads=width // 64, width=width, ckpt=str(ckpt),
                                config=repr(placement_config(kind, nvme, budget)))
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                raise SystemExit(f"{kind}: the loading process failed:\n{done.stderr[-3000:]}")
            rows[kind] = {**json.loads(done.stdout.strip().splitlines()[-1]), "budget": budget,
                          "budget_fraction": fractions[kind]}
            shutil.rmtree(nvme, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nhost tier in use before the load + RSS the load adds, against the budget; the load against its bound; "
          "peak RSS of building and of initialize from after the imports\n")
    print(f"{'placement':10s} {'budget':>18s} {'tier in use':>11s} {'load adds':>10s} {'sum/budget':>10s} "
          f"{'adds/bound':>10s} {'built':>10s} {'initialized':>11s} {'masters':>8s}")
    for kind, r in rows.items():
        r["peak"] = r["host_in_use"] + r["load_adds"]
        r["within_budget"] = r["peak"] <= r["budget"]
        r["load_adds_over_largest"] = r["load_adds"] / largest
        r["within_bound"] = r["load_adds"] <= bound
        print(f"{kind:10s} {fmt_bytes(r['budget']):>10s} ({r['budget_fraction']:.2f}x) "
              f"{fmt_bytes(r['host_in_use']):>11s} {fmt_bytes(r['load_adds']):>10s} {r['peak'] / r['budget']:10.2f} "
              f"{r['load_adds'] / bound:10.2f} {fmt_bytes(r['built']):>10s} {fmt_bytes(r['initialized']):>11s} "
              f"{'equal' if r['equal'] else 'DIFFER':>8s}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"params": cfg.num_parameters, "layers": layers, "width": width,
                               "checkpoint_bytes": ckpt_bytes, "shards": shards, "largest_tensor": largest_name,
                               "largest_tensor_bytes": largest, "load_bound": bound, "load_slack": LOAD_SLACK,
                               "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    for kind, r in rows.items():
        if not r["within_bound"]:
            print(f"note: {kind}: the load added {fmt_bytes(r['load_adds'])}, {r['load_adds_over_largest']:.2f}x the "
                  f"largest tensor, over its bound {fmt_bytes(bound)}, and left {fmt_bytes(r['load_leaves'])} resident "
                  "after it (freed memory the C heap keeps)", file=sys.stderr)
    failed = []
    for kind, r in rows.items():
        if r["within_budget"]:
            continue
        why = f": the load itself went over its bound, {fmt_bytes(bound)}"
        if r["within_bound"]:  # the load cost what it should: the budget leaves too little room for this model
            fits = math.ceil((r["host_in_use"] + bound) / ckpt_bytes * 100) / 100
            why = (f": the load stayed within its bound, so the budget leaves less room beside the tier than loading "
                   f"{largest_name} ({largest / ckpt_bytes:.0%} of the checkpoint) takes; about --budget {kind}={fits} "
                   "holds it")
        failed.append(f"{kind}: tier in use {fmt_bytes(r['host_in_use'])} + load adds {fmt_bytes(r['load_adds'])} = "
                      f"{fmt_bytes(r['peak'])}, over its host budget {fmt_bytes(r['budget'])} "
                      f"({r['budget_fraction']:.2f}x the checkpoint){why}")
    failed += [f"{kind}: the loaded masters differ from the checkpoint ({r['sampled']} tensors sampled)"
               for kind, r in rows.items() if not r["equal"]]
    failed += [f"{kind}: the checkpoint lacks {len(r['missing'])} of the model's keys (first {r['missing'][0]})"
               for kind, r in rows.items() if r["missing"]]
    if failed:
        sys.exit("error: " + "; ".join(failed))  # to stderr, status 1


if __name__ == "__main__":
    exit_on_sigterm()
    main()
