"""What the bench scripts share: their flags' types (checked as argparse parses them, so a bad value is an error
naming the flag before any set-up), the shape of a GPT of a given size, this process's memory as /proc tells it, an
end by SIGTERM that still runs their cleanup, and the help of ``--out``."""

from __future__ import annotations

import argparse
import math
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from nvme_swapper import AioConfig
from offload.config import parse_bytes

T = TypeVar("T")


def count(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``minimum`` (to ``maximum``), written as 3 or 1e6. argparse names
    the flag in the error ("argument --rounds: must be a whole number >= 1, got '0'")."""
    allowed = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def whole_number(text: str) -> int:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value.is_integer() or value < minimum or (maximum is not None and value > maximum):  # nan, inf too
            raise argparse.ArgumentTypeError(f"must be a whole number {allowed}, got {text!r}")
        return int(value)

    return whole_number


def number(minimum: float, *, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a finite real number of at least (or, not ``inclusive``, above) ``minimum``."""
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"

    def real(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}")
        return value

    return real


def byte_count(text: str) -> int:
    """An argparse ``type``: a byte count, 16777216, 1.6e7 or 16MiB (offload.config.parse_bytes)."""
    try:
        return parse_bytes(text, "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a byte count such as 16777216 or 16MiB (units: B, KB, MB, GB, TB, "
                                         f"KiB, MiB, GiB, TiB), got {text!r}") from None


def listed(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse ``type``: comma-separated values, each of the type ``item``, at least one, none empty."""

    def comma_separated(text: str) -> list[T]:
        values = []
        for part in text.split(","):
            try:
                values.append(item(part.strip()))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"takes comma-separated values, each of which {exc}"
                                                 + (f" (in {text!r})" if "," in text else "")) from None
        return values

    return comma_separated


def check_aio(ap: argparse.ArgumentParser, flags: str, **fields: Any) -> None:
    """``AioConfig(**fields)``, or ``ap.error`` naming ``flags`` (the flags those fields came from) and why not."""
    try:
        AioConfig(**fields)
    except ValueError as exc:
        ap.error(f"{flags}: {exc}")


def add_gpt_flags(ap: argparse.ArgumentParser, *, params: int, vocab: int, tokens: int, batch: int, steps: int,
                  warmup: int) -> None:
    """The flags of a bench GPT's size and of the steps measured on it, with these defaults."""
    ap.add_argument("--params", type=count(1), default=params,
                    help=f"model size (parameters; default {params:.0e}); ignored with --layers")
    ap.add_argument("--layers", type=count(1), default=None)
    ap.add_argument("--width", type=count(1), default=None, help="with --layers (default 768)")
    ap.add_argument("--vocab", type=count(1), default=vocab)
    ap.add_argument("--tokens", type=count(1), default=tokens, help="sequence length")
    ap.add_argument("--batch", type=count(1), default=batch)
    ap.add_argument("--steps", type=count(1), default=steps, help="measured steps")
    ap.add_argument("--warmup", type=count(0), default=warmup, help="steps before the measured ones")


def gpt_heads(ap: argparse.ArgumentParser, width: int) -> int:
    """The attention heads of a bench GPT ``width`` wide, one per 64 of width; ``ap.error`` where they do not divide
    the width."""
    heads = max(1, width // 64)
    if width % heads:
        ap.error(f"--width must be a multiple of its number of heads (width // 64 = {heads}), got {width}")
    return heads


def largest_fetched(model: torch.nn.Module, persistence_threshold: int) -> int:
    """Elements of the largest parameter of ``model`` above ``persistence_threshold``: the smallest window
    (stage3_max_live_parameters) that can fetch it; 0 when every parameter stays on the device."""
    return max((p.numel() for p in model.parameters() if p.numel() > persistence_threshold), default=0)


def check_live(ap: argparse.ArgumentParser, live: int, largest: int) -> None:
    """``ap.error`` naming --live where that window cannot hold the ``largest`` parameter it fetches (the engine would
    refuse it naming the config key, after the bench's set-up)."""
    if live < largest:
        ap.error(f"--live (stage3_max_live_parameters) must hold the largest parameter the window fetches, "
                 f"{largest} elements, got {live}")


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
