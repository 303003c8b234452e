"""PNG plots of the benchmarks' JSON (``python -m offload bench``): one function per benchmark, one place for style.

matplotlib is an optional dependency (the ``plot`` and ``dev`` extras): it is imported only when a plot is drawn,
with the Agg backend, so the library and the benchmarks run without it and without a display.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

# one colour per kind of time, the same in every breakdown
COLORS = {"compute": "#4c72b0", "adam": "#dd8452", "io": "#55a868", "stalled": "#c44e52"}
LABELS = {"compute": "compute (forward+backward)", "adam": "CPU Adam",
          "io": "I/O (write-backs draining, other)", "stalled": "stalled waiting for reads"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install -e '.[plot]' (the dev extra includes it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _label(ax: Any, title: str, ylabel: str, xlabel: str | None = None) -> None:
    """Title, axis labels, legend and horizontal grid as every stacked-bar plot here has them."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def plot_nvme(data: dict[str, Any], out: Path) -> list[Path]:
    """Swap-engine throughput (the single-tensor workload, kernel AIO) against block size and against queue depth,
    write and read side by side, with the disk's limit measured in the same run as a dashed line; for the
    ``--requests`` mode, write, read and their score against the request size, the knee marked."""
    plt = _pyplot()
    if data.get("mode") == "requests":
        return [_plot_requests(plt, data, out)]
    pat = re.compile(r"^aio bs=(\d+)K qd=(\d+) 1x(\S+) (write|read)$")
    points: dict[tuple[str, int, int], float] = {}
    workload = ""
    for key, value in data["medians"].items():
        m = pat.match(key)
        if m:
            points[(m.group(4), int(m.group(1)) * 1024, int(m.group(2)))] = value
            workload = m.group(3)
    if not points:
        raise ValueError("nvme_swapper JSON has no 'aio bs=... qd=... 1x... write|read' medians to plot")
    blocks = sorted({b for _, b, _ in points})
    depths = sorted({q for _, _, q in points})
    rounds = data.get("rounds", "?")
    paths = []
    for x_name, xs, series, fname in (("block size", blocks, depths, "nvme_block_size.png"),
                                      ("queue depth", depths, blocks, "nvme_queue_depth.png")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, direction in zip(axes, ("write", "read")):
            for s in series:
                ys = [points.get((direction, x, s) if x_name == "block size" else (direction, s, x)) for x in xs]
                label = f"queue depth {s}" if x_name == "block size" else f"block {_size(s)}"
                ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=label)
            limit = data.get("limit", {}).get(direction)
            if limit:
                ax.axhline(limit, color="gray", linestyle="--", label=f"disk limit (fio / pread loop) {limit:.2f} GB/s")
            ref = data.get("summary", {}).get(direction, {}).get("tensor_sized_loop_gbps")
            if ref:
                ax.axhline(ref, color="gray", linestyle=":", label=f"the same loop into the tensor {ref:.2f} GB/s")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([_size(x) if x_name == "block size" else str(x) for x in xs])
            ax.set_xlabel(f"{x_name} ({'bytes per request' if x_name == 'block size' else 'requests in flight'})")
            ax.set_ylabel("throughput (GB/s)")
            ax.set_title(direction)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Swap engine throughput vs {x_name}: kernel AIO, checksums off, one {workload} tensor, "
                     f"median of {rounds} round(s)")
        paths.append(_save(fig, out / fname))
    return paths


