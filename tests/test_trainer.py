"""transformers' Trainer on the engine (offload.integrations.transformers) against the plain Trainer.

A small GPT-2 (tied embeddings, dropout on) trains through both on the same data, seed and TrainingArguments; the
plain Trainer is the reference. Device-generic: both run on DEVICE (TrainingArguments picks CUDA where present).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import offload  # noqa: E402
from offload.persist import save_checkpoint_folder  # noqa: E402
from offload.integrations.transformers import OffloadTrainer, trainer_config  # noqa: E402
from models import DEVICE, placement_config  # noqa: E402

VOCAB = 64


def dataset(n: int, seq: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def arguments(out, **kw) -> TrainingArguments:
    base = dict(use_cpu=DEVICE.type == "cpu", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=2e-3, weight_decay=0.1, warmup_steps=2, logging_steps=1, report_to=[], seed=0,
                save_strategy="no", disable_tqdm=True)
    base.update(kw)
    if "activation_checkpointing" in base and \
            "activation_checkpointing" not in inspect.signature(TrainingArguments).parameters:
        base["gradient_checkpointing"] = base.pop("activation_checkpointing")  # its name before transformers 5
    return TrainingArguments(str(out), **base)


def nvme(tmp_path, stage: int = 2, params: bool = False) -> dict:
    cfg = {"zero_optimization": {"stage": stage,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "opt")}}}
    if params:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "par")}
    return cfg


def logged(trainer: Trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def matches(plain: Trainer, ours: OffloadTrainer, keys=("loss", "grad_norm", "learning_rate"),
            steps: int | None = None) -> None:
    """The two runs logged the same values, step for step (``steps`` of them, if given)."""
    for key in keys:
        ref, got = logged(plain, key), logged(ours, key)
        assert len(ref) == len(got) == (steps or len(ref)) > 0, key
        for step, (a, b) in enumerate(zip(ref, got)):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), (key, step, a, b)


@pytest.mark.parametrize("stage,params,clip", [(2, False, 0.0), (3, True, 1.0)],
                         ids=["optimizer-nvme-noclip", "params+optimizer-nvme"])
def test_losses_match_the_plain_trainer_step_by_step(tmp_path, stage, params, clip):
    """Two epochs of 5 micro-batches with accumulation 2: windows of 2, 2 and a short 1 each epoch (the boundary
    comes from the Trainer), linear warm-up and decay, weight decay off for biases and norms; clipping at 1.0, or
    off (the logged grad_norm is then the one the updates summed)."""
    data = dataset(20)
    args = dict(num_train_epochs=2, max_grad_norm=clip)
    plain = Trainer(model=gpt2().to(DEVICE), args=arguments(tmp_path / "plain", **args), train_dataset=data)
    plain.train()
    ours = OffloadTrainer(model=gpt2(), args=arguments(tmp_path / "ours", **args), train_dataset=data,
                          offload_config=nvme(tmp_path, stage, params))
    try:
        ours.train()
        assert ours.engine.global_steps == plain.state.global_step == 6
        matches(plain, ours, steps=6)
        ref_eval = plain.evaluate(dataset(8, seed=5))["eval_loss"]
        assert math.isclose(ours.evaluate(dataset(8, seed=5))["eval_loss"], ref_eval, rel_tol=1e-5)
    finally:
        if ours.engine is not None:
            ours.engine.close()


def test_resume_from_a_trainer_checkpoint_is_bit_identical(tmp_path):
    """4 steps straight, against 2 steps, a checkpoint (save_steps) and a new trainer that resumes from it. Each
    trainer is built just before it trains (Trainer.__init__ seeds the RNG that dropout and the sampler draw)."""
    data = dataset(32)
    trainers = []

    def run(name, model, resume=None, **kw):
        t = OffloadTrainer(model=model, args=arguments(tmp_path / name, max_steps=4, **kw), train_dataset=data,
                           offload_config=nvme(tmp_path / f"nvme-{len(trainers)}"))
        trainers.append(t)
        t.train(resume_from_checkpoint=resume)
        return t

    try:
        straight = run("a", gpt2())
        run("b", gpt2(), save_strategy="steps", save_steps=2)
        checkpoint = tmp_path / "b" / "checkpoint-2"
        assert (checkpoint / "offload_state" / "latest").exists() and (checkpoint / "model.safetensors").exists()
        with pytest.raises(FileNotFoundError, match="is a Trainer checkpoint folder: pass .*offload_state"):
            save_checkpoint_folder(checkpoint, tmp_path / "exported")  # `offload export` of the Trainer's folder
        resumed = run("b", gpt2(seed=7), resume=str(checkpoint), save_strategy="steps", save_steps=2)
        assert logged(resumed, "loss")[2:] == logged(straight, "loss")[2:]
        assert logged(resumed, "grad_norm")[2:] == logged(straight, "grad_norm")[2:]
        assert logged(resumed, "learning_rate")[2:] == logged(straight, "learning_rate")[2:]
        assert len(logged(resumed, "loss")) == 4  # 2 from the checkpoint's trainer_state, 2 trained
        a, b = straight.engine.consolidated_state_dict(), resumed.engine.consolidated_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        for t in trainers:
            if t.engine is not None:
                t.engine.close()


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["one-file", "sharded"])
def test_saved_folder_loads_with_from_pretrained(tmp_path, shard):
    kw = {} if shard is None else {"save_max_shard_size": shard}
    trainer = OffloadTrainer(model=gpt2(), args=arguments(tmp_path / "run", max_steps=2), train_dataset=dataset(16),
                             offload_config=nvme(tmp_path, 3, params=True), **kw)
    try:
        trainer.train()
        trainer.save_model(str(tmp_path / "saved"))
        files = sorted(p.name for p in (tmp_path / "saved").iterdir())
        assert "config.json" in files
        assert json.loads((tmp_path / "saved" / "config.json").read_text())["dtype"] == "float32"  # the masters
        if shard is None:
            assert "model.safetensors" in files
        else:
            index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
            shards = set(index["weight_map"].values())
            assert len(shards) > 2 and shards <= set(files) and "model.safetensors" not in files
        loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved")).to(DEVICE).eval()
        x = dataset(2, seed=3)[0]["input_ids"][None]
        trainer.model.eval()
        with torch.no_grad():
            want = trainer.model(x).logits.cpu()
            got = loaded(x.to(DEVICE)).logits.cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        if trainer.engine is not None:
            trainer.engine.close()


def test_config_scheduler_with_auto_values(tmp_path):
    """The config's WarmupDecayLR, its "auto" values from TrainingArguments and the step count (DeepSpeed's
    formula, log warm-up), stepped once per optimizer step as DeepSpeed steps it: update t takes g(t - 1), the
    first two warmup_min_lr."""
    cfg = {**nvme(tmp_path), "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    trainer = OffloadTrainer(model=gpt2(), args=arguments(tmp_path / "run", max_steps=6, warmup_steps=3),
                             train_dataset=dataset(48), offload_config=cfg)
    try:
        trainer.train()
        lr, warm, total = 2e-3, 3, 6
        want = [0.0 if t == 0 else lr * (math.log(t) / math.log(warm) if t - 1 < warm else
                                         (total - t + 1) / (total - warm)) for t in range(total)]
        got = logged(trainer, "learning_rate")
        assert len(got) == total
        for a, b in zip(got, want):
            assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    finally:
        if trainer.engine is not None:
            trainer.engine.close()


def test_config_values_that_disagree_with_training_arguments_are_errors(tmp_path):
    args = arguments(tmp_path)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps = 4 but TrainingArguments"):
        trainer_config({"gradient_accumulation_steps": 4}, args)
    with pytest.raises(ValueError, match=r"optimizer.params.lr = 0.1 but TrainingArguments.learning_rate"):
        trainer_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, args)
    with pytest.raises(ValueError, match=r"lr = '0.002' \(a str, where a float is meant\) but TrainingArguments"):
        trainer_config({"optimizer": {"type": "AdamW", "params": {"lr": "0.002"}}}, args)
    with pytest.raises(ValueError, match=r"optim='sgd'.*adamw_torch"):
        trainer_config({}, arguments(tmp_path, optim="sgd"))
    with pytest.raises(ValueError, match=r"scheduler.type"):
        trainer_config({"scheduler": {"type": "OneCycle", "params": {}}}, args)
    cfg, scheduler = trainer_config({"gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}, args)
    assert (cfg.gradient_accumulation_steps, cfg.gradient_clipping, cfg.optimizer.lr) == (2, 1.0, 2e-3)
    assert cfg.offload.comm_timeout == args.ddp_timeout == 1800
    assert trainer_config({}, arguments(tmp_path, ddp_timeout=90))[0].offload.comm_timeout == 90
    with pytest.raises(ValueError, match=r"offload.comm_timeout = 60 but TrainingArguments.ddp_timeout = 1800"):
        trainer_config({"offload": {"comm_timeout": 60}}, args)
    assert cfg.optimizer.weight_decay == 0.1 and not cfg.bf16.enabled and scheduler is None
    with pytest.raises(ValueError, match=r"leave out optimizers"):
        OffloadTrainer(model=gpt2(), args=args, train_dataset=dataset(4),
                       optimizers=(torch.optim.SGD(gpt2().parameters(), lr=0.1), None))
    # TrainingArguments(deepspeed=...) needs deepspeed installed to be built: set after, as it would read
    args.deepspeed = "ds.json"
    with pytest.raises(ValueError, match=r"TrainingArguments.deepspeed = 'ds.json': .* offload_config="):
        OffloadTrainer(model=gpt2(), args=args, train_dataset=dataset(4))


def test_a_trainer_without_the_hooks_of_transformers_5_3_is_refused(tmp_path, monkeypatch):
    """transformers 5.0-5.2 have no Trainer._clip_grad_norm (nor _prepare_for_training, _get_grad_norm): the
    engine's clipping and norms would be bypassed without a word, and 5.0 trained to other losses."""
    from transformers import Trainer

    monkeypatch.delattr(Trainer, "_clip_grad_norm")
    with pytest.raises(RuntimeError, match=r"needs transformers >= 5.3 \(its Trainer._clip_grad_norm .*"
                                           r"pip install 'transformers>=5.3'"):
        OffloadTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=dataset(4))


