"""Security: what the library creates is private (files 0600, directories 0700, whatever the umask) but for the
safetensors export (the artifact others load: it follows the umask, as save_pretrained's files do), a checkpoint is
never unpickled, nothing is written outside the configured directories, and nvme_path is checked at initialize
(created 0700 when missing; a symlink, a file, an unwritable or a too-small filesystem refused with the path named).
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import offload
from models import batches, lm_loss, make
from nvme_swapper import AioConfig, SwapEngine
from offload.ops._cpu_adam import cache_dir as cpu_adam_cache

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def nvme_config(nvme: Path, **optimizer) -> dict:
    return {"zero_optimization": {"sub_group_size": 4096,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), **optimizer}},
            "aio": {"block_size": 1 << 16}}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def train(engine, n: int) -> None:
    for x, y in batches(n):
        engine.backward(lm_loss(engine(x), y))
        engine.step()


@pytest.fixture
def umask_zero():
    old = os.umask(0)
    yield
    os.umask(old)


def test_files_0600_directories_0700_even_with_umask_0(tmp_path, umask_zero):
    nvme, ckpt = tmp_path / "new" / "nvme", tmp_path / "ckpt"
    with offload.initialize(make(), nvme_config(nvme)) as engine:
        assert mode(nvme) == 0o700  # created by initialize
        swap_dirs = list(nvme.iterdir())
        assert swap_dirs and all(mode(d) == 0o700 for d in swap_dirs)
        assert all(mode(f) == 0o600 for d in swap_dirs for f in d.iterdir())
        train(engine, 1)
        tag = engine.save_checkpoint(ckpt)
    assert mode(ckpt) == 0o700 and mode(tag) == 0o700
    assert all(mode(f) == 0o600 for f in ckpt.rglob("*") if f.is_file())
    with SwapEngine(tmp_path / "kept", AioConfig(), keep=True) as engine:
        engine.write("k", torch.ones(10)).wait()
        kept = engine.directory
    assert mode(kept) == 0o700 and {f.name: mode(f) for f in kept.iterdir()} == {"swap.0": 0o600,
                                                                                   "manifest.json": 0o600}


def test_a_safetensors_export_follows_the_umask(tmp_path):
    """safetensors writes its file 0600; an export is read by others (from_pretrained on a shared machine), so its
    files get what the umask gives, like the index beside them and torch.save's."""
    old = os.umask(0o027)
    try:
        with offload.initialize(make(), nvme_config(tmp_path / "nvme")) as engine:
            files = engine.save_safetensors(tmp_path / "one") + engine.save_safetensors(tmp_path / "shards",
                                                                                         max_shard_size="20KB")
    finally:
        os.umask(old)
    assert len(files) > 3 and {f.name.split("-")[0] for f in files} >= {"model.safetensors", "model"}
    assert all(mode(f) == 0o640 for f in files), {f.name: oct(mode(f)) for f in files}


class Payload:
    """Unpickling this creates a file: the proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_loading_a_checkpoint_never_unpickles(tmp_path, monkeypatch):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "PWNED"
    with offload.initialize(make(), nvme_config(tmp_path / "nvme")) as engine:
        train(engine, 2)
        tag = engine.save_checkpoint(ckpt)
        expected = engine.consolidated_state_dict()
    evil = pickle.dumps(Payload(marker))
    for name in ("model.pt", "optimizer.pkl", "pytorch_model.bin", "mp_rank_00_model_states.pt", "data.pkl"):
        (tag / name).write_bytes(evil)
    (ckpt / "evil.pkl").write_bytes(evil)

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    with offload.initialize(make(seed=5), nvme_config(tmp_path / "nvme2")) as engine:
        engine.load_checkpoint(ckpt)
        loaded = engine.consolidated_state_dict()
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k
    assert not marker.exists()

    (tag / "tensors.bin").write_bytes(evil)  # the tensor file itself replaced by a pickle: refused, not run
    with offload.initialize(make(seed=5), nvme_config(tmp_path / "nvme3")) as engine:
        with pytest.raises((ValueError, OSError)):
            engine.load_checkpoint(ckpt)
    assert not marker.exists()


ISOLATED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    sys.path.insert(0, {root!r})
    import offload
    from models import batches, lm_loss, make
    cfg = {{"zero_optimization": {{"sub_group_size": 4096, "offload_optimizer": {{"device": "nvme",
            "nvme_path": {nvme!r}}}}}, "aio": {{"block_size": 65536}}}}
    with offload.initialize(make(), cfg) as engine:
        for x, y in batches(3):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint({ckpt!r})
        engine.load_checkpoint({ckpt!r})
    print("DONE", flush=True)
""")


def snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_nothing_is_written_outside_the_configured_directories(tmp_path):
    dirs = {name: tmp_path / name for name in ("home", "tmp", "xdg", "cwd", "nvme", "ckpt", "cache")}
    for d in dirs.values():
        d.mkdir(mode=0o700)
    prebuilt = cpu_adam_cache() / "cpu_adam"
    if prebuilt.is_dir():  # the C++ Adam kernel takes a minute to compile on two cores: start from its build
        shutil.copytree(prebuilt, dirs["cache"] / "cpu_adam", symlinks=True)
    before = snapshot(dirs["cache"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_", "TORCH_EXTENSIONS", "XDG_"))}
    env.update(HOME=str(dirs["home"]), TMPDIR=str(dirs["tmp"]), XDG_CACHE_HOME=str(dirs["xdg"]),
               OFFLOAD_CACHE_DIR=str(dirs["cache"]), PYTHONDONTWRITEBYTECODE="1",
               CUDA_CACHE_DISABLE="1",  # CUDA's kernel JIT cache lives in ~/.nv: CUDA's, not ours
               # torch 2.13 makes $TMPDIR/torchinductor_<user> when torch._dynamo is imported, which any
               # torch.optim.Optimizer does: torch's cache, not ours, put where torch's own variable says
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torchinductor"))
    script = ISOLATED.format(tests=str(TESTS), root=str(ROOT), nvme=str(dirs["nvme"]), ckpt=str(dirs["ckpt"]))
    done = subprocess.run([sys.executable, "-c", script], cwd=dirs["cwd"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-3000:]
    for name in ("home", "tmp", "xdg", "cwd"):
        assert snapshot(dirs[name]) == set(), f"{name} gained files: {sorted(snapshot(dirs[name]))[:10]}"
    assert snapshot(dirs["nvme"]) == set()  # the swap directory is removed at close
    assert any(p.endswith("tensors.bin") for p in snapshot(dirs["ckpt"]))
    gained = snapshot(dirs["cache"]) - before
    assert any(p.startswith("nvme_swapper/") and p.endswith(".so") for p in gained)  # built into the cache dir


# nvme_path checks at initialize ------------------------------------------------------------------------------


def test_missing_nvme_path_is_created_0700(tmp_path, umask_zero):
    nvme = tmp_path / "a" / "b"
    with offload.initialize(make(), nvme_config(nvme)):
        assert mode(nvme) == 0o700


def test_symlinked_nvme_path_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    link = tmp_path / "nvme"
    link.symlink_to(real)
    with pytest.raises(ValueError, match=rf"zero_optimization\.offload_optimizer\.nvme_path '{link}' is a symlink"):
        offload.initialize(make(), nvme_config(link))
    assert list(real.iterdir()) == []


def test_nvme_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=f"offload_optimizer.nvme_path '{f}' exists and is not a directory"):
        offload.initialize(make(), nvme_config(f))
    assert f.read_text() == "x"


def test_param_nvme_path_is_checked_too(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    link = tmp_path / "params"
    link.symlink_to(real)
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(link)}}}
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_param\.nvme_path .* is a symlink"):
        offload.initialize(make(), cfg)


def test_unwritable_nvme_path_is_refused_with_the_path(tmp_path, tmpfs_dir):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_dir)], check=True)
    try:
        with pytest.raises(OSError, match=rf"offload_optimizer\.nvme_path: cannot write in {tmpfs_dir}"):
            offload.initialize(make(), nvme_config(tmpfs_dir))
        with pytest.raises(OSError, match=rf"offload_optimizer\.nvme_path: cannot create {tmpfs_dir / 'sub'}"):
            offload.initialize(make(), nvme_config(tmpfs_dir / "sub"))
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs_dir)], check=True)


def test_nvme_path_without_room_fails_at_initialize_with_numbers(small_ext4):
    model = make(d=256, layers=4)  # about 3.3M parameters: 40 MB of Adam state on a 16 MiB filesystem
    with pytest.raises(offload.BudgetExceeded) as info:
        offload.initialize(model, nvme_config(small_ext4, buffer_count=2))
    msg = str(info.value)
    assert "nvme tier: optimizer state" in msg and str(small_ext4) in msg, msg
    assert "zero_optimization.offload_optimizer.nvme_path" in msg and "B) but" in msg, msg
    assert [p for p in small_ext4.iterdir() if p.name != "lost+found"] == []
