"""engine.save_safetensors: the model as safetensors, sharded with an index as transformers writes them, from
wherever its fp32 masters live; read back with the safetensors library (an independent reader) and compared with
consolidated_state_dict."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors import safe_open

import offload
from models import batches, make, train_steps


def read_folder(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({k: f.get_tensor(k).clone() for k in f.keys()})  # not views of the file's mapping, which
    return out  # would keep its filesystem busy


@pytest.mark.parametrize("params", ["none", "nvme"])
def test_sharded_export_round_trips_and_replaces_an_earlier_one(tmp_path, params):
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "sub_group_size": 4096,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "opt")},
        "offload_param": {"device": params, "nvme_path": str(tmp_path / "par")}}}
    with offload.initialize(make(), cfg) as engine:
        train_steps(engine, batches(2))
        want = engine.consolidated_state_dict()
        out = tmp_path / "out"
        files = engine.save_safetensors(out, max_shard_size="24KB")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert files[-1].name == "model.safetensors.index.json" and len(files) > 3
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for k, t in want.items() if k != "head.weight")
        got = read_folder(out)
        assert set(got) == set(want) - {"head.weight"}  # tied: written once, under its first name
        assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float32 for k in got)
        engine.save_safetensors(out)  # now one file: the shards and the index of the first export go
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
        assert all(torch.equal(v, want[k]) for k, v in read_folder(out).items())
        engine.save_safetensors(out, max_shard_size="24KB")
        assert "model.safetensors" not in {p.name for p in out.iterdir()}
    fresh = make(seed=4)
    offload.load_state_dict(fresh, out)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_save_16bit_model_writes_the_parameters_deepspeed_writes(tmp_path, dtype):
    """DeepSpeed's save_16bit_model: one torch state dict (safetensors for a .safetensors name) with the trainable
    parameters in the training dtype, equal to the model's own parameters on the device (the masters rounded),
    frozen parameters and buffers as they are; without the frozen ones when asked; loaded by torch's safe load."""
    model = make()
    model.pos.requires_grad_(False)
    cfg = {dtype: {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with offload.initialize(model, cfg) as engine:
        train_steps(engine, batches(2))
        masters = engine.consolidated_state_dict()
        own = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        path = engine.save_16bit_model(tmp_path / "out")
        engine.save_16bit_model(tmp_path / "out", "model.safetensors", exclude_frozen_parameters=True)
        with pytest.raises(ValueError, match="save_filename must be a file name inside save_dir"):
            engine.save_16bit_model(tmp_path, "out/x.bin")
    assert path == tmp_path / "out" / "pytorch_model.bin"
    saved = torch.load(path, weights_only=True)
    want_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert sorted(saved) == sorted(own)
    for k, v in saved.items():
        assert torch.equal(v, own[k]), k  # the parameters the model computes with
        if k != "pos":
            assert v.dtype == want_dtype and torch.equal(v, masters[k].to(want_dtype)), k
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(k for k in own if k not in ("pos", "head.weight"))  # tied: once
        assert all(torch.equal(f.get_tensor(k), own[k]) for k in f.keys())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "pytorch_model.bin"]


def test_export_errors(tmp_path):
    with offload.initialize(make(), {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) as engine:
        with pytest.raises(ValueError, match="max_shard_size"):
            engine.save_safetensors(tmp_path, max_shard_size="lots")
        with pytest.raises(ValueError, match="max_shard_size must be positive"):
            engine.save_safetensors(tmp_path, max_shard_size=0)
        # a folder that cannot be made, or a file where the folder goes, is named with the call that wanted it
        (tmp_path / "file").write_text("x")
        with pytest.raises(NotADirectoryError, match=f"save_safetensors: {tmp_path / 'file'} is a file"):
            engine.save_safetensors(tmp_path / "file")
        with pytest.raises(OSError, match=f"save_safetensors: cannot create {tmp_path / 'file' / 'sub'}: "):
            engine.save_safetensors(tmp_path / "file" / "sub")
        with pytest.raises(OSError, match=f"save_checkpoint: cannot create {tmp_path / 'file' / 'ck'}: "):
            engine.save_checkpoint(tmp_path / "file" / "ck")
        assert (tmp_path / "file").read_text() == "x"


def test_tied_weights_keep_the_name_transformers_keeps():
    from offload.persist._export import _unique

    assert _unique({"lm_head.weight": 1, "wte.weight": 1, "b": 2}, frozenset({"lm_head.weight"})) == \
        ["wte.weight", "b"]
    assert _unique({"a": 1, "b": 1, "c": 2}) == ["a", "c"]


def test_a_failed_export_leaves_the_previous_one(tmp_path):
    """An error while a new export is being written (here: reading its second shard) leaves the earlier export
    complete and loadable, and no temporary files behind."""
    from offload.persist._export import write_safetensors

    tensors = {f"t{i}": torch.full((1000,), float(i)) for i in range(6)}
    sizes = [(k, 4000) for k in tensors]
    write_safetensors(tmp_path, sizes, lambda names: {n: tensors[n] for n in names}, max_shard_size=8000)
    before = sorted(p.name for p in tmp_path.iterdir())

    def failing(names):
        if "t2" in names:
            raise OSError("disk full")
        return {n: tensors[n] * 2 for n in names}

    with pytest.raises(OSError, match="disk full"):
        write_safetensors(tmp_path, sizes, failing, max_shard_size=8000)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert all(torch.equal(v, tensors[k]) for k, v in read_folder(tmp_path).items())


def test_an_export_removes_what_a_killed_export_left(tmp_path):
    """A process killed while it wrote an export leaves its hidden temporary file (up to a shard, or the model);
    the next export into that folder removes those of dead processes, and only those."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    out = tmp_path / "out"
    out.mkdir()
    (out / f".model-00001-of-00002.safetensors.tmp-{pid}").write_bytes(b"\0" * 4096)
    (out / f".pytorch_model.bin.tmp-{os.getpid()}-x").write_bytes(b"")  # not the pattern: kept
    mine = out / f".other.safetensors.tmp-{os.getppid()}"  # a live process's: kept
    mine.write_bytes(b"")
    with offload.initialize(make(), {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) as engine:
        engine.save_safetensors(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(["model.safetensors", mine.name,
                                                              f".pytorch_model.bin.tmp-{os.getpid()}-x"])


def test_an_export_that_fills_the_disk_gives_the_space_back(small_ext4):
    """A real ENOSPC from a 16 MiB filesystem midway through a shard: the error is raised, the earlier export stays
    whole and loadable, and the partial shard's temporary file is gone (before, a failing write left it)."""
    out = small_ext4 / "out"
    with offload.initialize(make(d=192), {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) as engine:
        train_steps(engine, batches(1))
        engine.save_safetensors(out)  # 3.6 MB
        want = read_folder(out)
        st = os.statvfs(small_ext4)
        with open(small_ext4 / "filler", "wb") as f:  # leaves 1 MiB: the next export fails midway
            f.truncate(0)
            f.write(b"\0" * (st.f_bavail * st.f_frsize - (1 << 20)))
            os.fsync(f.fileno())
        free = os.statvfs(small_ext4).f_bavail
        with pytest.raises(OSError) as info:
            engine.save_safetensors(out, max_shard_size="2MB")
        assert info.value.errno == errno.ENOSPC, info.value
        assert os.statvfs(small_ext4).f_bavail == free
        # a torch file (save_16bit_model's default) too: the write's OSError, not torch's container error
        with pytest.raises(OSError) as info:
            engine.save_16bit_model(out)
        assert info.value.errno == errno.ENOSPC, info.value
        assert os.statvfs(small_ext4).f_bavail == free
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert all(torch.equal(v, want[k]) for k, v in read_folder(out).items())
