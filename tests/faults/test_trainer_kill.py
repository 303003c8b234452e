"""SIGKILL of an OffloadTrainer run in the middle of a checkpoint save, then ``train(resume_from_checkpoint=True)``.

A child process trains a tiny GPT-2 for STEPS steps, saving every SAVE_EVERY, and kills itself (a real SIGKILL) at
one chosen point of the save of checkpoint-KILLED_AT: the environment variable KILL names the point, and a patch
in the child enters it deterministically (a function of the save entered or left), not after a delay. A new
process (each run is forked from one that imported torch and transformers once: _faults.Forks) resumes with
``resume_from_checkpoint=True``: it must continue from the newest COMPLETE checkpoint (transformers alone takes
checkpoint-KILLED_AT, complete or not, and fails on its missing trainer_state.json) and end with parameters
bitwise equal to a run that was never killed; with ``save_total_limit=1`` the run must never be left without a
complete checkpoint.
"""

from __future__ import annotations

import json
import re
import signal
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _faults import Forks  # noqa: E402
from offload.integrations.transformers import OffloadTrainer  # noqa: E402
from models import DEVICE  # noqa: E402

STEPS, SAVE_EVERY, KILLED_AT = 6, 2, 4
TESTS = str(Path(__file__).resolve().parent.parent)

# where in the save of checkpoint-KILLED_AT the child kills itself, in the order the save reaches them: the
# checkpoint the resume must start from, a file the kill left there and one it had not written yet (or removed)
POINTS = {
    # the model's safetensors written to its temporary file, not yet renamed
    "model-write": (2, "checkpoint-4/.model.safetensors.tmp-*", "checkpoint-4/model.safetensors"),
    # the engine's shard half written (its second tensor)
    "engine-shard": (2, "checkpoint-4/offload_state/.tmp-v1-*/tensors.bin", "checkpoint-4/offload_state/v1"),
    # the engine's tag folder renamed into place, ``latest`` not yet naming it
    "engine-commit": (2, "checkpoint-4/offload_state/v1/meta.json", "checkpoint-4/offload_state/latest"),
    # the engine's state committed, schedule and RNG saved; no trainer_state.json
    "before-trainer-state": (2, "checkpoint-4/rng_state.pth", "checkpoint-4/trainer_state.json"),
    # trainer_state.json written: complete; rotation not run
    "before-rotation": (4, "checkpoint-2/trainer_state.json", "checkpoint-6"),
    # rotation (save_total_limit) half way through removing checkpoint-2
    "mid-rotation": (4, "checkpoint-2/offload_state/latest", "checkpoint-2/trainer_state.json"),
}
CASES = [(point, limit) for point in POINTS for limit in (None, 1) if limit or point != "mid-rotation"]


