"""What the bench scripts share: the shape of a GPT of a given size, this process's memory as /proc tells it, an end
by SIGTERM that still runs their cleanup, and the help of ``--out``."""

from __future__ import annotations

import signal
import sys


def exit_on_sigterm() -> None:
    """A time limit or a scheduler's SIGTERM ends the bench as Ctrl-C would, through its ``finally`` blocks, so its
    swap files and temporary folders go (a kill where it stood left hundreds of MB behind)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def shape_for(params: float, vocab: int, context: int) -> tuple[int, int]:
    """(layers, width) of a GPT with about ``params`` parameters; widths as in published models of that size."""
    width = 512 if params < 5e7 else 768 if params < 2e8 else 1536 if params < 1e9 else 2560 if params < 5e9 else 4096
    per_block = 12 * width * width + 13 * width
    layers = max(1, round((params - (vocab + context) * width) / per_block))
    return layers, width


def proc_bytes(path: str, *keys: str) -> list[int]:
    """The ``key: N kB`` values of a /proc file, in bytes, in the order asked; raises naming a key not there."""
    found: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                found[name] = int(rest.split()[0]) * 1024
    missing = [k for k in keys if k not in found]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found in {path}")
    return [found[k] for k in keys]


def mem_available() -> int:
    return proc_bytes("/proc/meminfo", "MemAvailable")[0]


def peak_rss() -> int:
    """This process's peak resident set so far (VmHWM), bytes."""
    return proc_bytes("/proc/self/status", "VmHWM")[0]


def reset_peak_rss() -> bool:
    """Restarts this process's VmHWM from its current RSS (Linux: "5" to /proc/self/clear_refs), so that a later
    peak_rss() is the peak of what came after, not of an earlier phase (a probe's buffer, freed since); False where
    the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def out_help(script: str) -> str:
    """``--out``'s help: a file when the script runs itself, a folder through the CLI, which puts the JSON in it
    (offload/cli.py bench_command)."""
    return (f"the JSON file to write (default results/{script}.json); through python -m offload bench, --out is "
            f"instead the results folder (default results/): the JSON goes to FOLDER/{script}.json, the plots beside "
            "it")


def huge_pages() -> tuple[int, int]:
    """(anonymous bytes, of them in transparent huge pages) of this process: I/O buffers on 4 KiB pages move at
    about half the speed of huge-paged ones on this disk, so the train bench reports how many were granted."""
    anon, huge = proc_bytes("/proc/self/smaps_rollup", "Anonymous", "AnonHugePages")
    return anon, huge
