"""SIGKILL of a training process in the middle of an optimizer step with its state on NVMe, then resume.

The child trains, saves a checkpoint after SAVED_AT steps, and keeps training; the parent kills it with SIGKILL
while ``engine.step()`` is running (the child marks entering each step in a file). Resuming from the checkpoint,
in a fresh engine on the same nvme_path (the killed run's swap directory is still there), and training to the end
must give parameters bitwise equal to a run that was never killed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

import offload
from models import batches, make, train_steps

STEPS, SAVED_AT = 6, 2
SHAPE = {"d": 128, "layers": 3}

CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import offload
    from models import batches, lm_loss, make
    engine = offload.initialize(make(**{shape!r}), {cfg!r})
    data = batches({steps})
    for i, (x, y) in enumerate(data * 1000):
        engine.backward(lm_loss(engine(x), y))
        if i >= {saved_at}:
            open({marker!r}, "w").write(str(i))
        engine.step()
        if i + 1 == {saved_at}:
            engine.save_checkpoint({ckpt!r})
            print("SAVED", flush=True)
""")


def config(nvme: Path) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"sub_group_size": 1 << 14,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
            "aio": {"block_size": 1 << 16}}


def test_sigkill_mid_step_then_resume_is_bitwise_identical(tmp_path):
    nvme, ckpt, marker = tmp_path / "nvme", tmp_path / "ckpt", tmp_path / "in-step"
    script = CHILD.format(tests=str(Path(__file__).resolve().parent.parent), shape=SHAPE, cfg=config(nvme),
                          steps=STEPS, saved_at=SAVED_AT, marker=str(marker), ckpt=str(ckpt))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SAVED"
        deadline = time.monotonic() + 120
        while not marker.exists() or int(marker.read_text() or 0) < SAVED_AT + 1:  # inside a later step
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.0005)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert [p.name for p in nvme.iterdir() if p.name.startswith("swap-")], "the killed run's swap files remain"

    data = batches(STEPS)
    model = make(seed=7, **SHAPE)  # other initial weights: everything must come from the checkpoint
    with offload.initialize(model, config(nvme)) as engine:
        assert engine.load_checkpoint(ckpt)[0].name == f"step{SAVED_AT}"
        train_steps(engine, data[SAVED_AT:])
        resumed = engine.consolidated_state_dict()
    reference = make(**SHAPE)
    with offload.initialize(reference, config(tmp_path / "ref")) as engine:
        train_steps(engine, data)
        expected = engine.consolidated_state_dict()
    assert resumed.keys() == expected.keys()
    for k in expected:
        assert torch.equal(resumed[k], expected[k]), k