CHILD = textwrap.dedent("""
    import json, os, pathlib, shutil, signal, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainerState, TrainingArguments
    from offload.persist import _save
    from offload.persist._format import TensorFile
    import safetensors.torch
    from offload.integrations.transformers import OffloadTrainer
    from models import DEVICE

    out, nvme, result, limit = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    steps, every, killed_at = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
    point = os.environ.get("KILL", "")
    trainer = None

    def saving() -> bool:  # inside the save of checkpoint-killed_at
        return trainer is not None and trainer.state.global_step == killed_at

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def after(owner, name, when=lambda *a, **k: True, calls=1):
        real, seen = getattr(owner, name), []
        def patched(*args, **kwargs):
            value = real(*args, **kwargs)
            if saving() and when(*args, **kwargs):
                seen.append(1)
                if len(seen) == calls:
                    die()
            return value
        setattr(owner, name, patched)

    def before(owner, name, when=lambda *a, **k: True):
        real = getattr(owner, name)
        def patched(*args, **kwargs):
            if saving() and when(*args, **kwargs):
                die()
            return real(*args, **kwargs)
        setattr(owner, name, patched)

    if point == "model-write":
        after(safetensors.torch, "save_file")
    elif point == "engine-shard":
        after(TensorFile, "write", calls=2)
    elif point == "engine-commit":
        before(_save, "write_file", when=lambda path, data: pathlib.Path(path).name == ".latest.tmp")
    elif point == "before-trainer-state":
        before(TrainerState, "save_to_json")
    elif point == "before-rotation":
        after(TrainerState, "save_to_json")
    elif point == "mid-rotation":  # rmtree's order is the directory's: take trainer_state.json and the weights
        def cut(path, *args, **kwargs):
            if saving() and pathlib.Path(path).name == f"checkpoint-{killed_at - every}":
                for name in ("trainer_state.json", "model.safetensors"):
                    pathlib.Path(path, name).unlink()
                die()
            return rmtree(path, *args, **kwargs)
        rmtree, shutil.rmtree = shutil.rmtree, cut
    else:
        assert point == "", point

    class Started(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.step = state.global_step

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    args = TrainingArguments(out, use_cpu=DEVICE.type == "cpu", per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=2e-3, weight_decay=0.1, warmup_steps=2,
                             max_steps=steps, save_strategy="steps", save_steps=every, logging_steps=1,
                             save_total_limit=None if limit == "none" else int(limit), report_to=[], seed=0,
                             disable_tqdm=True)
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    started = Started()
    trainer = OffloadTrainer(model=model, args=args, train_dataset=data, offload_config=cfg, callbacks=[started])
    trainer.train(resume_from_checkpoint=os.environ.get("RESUME") == "1")
    torch.save(trainer.engine.consolidated_state_dict(), result + ".pt")
    json.dump({"started_at": started.step}, open(result, "w"))
    trainer.close()
""")


@pytest.fixture(scope="module")
def forks():
    """Every run of this module forked from one process that imported torch, transformers and offload."""
    server = Forks(["safetensors.torch", "transformers", "offload.persist", "offload.integrations.transformers"])
    yield server
    server.close()


def child(forks: Forks, tmp_path: Path, run: str, *, kill: str = "", resume: bool = False,
          limit: int | None = None) -> tuple[int, str]:
    """A training process over output folder ``tmp_path/run`` (its swap files in ``tmp_path/run-nvme``): its exit
    status and output."""
    argv = [TESTS, str(tmp_path / run), str(tmp_path / f"{run}-nvme"), str(tmp_path / f"{run}.json"),
            "none" if limit is None else str(limit), str(STEPS), str(SAVE_EVERY), str(KILLED_AT)]
    log = tmp_path / f"{run}-{'resume' if resume else kill or 'straight'}.log"
    return forks.run(CHILD, argv, log, env={"KILL": kill, "RESUME": "1" if resume else "0"})


def finished(tmp_path: Path, run: str, done: tuple[int, str]) -> tuple[int, dict[str, torch.Tensor]]:
    """The step a finished run started training at, and its final parameters."""
    assert done[0] == 0, done[1][-6000:]
    started = json.loads((tmp_path / f"{run}.json").read_text())["started_at"]
    return started, torch.load(tmp_path / f"{run}.json.pt", weights_only=True)


def complete(folder: Path) -> bool:
    """A checkpoint folder a resume can start from: trainer_state.json, and the engine's state committed."""
    state = folder / "offload_state"
    tag = (state / "latest").read_text().strip() if (state / "latest").exists() else ""
    return (folder / "trainer_state.json").is_file() and bool(tag) and (state / tag / "meta.json").is_file()


