"""Soak: demos killed at random moments leave nothing behind once the next demo has run.

Each run is killed at a random moment of its life (starting up, initializing, training, cleaning up), mostly with
SIGKILL (no cleanup runs), sometimes with SIGTERM or SIGINT (the cleanup runs); then one demo runs to the end. The
temporary folder is the runs' own, so anything left in it is theirs (torch's compile cache, which any program that
imports torch._dynamo makes in $TMPDIR, goes elsewhere: it is torch's, and meant to stay).
Slow (about five minutes on two cores): ``python -m pytest -m slow tests/test_soak.py``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvme_swapper._native import checksum_kind
from offload.ops import cpu_adam_backend

RUNS = 50
DEMO = [sys.executable, "-m", "offload", "demo", "--layers", "1", "--width", "64", "--vocab", "128", "--tokens", "16",
        "--batch", "2"]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.slow
def test_demos_killed_at_random_moments_leave_nothing_after_the_next(tmp_path: Path) -> None:
    cpu_adam_backend(), checksum_kind()  # both native builds in the cache first: killed mid-build, runs only rebuild
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch-cache")}
    seed = int(os.environ.get("OFFLOAD_SOAK_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    start = time.monotonic()
    kinds: dict[str, int] = {}
    left_once, left = 0, set()
    for _ in range(RUNS):
        proc = subprocess.Popen([*DEMO, "--steps", "100000"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            time.sleep(rng.uniform(0.0, 10.0))
            sig = rng.choices([signal.SIGKILL, signal.SIGTERM, signal.SIGINT], weights=[6, 2, 2])[0]
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        kinds[sig.name] = kinds.get(sig.name, 0) + 1
        folders = {p.name for p in tmp.glob("offload-demo-*")}
        left_once, left = max(left_once, len(folders)), left | folders
    done = subprocess.run([*DEMO, "--steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    print(f"soak: {RUNS} demos killed ({kinds}), seed {seed}: {len(left)} swap folders left behind by them (at most "
          f"{left_once} at once), {elapsed:.0f} s in all")
    assert done.returncode in (0, 1), done.stderr[-3000:]  # (1: the loss did not fall in two steps)
    assert _files(tmp) == [], f"seed {seed}: {_files(tmp)[:20]}"