TWO_RANKS = textwrap.dedent("""
    import json, os, pathlib, sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from offload.integrations.transformers import OffloadTrainer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{{"input_ids": x, "labels": x}} for x in ids]
    args = TrainingArguments({out!r}, use_cpu=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                             ddp_backend="gloo", ddp_timeout=120)  # a call on one rank only: a CommError, no hang
    if {plain}:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    else:
        # the checkpoint of step 3 lands on an earlier run's (engine state v1), which rank 1 does not see (a shared
        # filesystem's stale listing): the tag of the save must still be rank 0's, v2, on both ranks
        args.save_strategy, args.save_steps = "steps", 3
        pathlib.Path({out!r}, "checkpoint-3", "offload_state", "v1").mkdir(parents=True, exist_ok=True)
        if os.environ["RANK"] == "1":
            listing = pathlib.Path.iterdir
            pathlib.Path.iterdir = lambda self: (p for p in listing(self) if p.name != "v1")
        cfg = {{"zero_optimization": {{"stage": 2, "offload_optimizer": {{"device": "nvme",
                                                                       "nvme_path": {nvme!r}}}}}}}
        trainer = OffloadTrainer(model=model, args=args, train_dataset=data, offload_config=cfg)
        trainer.train()
        assert trainer.engine.world_size == 2
        trainer.close()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if os.environ["RANK"] == "0":
        json.dump({{k: [h[k] for h in logs] for k in ("loss", "grad_norm")}}, open({result!r}, "w"))
    # Both ranks leave the group together: a gloo group still alive at interpreter exit can abort one rank
    # ("terminate called without an active exception") after the results are already written. A rank of the
    # plain Trainer's DDP run still aborted (SIGABRT) after this, twice in six runs of this file here: nothing is
    # left to do once the group is gone, so the process ends without the interpreter's teardown.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(900)  # two torchrun launches of two ranks
def test_two_ranks_under_torchrun_match_the_plain_trainer_with_ddp(tmp_path):
    """torchrun --nproc-per-node 2 (gloo, CPU): OffloadTrainer's engine partitions the optimizer state over the
    ranks in place of DDP; losses and gradient norms equal the plain Trainer's (DDP) step by step."""
    results = {}
    for name in ("plain", "offload"):
        script = tmp_path / f"train_{name}.py"  # not offload.py: the script's folder comes first on sys.path
        script.write_text(TWO_RANKS.format(out=str(tmp_path / name), plain=name == "plain",
                                           nvme=str(tmp_path / "nvme"), result=str(tmp_path / f"{name}.json")))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([shutil.which("torchrun") or "torchrun", "--nproc-per-node", "2", "--master-port",
                               str(free_port()), str(script)], capture_output=True, text=True, timeout=300, env=env,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    state = tmp_path / "offload" / "checkpoint-3" / "offload_state"
    assert (state / "latest").read_text().strip() == "v2"
    assert sorted(p.name for p in state.iterdir()) == ["latest", "v2"]
    assert {"index.0.json", "index.1.json"} <= {p.name for p in (state / "v2").iterdir()}  # both ranks' shards
    for key in ("loss", "grad_norm"):
        assert len(results["offload"][key]) == 3
        for a, b in zip(results["plain"][key], results["offload"][key]):
            assert math.isclose(a, b, rel_tol=1e-5), (key, a, b)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_evaluation_before_training_and_the_best_checkpoint(tmp_path, precision, caplog):
    """bf16 or fp16 through TrainingArguments (the engine's half-precision parameters with fp32 masters and, for
    fp16, its loss scaling; no autocast, no GradScaler), evaluate() before train() (builds the engine), and
    load_best_model_at_end (the best checkpoint's weights into the engine). Arguments changed after that
    evaluate() are refused at train(), naming them: an engine built again would start from rounded weights.
    save_model after close writes the training dtype's weights, and says so (the masters closed with the engine)."""
    val = dataset(8, seed=5)
    args = arguments(tmp_path / "run", max_steps=4, eval_strategy="steps", eval_steps=2, **{precision: True},
                     save_strategy="steps", save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                     greater_is_better=False)
    model = gpt2()
    config_dtype = model.config.dtype
    with OffloadTrainer(model=model, args=args, train_dataset=dataset(32), eval_dataset=val,
                        offload_config=nvme(tmp_path)) as trainer:
        before = trainer.evaluate()["eval_loss"]
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        assert trainer.engine is not None and trainer.engine.dtype == dtype
        assert getattr(trainer.offload_config, precision).enabled
        trainer.args.learning_rate = 1e-3  # built again, the engine would start from the weights it rounded
        with pytest.raises(ValueError, match=rf"changed after evaluate\(\) built the engine \(optimizer.lr\), and that "
                                             rf"engine trains in {dtype}"):
            trainer.train()
        trainer.args.learning_rate = 2e-3
        trainer.train()
        evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        assert len(evals) == 2 and all(math.isfinite(v) for v in [before, *evals])  # steps 2 and 4
        if precision == "fp16":
            assert trainer.engine.stats()["loss_scale"] > 1 and trainer.accelerator.scaler is None
        best = trainer.state.best_model_checkpoint
        assert best is not None
        from safetensors.torch import load_file

        saved = load_file(str(Path(best) / "model.safetensors"))
        state = trainer.engine.consolidated_state_dict()
        assert all(torch.equal(state[k], v) for k, v in saved.items())
        # the file's config says fp32 (the masters written); the model's own still says what it was
        assert json.loads((Path(best) / "config.json").read_text())["dtype"] == "float32"
        assert model.config.dtype == config_dtype
    trainer.save_model(str(tmp_path / "after"))
    assert f"save_model after close() writes the model's {dtype} training weights".replace("torch.", "") in \
        caplog.text
    after = load_file(str(tmp_path / "after" / "model.safetensors"))
    assert all(v.dtype == dtype and torch.equal(v, state[k].to(dtype)) for k, v in after.items())


def test_resume_from_a_plain_trainer_checkpoint_loads_its_weights(tmp_path, caplog):
    """A checkpoint folder written by transformers' own Trainer: its weights go into the engine, the Adam moments
    start from zero (a warning says so), and the run continues from its step."""
    data = dataset(32)
    plain = Trainer(model=gpt2().to(DEVICE), args=arguments(tmp_path / "plain", max_steps=2, save_strategy="steps",
                                                            save_steps=2), train_dataset=data)
    plain.train()
    checkpoint = tmp_path / "plain" / "checkpoint-2"
    with OffloadTrainer(model=gpt2(seed=3), args=arguments(tmp_path / "plain", max_steps=3), train_dataset=data,
                        offload_config=nvme(tmp_path)) as trainer:
        with caplog.at_level("WARNING", logger="offload"):
            trainer._load_optimizer_and_scheduler(str(checkpoint))
        assert "Adam moments start from zero" in caplog.text
        state = trainer.engine.consolidated_state_dict()
        for name, p in plain.model.named_parameters():
            assert torch.equal(state[name], p.detach().cpu()), name
        trainer.train(resume_from_checkpoint=str(checkpoint))
        assert trainer.state.global_step == 3


def test_fp16_overflow_skips_the_update_and_the_schedule(tmp_path):
    """A loss scale of 2^24 overflows fp16 gradients: those steps update nothing, log a grad_norm of inf or nan, and the
    linear schedule does not advance (accelerate reads the engine optimizer's step_was_skipped)."""
    cfg = {**nvme(tmp_path), "fp16": {"initial_scale_power": 24, "hysteresis": 1}}
    args = arguments(tmp_path / "run", max_steps=8, fp16=True, warmup_steps=0, gradient_accumulation_steps=1)
    with OffloadTrainer(model=gpt2(), args=args, train_dataset=dataset(32), offload_config=cfg) as trainer:
        trainer.train()
        skipped = trainer.engine.stats()["skipped_steps"]
        lrs, norms = logged(trainer, "learning_rate"), logged(trainer, "grad_norm")
    assert 1 <= skipped < 8 and not any(math.isfinite(n) for n in norms[:skipped])  # inf or nan
    assert all(math.isfinite(n) for n in norms[skipped:])
    want = [2e-3] * skipped + [2e-3 * (8 - j) / 8 for j in range(8 - skipped)]
    assert lrs == pytest.approx(want, rel=1e-9)


def test_model_init_and_delayed_update_evaluate_the_newest_weights(tmp_path):
    """model_init: the Trainer swaps in a new model at train(), and the engine built by an earlier evaluate() is
    replaced by one around it. With the delayed update, evaluate() first applies the update in flight: its loss
    equals that of the saved model loaded back with from_pretrained."""
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_update": True}}}
    val = dataset(8, seed=5)
    with OffloadTrainer(model_init=lambda: gpt2(), args=arguments(tmp_path / "run", max_steps=3),
                        train_dataset=dataset(32), eval_dataset=val, offload_config=cfg) as trainer:
        first = trainer.evaluate()["eval_loss"]
        old = trainer.engine
        trainer.train()
        assert trainer.engine is not old and trainer.engine.module is trainer.model
        assert trainer.engine.plan().delayed
        after = trainer.evaluate()["eval_loss"]
        trainer.save_model(str(tmp_path / "saved"))
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved")).to(DEVICE)
    plain = Trainer(model=loaded, args=arguments(tmp_path / "check"), eval_dataset=val)
    assert after != first and math.isclose(plain.evaluate()["eval_loss"], after, rel_tol=1e-6)


def test_activation_checkpointing_through_the_trainer(tmp_path):
    """TrainingArguments(activation_checkpointing=True) with parameters offloaded: each checkpointed block
    fetches its parameters again for the recomputation; losses equal the plain Trainer's with the same setting."""
    data = dataset(16)
    plain = Trainer(model=gpt2().to(DEVICE), args=arguments(tmp_path / "plain", max_steps=2,
                                                            activation_checkpointing=True), train_dataset=data)
    plain.train()
    with OffloadTrainer(model=gpt2(), args=arguments(tmp_path / "ours", max_steps=2, activation_checkpointing=True),
                        train_dataset=data, offload_config=nvme(tmp_path, 3, params=True)) as trainer:
        trainer.train()
        assert trainer.engine.stats()["params"]["fetches"] > 0
        for a, b in zip(logged(plain, "loss"), logged(trainer, "loss"), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5)


@pytest.mark.parametrize("stage,params", [(2, False), pytest.param(3, True, marks=pytest.mark.slow)],  # (17 s; the
                         ids=["optimizer-nvme", "params+optimizer-nvme"])  # compiled window: test_compile.py)
def test_torch_compile_through_the_trainer(tmp_path, stage, params):
    """TrainingArguments(torch_compile=True): the engine's forward runs compiled graphs (it was ignored before),
    losses equal the plain Trainer's compiled the same way, and the saved folder has the model's own names."""
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    data = dataset(16)
    kw = dict(max_steps=3, torch_compile=True, torch_compile_backend="aot_eager")
    torch._dynamo.reset()
    plain = Trainer(model=gpt2().to(DEVICE), args=arguments(tmp_path / "plain", **kw), train_dataset=data)
    plain.train()
    torch._dynamo.reset()  # the engine's run compiles its own graphs (the plain run's guards would still hold)
    counters.clear()
    with OffloadTrainer(model=gpt2(), args=arguments(tmp_path / "ours", **kw), train_dataset=data,
                        offload_config=nvme(tmp_path, stage, params)) as trainer:
        trainer.train()
        assert counters["stats"]["unique_graphs"] > 0 and trainer.model_wrapped._orig_mod is trainer.model
        for a, b in zip(logged(plain, "loss"), logged(trainer, "loss"), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5)
        trainer.save_model(tmp_path / "saved")
    saved = set(load_file(tmp_path / "saved" / "model.safetensors"))
    assert saved == set(plain.model.state_dict()) - {"lm_head.weight"}
    torch._dynamo.reset()


@pytest.mark.parametrize("placement", ["opt-host", "all-nvme"])
def test_save_pretrained_of_the_wrapped_model_round_trips(tmp_path, placement):
    """transformers' own ``model.save_pretrained`` on the engine's model, outside the Trainer: it saves
    ``model.state_dict()``, which with parameters offloaded now holds their values (it held NaN placeholders), so
    ``from_pretrained`` gives a model computing what the engine computes."""
    model = gpt2()
    data = dataset(3)
    with offload.initialize(model, placement_config(tmp_path, placement, live=5000)) as engine:
        for batch in data[:2]:
            out = engine(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
            engine.backward(out.loss)
            engine.step()
        model.save_pretrained(str(tmp_path / "saved"))
        engine.eval()
        with torch.no_grad():
            want = engine(input_ids=data[2]["input_ids"][None]).logits.float().cpu()
    back = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved")).to(DEVICE).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=data[2]["input_ids"][None].to(DEVICE)).logits.float().cpu(), want)


def test_a_subclass_create_optimizer_and_arguments_set_after_construction_are_used(tmp_path):
    """Trainer's documented customisation, a subclass's ``create_optimizer`` (here a 10x lr for the last block, as
    LoRA+ raises the lr of some weights), gives the engine its groups; and TrainingArguments changed after
    construction (as a hyperparameter search's trial sets them) reach the engine built at train(), even after an
    evaluate() built one before them. Before, the override was never called and the engine kept the arguments of
    construction (or of that evaluate), both without a word."""
    def custom(base):
        class Custom(base):
            def create_optimizer(self, model=None):
                if self.optimizer is None:  # every parameter, the frozen one too: torch's AdamW takes it
                    named = list(self.model.named_parameters())
                    last = [p for n, p in named if n.startswith("transformer.h.1.")]
                    rest = [p for n, p in named if not n.startswith("transformer.h.1.")]
                    self.optimizer = torch.optim.AdamW(
                        [{"params": rest}, {"params": last, "lr": 10 * self.args.learning_rate}],
                        lr=self.args.learning_rate, weight_decay=self.args.weight_decay, betas=(0.9, 0.95))
                return self.optimizer
        return Custom

    data = dataset(12)
    runs = []
    for cls, extra in ((Trainer, {}), (OffloadTrainer, {"offload_config": {"zero_optimization": {
            "offload_optimizer": {"device": "cpu"}}}})):
        model = gpt2().to(DEVICE) if cls is Trainer else gpt2()
        model.transformer.wpe.weight.requires_grad_(False)
        trainer = custom(cls)(model=model, args=arguments(tmp_path / cls.__name__, max_steps=3), train_dataset=data,
                              **extra)
        trainer.evaluate(dataset(4, seed=5))  # a baseline first, as in a notebook: it builds the engine
        trainer.args.learning_rate, trainer.args.weight_decay, trainer.args.max_grad_norm = 5e-3, 0.5, 0.1
        trainer.train()
        runs.append(trainer)
    plain, ours = runs
    try:
        assert [g["lr"] for g in ours.optimizer.param_groups] == [g["lr"] for g in plain.optimizer.param_groups]
        assert ours.engine.config.gradient_clipping == 0.1
        matches(plain, ours)
        with pytest.raises(RuntimeError, match="Adam's state lives in its tiers.*trainer.engine.save_checkpoint"):
            ours.optimizer.state_dict()  # (an empty one would read as no state at all)
        ours._tune_save_checkpoint(str(tmp_path / "tune"))  # a Ray Tune trial's save: the engine's state instead
        trial = tmp_path / "tune" / "checkpoint-3"
        assert (trial / "offload_state" / "latest").exists() and (trial / "trainer_state.json").exists()
        assert (trial / "model.safetensors").exists()
    finally:
        ours.close()


def test_an_interrupted_train_leaves_no_half_window_and_delayed_updates_are_in_after_train(tmp_path):
    """A train() interrupted after the first micro-batch of a window (Ctrl-C) and run again: the plain Trainer's
    model.zero_grad() drops that micro-batch's gradients, and the engine's window is dropped alike (before, the
    next window added to it). With the delayed update, the model after train() holds the last update (before, the
    update stayed on the host: generate() or model.save_pretrained() used the step before)."""
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        armed = True

        def on_substep_end(self, *args, **kwargs):
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt("after micro-batch 1 of 2")

    data = dataset(16)
    runs = []
    for cls, extra in ((Trainer, {}), (OffloadTrainer, {"offload_config": {"zero_optimization": {
            "offload_optimizer": {"device": "cpu"}}}})):
        model = gpt2().to(DEVICE) if cls is Trainer else gpt2()
        trainer = cls(model=model, args=arguments(tmp_path / cls.__name__, max_steps=3, max_grad_norm=0.0),
                      train_dataset=data, callbacks=[Interrupt()], **extra)
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        trainer.train()
        runs.append(trainer)
    plain, ours = runs
    try:
        matches(plain, ours, keys=("loss", "grad_norm"))
    finally:
        ours.close()
    delayed = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "delayed_update": True}}}
    with OffloadTrainer(model=gpt2(), args=arguments(tmp_path / "delayed", max_steps=3), train_dataset=data,
                        offload_config=delayed) as trainer:
        trainer.train()
        masters = trainer.engine.consolidated_state_dict()
        for name, p in trainer.model.named_parameters():
            assert torch.equal(p.detach().cpu().float(), masters[name].to(p.dtype).float()), name


