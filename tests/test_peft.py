"""LoRA through peft, the usual way to fine-tune a large model on one GPU: a frozen base, small trainable adapters.

References: the same peft model un-offloaded under torch's AdamW, and transformers' plain Trainer. Before, with
parameters offloaded peft's ``save_pretrained`` wrote NaN adapters (it saves ``model.state_dict()``, then the
placeholders), and ``OffloadTrainer`` saved a peft model as a full model no peft loader reads, with the whole frozen
base in every checkpoint.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

peft = pytest.importorskip("peft", reason="LoRA adapters: peft is in the hf extra")
pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import offload  # noqa: E402
from models import DEVICE, placement_config  # noqa: E402
from offload.integrations.transformers import OffloadTrainer  # noqa: E402
from test_trainer import logged  # noqa: E402

try:  # peft checks the packages beside it as it builds a LoRA layer (0.21 refuses a torchao older than 0.16)
    get_peft_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), LoraConfig(r=1, target_modules=["0"]))
except ImportError as exc:
    pytest.skip(f"peft cannot build a LoRA layer beside the packages installed here: {exc}", allow_module_level=True)

VOCAB = 64


def base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def lora() -> PeftModel:
    """LoRA of rank 4 on the attention's q and v; B drawn too (peft zeros it), so every adapter gets gradients."""
    model = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              lora_dropout=0.0))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu() for n, p in model.named_parameters() if "lora_" in n}


def batches(n: int, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(n)]


@pytest.mark.parametrize("placement", ["opt-host", "params-nvme"])
def test_lora_trains_like_torch_and_peft_saves_the_adapter(tmp_path, placement):
    data = batches(4)
    ref = lora().to(DEVICE)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    ref_losses = []
    for x in data:
        out = ref(input_ids=x.to(DEVICE), labels=x.to(DEVICE))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(out.loss.item())
    model = lora()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    cfg = placement_config(tmp_path, placement, lr=1e-2)
    cfg["optimizer"]["params"]["weight_decay"] = 0.0
    with offload.initialize(model, cfg) as engine:
        losses = []
        for x in data:
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        model.save_pretrained(str(tmp_path / "adapter"))  # peft's own: model.state_dict(), through the engine
        prompt = data[0][:, :5]
        with torch.no_grad():
            generated = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    loaded = PeftModel.from_pretrained(base(), str(tmp_path / "adapter"))
    want = adapters(ref)
    for name, value in adapters(loaded).items():
        assert torch.allclose(value, want[name], rtol=1e-5, atol=1e-7), name
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach().cpu(), frozen[name]), name  # the base did not move
    with torch.no_grad():
        assert torch.equal(generated.cpu(), ref.generate(input_ids=prompt.to(DEVICE), max_new_tokens=4,
                                                         do_sample=False).cpu())


def arguments(out) -> TrainingArguments:
    """Four steps, a checkpoint every two."""
    return TrainingArguments(str(out), use_cpu=DEVICE.type == "cpu", per_device_train_batch_size=4,
                             learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="constant", max_steps=4,
                             logging_steps=1, report_to=[], seed=0, save_strategy="steps", save_steps=2,
                             disable_tqdm=True)


def test_offload_trainer_saves_and_resumes_a_lora_adapter(tmp_path):
    """OffloadTrainer, parameters and optimizer on NVMe, against the plain Trainer: the same losses; save_model
    writes the adapter as the plain Trainer does (peft loads it, equal to the plain Trainer's); a checkpoint's
    engine state leaves the frozen base out, and resuming from it continues bit for bit; a plain Trainer's adapter
    checkpoint resumes too (its weights)."""
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, VOCAB, (32, 12), generator=g)]
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "opt")},
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "par")}}}
    plain = Trainer(model=lora().to(DEVICE), args=arguments(tmp_path / "plain"),
                    train_dataset=data)
    plain.train()
    plain.save_model(str(tmp_path / "plain-saved"))
    trainers = []
    try:
        for name, resume in (("ours", None), ("ours", str(tmp_path / "ours" / "checkpoint-2")),
                             ("from-plain", str(tmp_path / "plain" / "checkpoint-2"))):
            t = OffloadTrainer(model=lora(), args=arguments(tmp_path / name),
                               train_dataset=data, offload_config=cfg)
            trainers.append(t)
            t.train(resume_from_checkpoint=resume)
        straight, resumed, from_plain = trainers
        for a, b in zip(logged(straight, "loss"), logged(plain, "loss")):
            assert math.isclose(a, b, rel_tol=1e-5), (a, b)
        assert logged(resumed, "loss")[2:] == logged(straight, "loss")[2:]
        a, b = straight.engine.consolidated_state_dict(), resumed.engine.consolidated_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        # the plain Trainer's adapter at step 2 (Adam's moments start anew): its next loss is the plain Trainer's
        assert math.isclose(logged(from_plain, "loss")[2], logged(plain, "loss")[2], rel_tol=1e-5)
        straight.save_model(str(tmp_path / "saved"))
        assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == \
            sorted(p.name for p in (tmp_path / "plain-saved").iterdir())
        ours = adapters(PeftModel.from_pretrained(base(), str(tmp_path / "saved")))
        theirs = adapters(PeftModel.from_pretrained(base(), str(tmp_path / "plain-saved")))
        for name in theirs:
            assert torch.allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-6), name
        state = tmp_path / "ours" / "checkpoint-4" / "offload_state"
        meta = json.loads((state / (state / "latest").read_text() / "meta.json").read_text())
        assert meta["frozen_excluded"] and not [n for n in meta["shapes"] if n.startswith("frozen/")]
    finally:
        for t in trainers:
            if t.engine is not None:
                t.engine.close()