@pytest.fixture(scope="module")
def uninterrupted(forks, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The parameters of the run never killed (a forked run too: the same start as the others)."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    started, params = finished(tmp_path, "run", child(forks, tmp_path, "run"))
    assert started == 0
    return params


def kill_and_resume(forks: Forks, tmp_path: Path, point: str, limit: int | None,
                    want: dict[str, torch.Tensor]) -> None:
    killed = child(forks, tmp_path, "run", kill=point, limit=limit)
    assert killed[0] == -signal.SIGKILL, (point, killed[1][-6000:])
    out = tmp_path / "run"
    resume_at, present, absent = POINTS[point]
    assert list(out.glob(present)) and not list(out.glob(absent)), (point, sorted(out.rglob("*")))
    assert (out / f"checkpoint-{KILLED_AT}").is_dir()  # what get_last_checkpoint takes, complete or not
    assert complete(out / f"checkpoint-{KILLED_AT}") == (resume_at == KILLED_AT)

    done = child(forks, tmp_path, "run", resume=True, limit=limit)
    started, params = finished(tmp_path, "run", done)
    assert started == resume_at
    if resume_at < KILLED_AT:
        assert f"skips {out / f'checkpoint-{KILLED_AT}'}, an incomplete checkpoint" in done[1]
    assert params.keys() == want.keys()
    for name in want:
        assert torch.equal(params[name], want[name]), (point, name)
    left = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    kept = [f"checkpoint-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
    assert left == (kept if limit is None else kept[-limit:])
    assert all(complete(out / name) for name in left)


def test_killed_mid_save_resumes_from_the_last_complete_checkpoint(forks, tmp_path, uninterrupted):
    """The default run's case: killed while the engine writes its shard, save_total_limit=1 (the rotation after
    the resumed save must keep the new complete checkpoint, and only it)."""
    kill_and_resume(forks, tmp_path, "engine-shard", 1, uninterrupted)


@pytest.mark.slow  # 11 cases of two runs, each forked, 5-20 s a case here (2.5 min in all)
@pytest.mark.parametrize("point,limit", CASES, ids=[f"{p}-{'limit1' if lim else 'all-kept'}" for p, lim in CASES])
def test_killed_at_each_point_of_a_save_resumes_bit_identically(forks, tmp_path, uninterrupted, point, limit):
    """Each point of the save, with every checkpoint kept and with save_total_limit=1 (rotation: only with it)."""
    kill_and_resume(forks, tmp_path, point, limit, uninterrupted)


def test_resume_from_an_incomplete_folder_names_what_it_lacks_and_the_one_to_use(tmp_path):
    """resume_from_checkpoint=<folder> of a save killed midway (no trainer_state.json, the engine's state not
    committed): an error naming both and the newest complete checkpoint beside it, before anything is loaded."""
    out = tmp_path / "run"
    good, cut = out / "checkpoint-2", out / "checkpoint-4"
    (good / "offload_state" / "v1").mkdir(parents=True)
    (good / "offload_state" / "v1" / "meta.json").write_text("{}")
    (good / "offload_state" / "latest").write_text("v1")
    (good / "trainer_state.json").write_text("{}")
    (cut / "offload_state" / ".tmp-v1-1").mkdir(parents=True)
    (cut / "model.safetensors").write_bytes(b"")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(str(out), use_cpu=DEVICE.type == "cpu", max_steps=6, report_to=[], disable_tqdm=True)
    data = [{"input_ids": torch.zeros(16, dtype=torch.long), "labels": torch.zeros(16, dtype=torch.long)}] * 4
    with OffloadTrainer(model=model, args=args, train_dataset=data,
                        offload_config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) as trainer:
        with pytest.raises(FileNotFoundError, match=rf"resume_from_checkpoint='{re.escape(str(cut))}' is not a "
                                                    r"complete checkpoint .*it lacks trainer_state.json and a "
                                                    r"committed engine state \(offload_state/latest .*resume from "
                                                    rf"{re.escape(str(good))} instead"):
            trainer.train(resume_from_checkpoint=str(cut))
        assert trainer.engine is None and trainer.state.global_step == 0  # refused before anything was built
        (good / "trainer_state.json").unlink()
        with pytest.raises(ValueError, match=rf"resume_from_checkpoint=True: {re.escape(str(out))} holds no "
                                             r"complete checkpoint"):
            trainer.train(resume_from_checkpoint=True)