def test_a_train_interrupted_after_its_updates_started_says_how_to_go_on(tmp_path):
    """Ctrl-C between a window's last backward (which started its updates) and the optimizer step: the next
    train() cannot drop that window and says so, naming the resume and engine.step(); a resume from the checkpoint
    before it trains on to the end."""
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise KeyboardInterrupt("before the optimizer step")

    cfg = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    args = arguments(tmp_path / "run", max_steps=3, max_grad_norm=0.0, save_strategy="steps", save_steps=1)
    with OffloadTrainer(model=gpt2(), args=args, train_dataset=dataset(16), callbacks=[Interrupt()],
                        offload_config=cfg) as trainer:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        with pytest.raises(RuntimeError, match=r"resume from a checkpoint .* trainer\.engine\.step\(\)"):
            trainer.train()
        trainer.callback_handler.pop_callback(Interrupt)
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
        assert trainer.state.global_step == trainer.engine.global_steps == 3


def test_an_incomplete_checkpoint_is_removed_before_rotation_counts_it(tmp_path, caplog):
    """save_total_limit=1 over an output folder holding what a killed save left (checkpoint-100 of a run with other
    save_steps: its weights, the engine's shard folder never committed, no trainer_state.json), newest by its time
    as by its number (the Trainer's rotation sorts by mtime, or by number when the times are under a second
    apart): rotation protected it as the newest and deleted the checkpoint just saved, leaving no complete one.
    The save removes it first."""
    out = tmp_path / "run"
    cut = out / "checkpoint-100"
    (cut / "offload_state" / ".tmp-v1-999999").mkdir(parents=True)
    (cut / "model.safetensors").write_bytes(b"")
    later = cut.stat().st_mtime + 3600
    os.utime(cut, (later, later))
    args = arguments(out, max_steps=2, save_strategy="steps", save_steps=2, save_total_limit=1)
    with OffloadTrainer(model=gpt2(), args=args, train_dataset=dataset(16),
                        offload_config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) as trainer:
        with caplog.at_level("WARNING", logger="offload"):
            trainer.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    assert f"removing {cut}, an incomplete checkpoint (a save killed midway): it lacks trainer_state.json" \
        in caplog.text
    state = out / "checkpoint-2" / "offload_state"
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert (state / (state / "latest").read_text().strip() / "meta.json").is_file()