@pytest.mark.parametrize("placement", ["opt-host-overlap", "params-nvme"])
def test_a_reference_pass_with_the_adapter_disabled(tmp_path, placement):
    """A DPO-style step: the reference logits from the same model with the adapter disabled under no_grad (peft
    turns the adapter's requires_grad off for that), then the policy's, one loss from both. Trains as torch does."""
    import torch.nn.functional as F

    def loss_of(call, model, x):
        with torch.no_grad(), model.disable_adapter():
            ref = call(input_ids=x).logits
        pol = call(input_ids=x).logits
        return F.kl_div(F.log_softmax(pol, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean") \
            + 1e-3 * pol.pow(2).mean()

    data = batches(4)
    ref = lora().to(DEVICE)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    want = []
    for x in data:
        loss = loss_of(ref, ref, x.to(DEVICE))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    model = lora()
    cfg = placement_config(tmp_path, placement, lr=1e-2)
    cfg["optimizer"]["params"]["weight_decay"] = 0.0
    with offload.initialize(model, cfg) as engine:
        got = []
        for x in data:
            loss = loss_of(engine, model, x)
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
    assert got == pytest.approx(want, rel=1e-3, abs=1e-7)


def test_load_best_model_at_end_loads_the_best_adapter(tmp_path):
    """load_best_model_at_end with an lr high enough that the first checkpoint is the best: the adapter of that
    checkpoint goes into the engine through peft, and evaluation then agrees with the plain Trainer's."""
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, VOCAB, (32, 12), generator=g)]
    val = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, VOCAB, (8, 12), generator=g)]

    def args(out) -> TrainingArguments:
        return TrainingArguments(str(out), use_cpu=DEVICE.type == "cpu", per_device_train_batch_size=4,
                                 learning_rate=0.3, weight_decay=0.0, lr_scheduler_type="constant", max_steps=6,
                                 report_to=[], seed=0, save_strategy="steps", save_steps=2, eval_strategy="steps",
                                 eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                                 disable_tqdm=True)

    plain = Trainer(model=lora().to(DEVICE), args=args(tmp_path / "plain"), train_dataset=data, eval_dataset=val)
    plain.train()
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10,
                                 "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "par")}}}
    with OffloadTrainer(model=lora(), args=args(tmp_path / "ours"), train_dataset=data, eval_dataset=val,
                        offload_config=cfg) as ours:
        ours.train()
        assert ours.state.best_model_checkpoint.endswith("checkpoint-2")
        assert plain.state.best_model_checkpoint.endswith("checkpoint-2")
        assert math.isclose(ours.evaluate()["eval_loss"], plain.evaluate()["eval_loss"], rel_tol=1e-5)


def test_a_bf16_engine_keeps_the_base_models_rotary_frequencies_fp32(tmp_path):
    """LoRA on a base model loaded in fp32, trained in bf16: the base's buffers take the dtypes from_pretrained
    (dtype=bf16) gives them, through the peft wrapper (RoPE's inv_freq stays fp32), and the adapters still train."""
    model = lora()
    cfg = placement_config(tmp_path, "opt-host", bf16={"enabled": True})
    with offload.initialize(model, cfg) as engine:
        buffers = {n: b.dtype for n, b in model.named_buffers()}
        assert buffers and all(d == torch.float32 for n, d in buffers.items() if "inv_freq" in n), buffers
        before = adapters(model)
        x = batches(1)[0].to(DEVICE)
        engine.backward(engine(x, labels=x).loss)
        engine.step()
        assert any(not torch.equal(v, before[k]) for k, v in adapters(model).items())
