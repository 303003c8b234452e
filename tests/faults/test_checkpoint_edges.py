"""Checkpoint folders in states a save does not leave: a ``latest`` written by hand or by another tool (a path
outside the folder, nothing at all), a tensor file changed after the save (the engine then refuses forwards as well
as backward and saves, until a good load), and the temporary folder of a save killed midway (a later save of any
tag removes it; a load never takes it for a checkpoint). Engines run on the machine's device (tests/models.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import offload
from models import batches, lm_loss, make
from nvme_swapper._owner import write_owner
from offload.persist import export


def config(tmp_path: Path) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "zero_optimization": {"sub_group_size": 4096,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}},
            "aio": {"block_size": 1 << 16}}


def step(engine, batch) -> None:
    x, y = batch
    engine.backward(lm_loss(engine(x), y))
    engine.step()


def test_a_latest_naming_a_path_outside_its_folder_is_refused(tmp_path):
    """``latest`` holding ``../elsewhere/step4``, ``../x`` or an absolute path: the load (and an export) used to
    follow it out of the checkpoint folder and load whatever was there; now refused, naming the file, what it
    holds, the rule and the checkpoints that are there. A tag passed to the load follows the same rule as a
    saved one; the engine is untouched."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    with offload.initialize(make(), config(tmp_path)) as engine:
        step(engine, batches(1)[0])
        engine.save_checkpoint(root, tag="a")
        engine.save_checkpoint(elsewhere, tag="step4")  # a complete checkpoint the crafted names reach
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "meta.json").write_text((elsewhere / "step4" / "meta.json").read_text())
        for content in ("../elsewhere/step4", "../x", str(elsewhere / "step4"), "latest", ".tmp-a-1"):
            (root / "latest").write_text(content + "\n")
            refused = (rf"{re.escape(str(root / 'latest'))} holds {re.escape(repr(content))}, which is not a plain "
                       rf"name \(.*\): latest names a checkpoint's folder inside {re.escape(str(root))}, never a "
                       rf"path elsewhere.*the checkpoints in {re.escape(str(root))}, newest first: \['a'\]")
            with pytest.raises(ValueError, match=refused):
                engine.load_checkpoint(root)
            with pytest.raises(ValueError, match=refused):
                export(root, tmp_path / "out.pt")
            assert engine.phase is offload.Phase.IDLE
        for tag in ("../elsewhere/step4", str(elsewhere / "step4"), "..", ""):
            with pytest.raises(ValueError, match=rf"checkpoint tag {re.escape(repr(tag))} \(passed as tag\) must "
                                                 r"be a plain name \(not empty, no '/' or NUL, not starting with "
                                                 r"'\.', not 'latest'\)"):
                engine.load_checkpoint(root, tag=tag)
            with pytest.raises(ValueError, match=rf"save_checkpoint: tag {re.escape(repr(tag))} must be a plain "
                                                 "name"):
                engine.save_checkpoint(root, tag=tag)
        (root / "latest").write_text("a")
        assert engine.load_checkpoint(root)[0] == root / "a"
        step(engine, batches(2)[1])


def test_an_empty_or_missing_latest_is_named_as_such(tmp_path):
    """An empty ``latest`` was reported as a missing meta.json of the checkpoint folder itself (the folder named
    after nothing); now it is named as empty, with the likely cause and the tags to pass instead. A missing one,
    and one naming a folder that is gone, say so and list them too."""
    root = tmp_path / "ckpt"
    with offload.initialize(make(), config(tmp_path)) as engine:
        step(engine, batches(1)[0])
        engine.save_checkpoint(root, tag="a")
        engine.save_checkpoint(root, tag="b")
        listed = rf"the checkpoints in {re.escape(str(root))}, newest first: \['b', 'a'\]"
        for content in ("", "\n", "  \n"):
            (root / "latest").write_text(content)
            with pytest.raises(ValueError, match=rf"{re.escape(str(root / 'latest'))} is empty, so it names no "
                                                 rf"checkpoint: the save that wrote it was cut short\?.*Pass tag= of "
                                                 rf"a checkpoint that exists: {listed}"):
                engine.load_checkpoint(root)
        (root / "latest").write_text("gone")
        with pytest.raises(FileNotFoundError, match=rf"checkpoint {re.escape(str(root / 'gone'))} \(named by "
                                                    rf"{re.escape(str(root / 'latest'))}\) is missing or incomplete "
                                                    rf"\(no meta.json\); pass tag= of one that is complete: {listed}"):
            engine.load_checkpoint(root)
        (root / "latest").unlink()
        with pytest.raises(FileNotFoundError, match=rf"no checkpoint in {re.escape(str(root))}: "
                                                    rf"{re.escape(str(root / 'latest'))} does not exist; pass tag=: "
                                                    rf"{listed}"):
            engine.load_checkpoint(root)
        with pytest.raises(FileNotFoundError, match=rf"no checkpoint in {re.escape(str(tmp_path / 'none'))}: that "
                                                    "folder does not exist"):
            engine.load_checkpoint(tmp_path / "none")
        assert engine.load_checkpoint(root, tag="a")[0] == root / "a"