REMOTE_MODEL = textwrap.dedent("""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    class TinyConfig(PretrainedConfig):
        model_type = "tiny-remote"

        def __init__(self, vocab=64, width=16, **kw):
            self.vocab, self.width = vocab, width
            super().__init__(**kw)

    class TinyModel(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.emb = torch.nn.Embedding(config.vocab, config.width)
            self.out = torch.nn.Linear(config.width, config.vocab)
            self.post_init()

        def forward(self, input_ids, labels=None):
            logits = self.out(self.emb(input_ids))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None \\
                else None
            return {"loss": loss, "logits": logits}
""")


def test_save_model_of_a_remote_code_model_carries_its_code_and_full_eval_keeps_the_engine(tmp_path):
    """A model built with trust_remote_code (its class from a modelling file beside its config): save_model copies
    that file and the config's auto_map as save_pretrained does, so the folder loads back the same way. And
    bf16_full_eval on an fp32 run: the Trainer would cast the model for evaluation, taking its parameters from the
    engine (evaluate() raised); the engine's model evaluates in its own dtype instead."""
    from transformers import AutoConfig, AutoModel

    src = tmp_path / "src"
    src.mkdir()
    (src / "modeling_tiny.py").write_text(REMOTE_MODEL)
    (src / "config.json").write_text(json.dumps({
        "model_type": "tiny-remote", "vocab": VOCAB, "width": 16, "architectures": ["TinyModel"],
        "auto_map": {"AutoConfig": "modeling_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}}))
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.from_pretrained(str(src), trust_remote_code=True), trust_remote_code=True)
    val = dataset(8, seed=5)
    with OffloadTrainer(model=model, args=arguments(tmp_path / "run", max_steps=2, bf16_full_eval=True),
                        train_dataset=dataset(8), eval_dataset=val,
                        offload_config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) as trainer:
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        after = trainer.evaluate()["eval_loss"]
        trainer.save_model(str(tmp_path / "saved"))
        want = trainer.engine.consolidated_state_dict()
        assert trainer.engine.dtype == torch.float32 and math.isfinite(before) and after != before
    assert (tmp_path / "saved" / "modeling_tiny.py").exists()
    loaded = AutoModel.from_pretrained(str(tmp_path / "saved"), trust_remote_code=True)
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, want[name]), name


@pytest.mark.slow  # 31 s here: three torchrun launches of two ranks
@pytest.mark.timeout(900)
def test_two_ranks_resume_after_a_crash_and_the_best_checkpoint_under_torchrun(tmp_path):
    """torchrun, 2 ranks, ZeRO-3 on NVMe, eval and save every 2 steps, save_total_limit=2, load_best_model_at_end: a
    run killed inside its step-6 save (the engine's state committed, no trainer_state.json yet) and resumed
    (resume_from_checkpoint=True: from checkpoint-4, the newest complete one, on both ranks) logs steps 5-6
    bit-identically to an uninterrupted run; save_model on every rank writes the best checkpoint's weights."""
    script = tmp_path / "train_two.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
        from offload.integrations.transformers import OffloadTrainer
        out, die, result = sys.argv[1], sys.argv[2] == "die", sys.argv[3]
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                           bos_token_id=0, eos_token_id=0))
        rows = lambda n, s: [{"input_ids": x, "labels": x}
                             for x in torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(s))]
        args = TrainingArguments(out, use_cpu=True, ddp_backend="gloo", ddp_timeout=120, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, per_device_eval_batch_size=3, max_steps=6,
                                 learning_rate=2e-3, warmup_steps=1, logging_steps=1, report_to=[], disable_tqdm=True,
                                 eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                                 save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="eval_loss")
        zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": out + "_opt"},
                "offload_param": {"device": "nvme", "nvme_path": out + "_par"}}
        trainer = OffloadTrainer(model=model, args=args, train_dataset=rows(64, 0), eval_dataset=rows(10, 1),
                                 offload_config={"zero_optimization": zero})
        save_rng_state = OffloadTrainer._save_rng_state
        def crash(self, output_dir):  # both ranks die inside the step-6 save, before trainer_state.json
            save_rng_state(self, output_dir)
            if die and self.state.global_step == 6:
                torch.distributed.barrier(); sys.stdout.flush(); os._exit(0)
        OffloadTrainer._save_rng_state = crash
        trainer.train(resume_from_checkpoint=os.path.isdir(os.path.join(out, "checkpoint-6")))
        trainer.save_model(out + "_model")  # every rank
        res = {"logs": list(trainer.state.log_history), "best": trainer.state.best_model_checkpoint,
               "eval": trainer.evaluate()["eval_loss"], "ckpts": sorted(os.listdir(out))}
        trainer.close()
        if os.environ["RANK"] == "0":
            json.dump(res, open(result, "w"))
        torch.distributed.barrier(); torch.distributed.destroy_process_group(); sys.stdout.flush(); os._exit(0)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    for run, mode in (("full", "go"), ("cut", "die"), ("cut", "go")):
        done = subprocess.run([shutil.which("torchrun") or "torchrun", "--nproc-per-node", "2", "--master-port",
                               str(free_port()), str(script), str(tmp_path / run), mode, str(tmp_path / f"{run}.json")],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        if mode == "die":  # what transformers' get_last_checkpoint takes, and then fails on
            cut6 = tmp_path / run / "checkpoint-6"
            assert (cut6 / "offload_state" / "latest").exists() and not (cut6 / "trainer_state.json").exists()
    full, cut = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("full", "cut"))
    logs = lambda r: [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
                      for h in r["logs"] if "train_runtime" not in h]  # 6 steps' and 3 evaluations' logs
    assert logs(cut) == logs(full) and len(logs(full)) == 9 and cut["ckpts"] == ["checkpoint-2", "checkpoint-6"]
    assert cut["best"] == str(tmp_path / "cut" / "checkpoint-2")  # eval loss rises on this data: step 2 is best
    from safetensors.torch import load_file

    best = load_file(str(tmp_path / "cut" / "checkpoint-2" / "model.safetensors"))
    for run in ("full", "cut"):
        saved = load_file(str(tmp_path / f"{run}_model" / "model.safetensors"))
        assert saved.keys() == best.keys() and all(torch.equal(saved[k], best[k]) for k in best)
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "cut_model")).state_dict()
    assert all(torch.equal(model[k], v) for k, v in best.items())
    assert cut["eval"] == full["eval"] == min(h["eval_loss"] for h in full["logs"] if "eval_loss" in h)