def _plot_requests(plt: Any, data: dict[str, Any], out: Path) -> Path:
    sizes, by = data["sizes"], data["by_size"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for direction in ("write", "read"):
        ax.plot(sizes, by[direction], marker="o", label=direction)
    ax.plot(sizes, by["score"], marker="s", linestyle="--", label="score (harmonic mean)")
    ax.axvline(data["knee_bytes"], color="gray", linestyle=":", label=f"knee {_size(data['knee_bytes'])}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([_size(s) for s in sizes])
    ax.set_xlabel("bytes per request (one tensor per request)")
    ax.set_ylabel("throughput (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"Swap engine throughput vs request size, median of {data.get('rounds', '?')} round(s)")
    return _save(fig, out / "nvme_request_size.png")


def plot_adam(data: dict[str, Any], out: Path) -> list[Path]:
    """Parameters updated per second by each Adam implementation, per thread count; the streaming bound (in-place
    ``a *= s`` over the same buffers, 28 bytes per parameter) as a dashed line."""
    plt = _pyplot()
    threads = sorted(data["threads"], key=int)
    variants = [v for v in data["threads"][threads[0]]["rows"]
                if data["threads"][threads[0]]["rows"][v]["params_per_s"] is not None]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(threads)
    for i, t in enumerate(threads):
        rows = data["threads"][t]["rows"]
        xs = [j + (i - (len(threads) - 1) / 2) * width for j in range(len(variants))]
        bars = ax.bar(xs, [rows[v]["params_per_s"] / 1e6 for v in variants], width, label=f"{t} thread(s)")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
        stream = rows.get("streaming a *= s")
        if stream:
            ax.axhline(stream["gb_per_s"] * 1e9 / 28 / 1e6, color=bars.patches[0].get_facecolor(), linestyle="--",
                       linewidth=1, label=f"memory-bandwidth bound, {t} thread(s)")
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("throughput (million parameters / s)")
    ax.set_xlabel("implementation")
    ax.set_title(f"CPU Adam throughput per implementation: {data['params']:,} fp32 parameters, median of "
                 f"{data['repeats']} rounds ({data.get('backend', '')})")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return [_save(fig, out / "adam_throughput.png")]


def _stack(ax: Any, x: list[Any], parts: dict[str, list[float]], width: float = 0.6) -> None:
    bottom = [0.0] * len(x)
    for kind in ("compute", "adam", "io", "stalled"):
        if kind in parts:
            ax.bar(x, parts[kind], width, bottom=bottom, color=COLORS[kind], label=LABELS[kind])
            bottom = [b + v for b, v in zip(bottom, parts[kind])]


def plot_step(data: dict[str, Any], out: Path) -> list[Path]:
    """The NVMe optimizer step split into Adam, stalled reads and the rest, beside its parts timed alone and run one
    after another (what the step would take with no overlap)."""
    plt = _pyplot()
    med, parts = data["medians"], data["step_breakdown"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    _stack(ax, ["optimizer step"], {"adam": [parts["adam"]], "stalled": [parts["stalled"]], "io": [parts["other"]]})
    bottom = 0.0
    for name, color, hatch in (("nvme read", COLORS["stalled"], "//"), ("nvme write", COLORS["io"], "//"),
                               ("nvme adam", COLORS["adam"], "//")):
        ax.bar(["parts alone, in sequence"], [med[name]], 0.6, bottom=bottom, color=color, hatch=hatch,
               alpha=0.6, label=f"{name.split()[1]} alone")
        bottom += med[name]
    _label(ax, f"Offloaded optimizer step, time breakdown (optimizer only, no compute):\n"
               f"{_count(data['params_nvme'])} parameters, Adam state ({12 * data['params_nvme'] / 1e9:.3g} GB) "
               f"on NVMe, median of {data.get('rounds', len(data['samples']['nvme step']))} rounds",
           "time per step (s)")
    return [_save(fig, out / "step_breakdown.png")]


def plot_params(data: dict[str, Any], out: Path) -> list[Path]:
    """Forward+backward with parameters on NVMe against the same model in memory and against the reads alone."""
    plt = _pyplot()
    med = data["medians"]
    cfg = data["config"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = {"offload": "parameters on NVMe", "plain": "in memory (compute alone)", "reads": "parameter reads alone"}
    bars = ax.bar([names[k] for k in med], list(med.values()), 0.6,
                  color=[COLORS["compute"], COLORS["compute"], COLORS["stalled"]])
    ax.bar_label(bars, fmt="%.3g s", fontsize=8)
    ax.set_ylabel("forward+backward time (s)")
    ax.set_xlabel("run")
    ax.set_title(f"Parameter offload, forward+backward time: GPT {cfg['layers']}x{cfg['width']},\n"
                 f"{data['param_bytes'] / 1e6:.3g} MB of bf16 parameters, {data['bytes_read_per_step'] / 1e6:.3g} MB "
                 f"read per step; offload / max(others) "
                 f"= {data['ratio']:.2f}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return [_save(fig, out / "params_time.png")]


def plot_reads(data: dict[str, Any], out: Path) -> list[Path]:
    """Step time with reads outside modules' forwards found by the engine against the same reads declared by hand:
    each round's median, and the median over rounds."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for x, (name, times) in enumerate(data["rounds"].items()):
        ax.bar(x, data["median"][name], 0.6, color=COLORS["compute"], label=None)
        ax.scatter([x] * len(times), times, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(data["rounds"])), [f"{name}\n{data['median'][name]:.3g} s" for name in data["rounds"]])
    ax.set_ylabel("step time (s)")
    cfg = data["args"]
    ax.set_title(f"Reads outside a module's forward: GPT of nn.TransformerEncoderLayer {cfg['layers']}x"
                 f"{cfg['width']},\nevery parameter on NVMe; undeclared / declared = {data['ratio']:.3f}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return [_save(fig, out / "reads_time.png")]


def plot_train(data: dict[str, Any], out: Path) -> list[Path]:
    """Each training step split into compute, Adam, I/O and stalled, with the disk's floor; and the loss."""
    plt = _pyplot()
    steps = data["steps"]
    m, s = data["model"], data["summary"]
    fig, ax = plt.subplots(figsize=(max(6, 1 + 0.6 * len(steps)), 4.8))
    x = [f"{r['step']}{' (warm-up)' if r['warmup'] else ''}" for r in steps]
    _stack(ax, x, {k: [r["breakdown"][k] for r in steps] for k in ("compute", "adam", "io", "stalled")})
    ax.axhline(s["floor_seconds"], color="black", linestyle="--",
               label=f"disk floor {s['floor_seconds']:.3g} s (bytes / measured GB/s)")
    _label(ax, f"Training step time breakdown: GPT {m['layers']}x{m['width']} ({_count(m['params'])} parameters),\n"
               f"parameters and Adam state on NVMe; median step / floor = {s['step_over_floor']:.2f}",
           "time per step (s)", "training step")
    paths = [_save(fig, out / "train_breakdown.png")]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], marker="o")
    ax.set_xlabel("training step")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.set_title(f"Training loss per step: GPT {_count(m['params'])} parameters on NVMe")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "train_loss.png"))
    return paths


def plot_gpu(data: dict[str, Any], out: Path) -> list[Path]:
    """Median step time per placement, this library beside plain torch and DeepSpeed, with the opt-host bound as a
    dashed line; and the loss per step of every run."""
    plt = _pyplot()
    runs = [r for r in data["runs"] if r["status"] == "ok"]
    if not runs:
        raise ValueError("gpu_train JSON has no successful run to plot")
    placements = list(dict.fromkeys(r["placement"] for r in runs))
    frameworks = list(dict.fromkeys(r["framework"] for r in runs))
    colors = {"offload": COLORS["compute"], "deepspeed": COLORS["adam"], "torch": COLORS["io"],
              "fsdp": COLORS["stalled"], "torchao": "#8172b3"}
    fig, (ax, lax) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(frameworks)
    for j, fw in enumerate(frameworks):
        xs, ys = [], []
        for i, p in enumerate(placements):
            times = [r["step_seconds"] for r in runs if r["framework"] == fw and r["placement"] == p]
            if times:  # the median over rounds, as the summary takes it
                xs.append(i + (j - (len(frameworks) - 1) / 2) * width)
                ys.append(statistics.median(times))
        ax.bar(xs, ys, width, label=fw, color=colors.get(fw))
    bound = data.get("summary", {}).get("opt_host_bound")
    if bound and "opt-host" in placements:
        i = placements.index("opt-host")
        link = "pcie" if any(r.get("gpu_peak") is not None for r in runs) else "memcpy"  # no GPU: a host copy
        ax.hlines(bound["bound"], i - 0.45, i + 0.45, linestyles="dashed", colors="black",
                  label=f"max(compute, Adam, {link})")
    ax.set_xticks(range(len(placements)), placements, rotation=15)
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(f"{_count(data['model']['params'])} parameters on {data['device']}")
    ax.legend()
    for key in dict.fromkeys((r["framework"], r["placement"]) for r in runs):  # the first round's: the same data
        r = next(r for r in runs if (r["framework"], r["placement"]) == key)
        lax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['framework']} {r['placement']}")
    lax.set_xlabel("step")
    lax.set_ylabel("loss")
    lax.legend(fontsize=7)
    return [_save(fig, out / "gpu_train.png")]


def plot_load(data: dict[str, Any], out: Path) -> list[Path]:
    """Per placement: the host tier in use and what loading the checkpoint adds, stacked, against the budget."""
    plt = _pyplot()
    rows = data["rows"]
    names = list(rows)
    mib = [1 / (1 << 20)] * len(names)
    in_use = [rows[n]["host_in_use"] * m for n, m in zip(names, mib)]
    adds = [rows[n]["load_adds"] * m for n, m in zip(names, mib)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(names, in_use, 0.5, color=COLORS["compute"], label="host tier in use (engine)")
    ax.bar(names, adds, 0.5, bottom=in_use, color=COLORS["adam"], label="RSS the load adds")
    for i, n in enumerate(names):
        ax.hlines(rows[n]["budget"] / (1 << 20), i - 0.35, i + 0.35, colors="black", linestyles="--",
                  label="host budget" if i == 0 else None)
    ax.axhline(data["checkpoint_bytes"] / (1 << 20), color=COLORS["stalled"], lw=1, label="checkpoint (fp32)")
    _label(ax, f"Loading a sharded safetensors checkpoint ({_count(data['params'])} parameters, "
               f"{data['shards']} shards)", "MiB", "where the parameters live")
    return [_save(fig, out / "load_memory.png")]


PLOTS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "nvme": plot_nvme, "adam": plot_adam, "step": plot_step, "params": plot_params, "train": plot_train,
    "gpu": plot_gpu, "load": plot_load, "reads": plot_reads,
}


def plot(name: str, data: dict[str, Any], out: Path) -> list[Path]:
    """Draws benchmark ``name``'s plots from its JSON ``data`` into the folder ``out``; returns the PNG paths."""
    if name not in PLOTS:
        raise ValueError(f"no plot for benchmark {name!r}; known: {', '.join(PLOTS)}")
    out.mkdir(parents=True, exist_ok=True)
    return PLOTS[name](data, out)