def test_a_load_that_fails_its_checksums_refuses_forwards_until_a_good_load(tmp_path):
    """A byte of a weight flipped in tensors.bin after the save: the load fails its checksum after it began
    overwriting the engine's state, and the engine is FAILED. Backward and saves were refused, but a forward (the
    engine's, or the model's own) still ran on the half-loaded weights; now it is refused too, naming the failure
    and the way out. A good load ends it: forwards give what they gave before, and training goes on."""
    data = batches(3)
    x = data[2][0]
    with offload.initialize(make(), config(tmp_path)) as engine:
        step(engine, data[0])
        with torch.no_grad():
            before = engine(x).cpu()
        engine.save_checkpoint(tmp_path / "ckpt", tag="good")
        bad = engine.save_checkpoint(tmp_path / "ckpt", tag="bad")
        where = json.loads((bad / "index.0.json").read_text())["param/blocks.0.qkv.weight"]["offset"] + 4 * 5 + 2
        with open(bad / "tensors.bin", "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(ValueError, match="does not match the checksum written with it"):
            engine.load_checkpoint(tmp_path / "ckpt", tag="bad")
        assert engine.phase is offload.Phase.FAILED
        refused = (r": engine.load_checkpoint raised ValueError: checkpoint .*tensors.bin: param/blocks.0.qkv.weight"
                   r".*does not match the checksum.*half updated; load a checkpoint \(engine.load_checkpoint: one "
                   r"that succeeds ends this\) or close the engine")
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="the forward" + refused):
                engine(x)
            with pytest.raises(RuntimeError, match="the forward" + refused):
                engine.module(x.to(engine.device))
        with pytest.raises(RuntimeError, match=r"engine.save_checkpoint\(\)" + refused):
            engine.save_checkpoint(tmp_path / "ckpt", tag="after")
        assert engine.load_checkpoint(tmp_path / "ckpt", tag="good")[0].name == "good"
        with torch.no_grad():
            assert torch.equal(engine(x).cpu(), before)
            assert torch.equal(engine.module(x.to(engine.device)).cpu(), before)
        step(engine, data[1])
        assert engine.global_steps == 2


KILLED_MID_SAVE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import offload
    from offload.persist._format import TensorFile
    from models import batches, lm_loss, make
    engine = offload.initialize(make(), {cfg!r})
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint({root!r}, tag="a")
    write = TensorFile.write

    def held(self, *args, **kwargs):  # the first tensor of the next save written: the parent kills us here
        write(self, *args, **kwargs)
        print("MID", flush=True)
        time.sleep(120)

    TensorFile.write = held
    engine.save_checkpoint({root!r}, tag="b")
""")


def test_a_save_killed_midway_leaves_a_folder_that_a_save_of_another_tag_removes(tmp_path):
    """A process SIGKILLed while it wrote checkpoint ``b`` leaves ``.tmp-b-PID`` (a checkpoint's size), which only a
    later save of ``b`` removed; now any save into the folder does. A load is not misled by it meanwhile (latest's
    ``a`` loads; the folder is no tag). Kept: the temporary folder of a live process, one whose owner ran on another
    host (a shared filesystem: its pid says nothing here), and one of another tag without an owner record."""
    root = tmp_path / "ckpt"
    script = KILLED_MID_SAVE.format(tests=str(Path(__file__).resolve().parent.parent), cfg=config(tmp_path),
                                    root=str(root))
    with open(tmp_path / "child.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            assert proc.stdout.readline().strip() == "MID", (tmp_path / "child.err").read_text()[-3000:]
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.wait()
    killed = root / f".tmp-b-{proc.pid}"
    assert (killed / "tensors.bin").stat().st_size > 0 and (killed / ".owner").exists()
    assert (root / "latest").read_text() == "a"
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    elsewhere = root / f".tmp-c-{dead}"  # another host's save, on a filesystem both mount
    elsewhere.mkdir()
    write_owner(elsewhere)
    owner = json.loads((elsewhere / ".owner").read_text())
    (elsewhere / ".owner").write_text(json.dumps({**owner, "host": owner["host"] + "-other", "pid": dead}))
    live = root / f".tmp-e-{os.getpid()}"  # a save in progress (this process's)
    live.mkdir()
    write_owner(live)
    unrecorded = root / f".tmp-f-{dead}"  # of a version that wrote no owner record: only a save of "f" removes it
    unrecorded.mkdir()
    with offload.initialize(make(seed=3), config(tmp_path)) as engine:
        assert engine.load_checkpoint(root)[0] == root / "a"
        with pytest.raises(ValueError, match=rf"checkpoint tag '{killed.name}' \(passed as tag\) must be a plain "
                                             r"name .*a '\.tmp-' folder is a save that did not complete"):
            engine.load_checkpoint(root, tag=killed.name)
        engine.save_checkpoint(root, tag="d")
        assert sorted(p.name for p in root.iterdir()) == sorted(["a", "d", "latest", elsewhere.name, live.name,
                                                                 unrecorded.name])
        assert sorted(p.name for p in (root / "d").iterdir()) == sorted(p.name for p in (root / "a").iterdir())
        engine.save_checkpoint(root, tag="f")
        assert not unrecorded.exists() and elsewhere.exists() and live.exists()
        assert engine.load_checkpoint(root)[0] == root / "f"
