"""Fine-tuning with part of the model frozen (a frozen base under adapters, frozen early layers): in every placement
the trainable part trains as torch's AdamW trains it on the un-offloaded model, and the frozen part keeps its values
everywhere the model is read back: the module after close, consolidated_state_dict, save_safetensors and a
checkpoint loaded into a new engine; weights loaded into the engine reach the frozen parameters too. Under
parameter offload a frozen parameter lives in a home and the module holds a placeholder, so each of those reads
must go to the home. A model frozen whole gets a forward-only engine, used beside a training one as a DPO
reference or a teacher. The engine trains on the machine's device; the reference runs there too
(tests/models.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from models import DEVICE, batches, close_enough, lm_loss, make, on_device, placement_config
from test_export import read_folder

LR = 3e-3
STEPS = 4

FROZEN_PLACEMENTS = ["opt-host", "opt-nvme", "params-host", "params-nvme", "all-nvme"]


def config(tmp_path, placement: str) -> dict:
    return placement_config(tmp_path, placement, lr=LR)


def frozen_base(seed: int = 0) -> nn.Module:
    """TinyGPT with its embedding (tied to the head) and first block frozen: all above the persistence threshold,
    so under parameter offload they live in homes."""
    model = make(seed)
    for p in [model.tok.weight, *model.blocks[0].parameters()]:
        p.requires_grad_(False)
    return model


def frozen_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def reference(data) -> tuple[nn.Module, list[float]]:
    model = frozen_base().to(DEVICE)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(model(*on_device((x,))), on_device(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("placement", FROZEN_PLACEMENTS)
def test_a_frozen_base_trains_like_torch_and_keeps_its_values(tmp_path, placement):
    data = batches(STEPS)
    ref, ref_losses = reference(data)
    model = frozen_base()
    frozen = frozen_names(model)
    assert frozen[0] == "tok.weight" and len(frozen) == 1 + len(list(model.blocks[0].parameters()))
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
    with offload.initialize(model, config(tmp_path, placement)) as engine:
        losses = []
        for x, y in data:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.consolidated_state_dict()
        engine.save_safetensors(tmp_path / "out")
        engine.save_checkpoint(tmp_path / "ckpt")
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for k, v in state.items():
        base = k.replace("head.", "tok.")  # tied
        if base in frozen:
            assert torch.equal(v, original[base].cpu()), k  # read from its home, not the module's placeholder
        err = ((v.double() - want[k].double()).abs() / want[k].double().abs().clamp(min=1)).max().item()
        assert err <= 1e-5, (k, err)
    written = read_folder(tmp_path / "out")
    assert set(written) == set(state) - {"head.weight"}
    assert all(torch.equal(written[k], state[k]) for k in written)
    for n, p in model.named_parameters():  # close() hands the model back, on the device
        assert p.device == DEVICE and torch.isfinite(p).all(), n
        if n in frozen:
            assert torch.equal(p.detach().cpu(), original[n]), n
    with offload.initialize(frozen_base(seed=5), config(tmp_path / "again", placement)) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        again = resumed.consolidated_state_dict()
    assert all(torch.equal(again[k], state[k]) for k in state)


@pytest.mark.parametrize("placement", FROZEN_PLACEMENTS)
def test_weights_loaded_into_an_engine_reach_the_frozen_homes(tmp_path, placement):
    """engine.load_state_dict from safetensors (another seed's weights): the frozen parameters' homes take them,
    so the state dict reads them back and the forward computes with them."""
    from safetensors.torch import save_file

    source = make(seed=7)
    weights = {k: v.contiguous() for k, v in source.state_dict().items() if k != "head.weight"}  # tied
    save_file(weights, str(tmp_path / "w.safetensors"))
    x, y = batches(1)[0]
    with torch.no_grad():
        want = lm_loss(source.to(DEVICE)(*on_device((x,))), on_device(y)).item()
    with offload.initialize(frozen_base(), config(tmp_path, placement)) as engine:
        engine.load_state_dict(tmp_path / "w.safetensors")
        state = engine.consolidated_state_dict()
        with torch.no_grad():
            got = lm_loss(engine(x), y).item()
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("placement", ["opt-host", "params-nvme"])
def test_a_checkpoint_without_the_frozen_base_resumes_bit_identically(tmp_path, placement, caplog):
    """``save_checkpoint(exclude_frozen_parameters=True)`` (what OffloadTrainer uses for peft models, as the Trainer
    asks of DeepSpeed): the frozen base is not written, a new engine on the same base resumes from it bit for bit,
    and ``consolidated_state_dict(keys)`` reads just the entries asked for. Its export says it is not the whole
    model."""
    from offload.cli import main

    data = batches(STEPS)
    with offload.initialize(frozen_base(), config(tmp_path / "a", placement)) as engine:
        for x, y in data[:2]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(tmp_path / "full", "t")
        engine.save_checkpoint(tmp_path / "thin", "t", exclude_frozen_parameters=True)
        trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        dtype_bytes = torch.empty((), dtype=engine.dtype).element_size()  # frozen tensors are kept in it
        some = engine.consolidated_state_dict(trainable)
        assert list(some) == trainable and all(v.dtype == torch.float32 for v in some.values())
        with pytest.raises(ValueError, match=r"\['nope'\] are not keys of the model's state_dict"):
            engine.consolidated_state_dict(["nope"])
        for x, y in data[2:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        straight = engine.consolidated_state_dict()
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file()) for name in ("full",
                                                                                                        "thin")}
    frozen_bytes = sum(p.numel() * dtype_bytes for p in frozen_base().parameters() if not p.requires_grad)
    assert size["full"] - size["thin"] >= frozen_bytes
    with offload.initialize(frozen_base(), config(tmp_path / "b", placement)) as engine:
        engine.load_checkpoint(tmp_path / "thin")
        for x, y in data[2:]:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        resumed = engine.consolidated_state_dict()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert main(["export", str(tmp_path / "thin"), str(tmp_path / "thin.pt")]) == 0
    assert "saved with exclude_frozen_parameters: its export holds the trainable parameters" in caplog.text
    exported = torch.load(tmp_path / "thin.pt", weights_only=True)
    assert sorted(exported) == sorted([*trainable, *(n for n, _ in frozen_base().named_buffers())])


# A model with nothing to train: a forward-only engine (a DPO reference model, a distillation teacher) ----------------


def all_frozen(seed: int = 0) -> nn.Module:
    model = make(seed)
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("placement", ["opt-host", *FROZEN_PLACEMENTS])
def test_a_model_with_nothing_to_train_runs_forwards_only(tmp_path, placement):
    """Every placement: the outputs are the un-offloaded model's (with and without autograd recording, before and
    after the prefetch trace exists), the optimizer holds no more than one padding sub-group, the state dict is the
    model's, and backward and step say why they cannot run."""
    data = batches(3)
    ref = all_frozen().to(DEVICE)
    model = all_frozen()
    cfg = placement_config(tmp_path, placement, live=8192, bucket=4096)  # a window of a third of the model
    with offload.initialize(model, cfg) as engine:
        assert "forward only" in engine.plan().describe()
        for i, (x, _) in enumerate(data):
            with torch.no_grad() if i % 2 == 0 else torch.enable_grad():
                got = engine(x)
            assert not got.requires_grad
            close_enough(got, ref(*on_device((x,))), rel=1e-6)
        if engine.stats()["params"] is not None:  # the window moved: parameters were released and fetched again
            assert engine.stats()["params"]["released"] > 0
        state = engine.consolidated_state_dict()
        report = engine.memory_report()
        assert report["host"]["optimizer_state"] + report["nvme"]["optimizer_state"] <= 12 * 2048
        x, y = data[0]
        for call in (lambda: engine.backward(lm_loss(engine(x), y)), engine.step):
            with pytest.raises(RuntimeError, match="this engine trains nothing .* runs forwards only"):
                call()
        close_enough(engine(x), ref(*on_device((x,))), rel=1e-6)  # still usable after the refusals
    assert all(torch.equal(state[k], v.cpu()) for k, v in ref.state_dict().items())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def sequence_logp(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per sequence, the summed log-probability of its tokens ``y``."""
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, y.to(logits.device).unsqueeze(-1)).squeeze(-1).sum(-1)


def dpo_loss(policy, reference, pair, beta: float = 0.1) -> torch.Tensor:
    (xc, yc), (xr, yr) = pair
    with torch.no_grad():
        ref_margin = sequence_logp(reference(xc), yc) - sequence_logp(reference(xr), yr)
    margin = sequence_logp(policy(xc), yc) - sequence_logp(policy(xr), yr)
    return -torch.nn.functional.logsigmoid(beta * (margin - ref_margin.to(margin.device))).mean()


def beside(trained, other, data, loss, engine=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``trained`` trains on ``loss(trained, other, item)`` for each item of ``data`` while ``other`` runs forwards
    only: under ``engine`` (the one holding ``trained``), else under torch's AdamW on the plain models (the inputs
    moved to DEVICE). Returns the losses and the trained model's state."""
    opt = None if engine else torch.optim.AdamW(trained.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for item in data:
        if engine:
            value = loss(engine, other, item)
            engine.backward(value)
            engine.step()
        else:
            opt.zero_grad()
            value = loss(trained, other, on_device(item))
            value.backward()
            opt.step()
        losses.append(value.item())
    state = engine.consolidated_state_dict() if engine else trained.state_dict()
    return losses, state


@pytest.mark.parametrize("placements", [("params-host", "params-nvme"), ("opt-host", "all-nvme")])
def test_dpo_with_the_reference_model_offloaded_too(tmp_path, placements):
    """Two engines in one process, as a DPO run on one GPU has them: the policy trains, the reference (the same
    weights, frozen) runs forwards only; the policy's losses and weights are those of the same loop with both models
    plain and torch's AdamW."""
    pairs = list(zip(batches(STEPS, seed=1), batches(STEPS, seed=2)))
    want, want_state = beside(make(0).to(DEVICE), all_frozen().to(DEVICE), pairs, dpo_loss)
    train, frozen = placements
    with offload.initialize(make(0), config(tmp_path / "policy", train)) as engine, \
            offload.initialize(all_frozen(), config(tmp_path / "reference", frozen)) as ref_engine:
        got, state = beside(engine.module, ref_engine, pairs, dpo_loss, engine)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for k, v in want_state.items():
        close_enough(state[k], v, rel=1e-5)


def mlp(seed: int, frozen: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])
    return model.requires_grad_(not frozen)


def chained(first, second, x) -> torch.Tensor:
    return second(first(x)).square().mean()


@pytest.mark.parametrize("placement", ["opt-host", "params-nvme"])
def test_gradients_flow_through_a_forward_only_engine(tmp_path, placement):
    """A trained model feeding a frozen one under its own engine (a frozen decoder or critic): the trained engine's
    backward runs through the frozen engine's modules, whose released parameters are fetched again for it, within
    the frozen engine's window (that backward is not its own, so nothing of it ends it there)."""
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]
    want, want_state = beside(mlp(0).to(DEVICE), mlp(1, frozen=True).to(DEVICE), xs, chained)
    window = {"live": 8192, "bucket": 4160}  # a third of each model
    with offload.initialize(mlp(0), placement_config(tmp_path / "a", "params-host", **window)) as engine, \
            offload.initialize(mlp(1, frozen=True), placement_config(tmp_path / "b", placement, **window)) as frozen:
        got, state = beside(engine.module, frozen, xs, chained, engine)
        peak = frozen.memory_report()["device"]["peak"]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    if placement != "opt-host":  # the window and the persistent biases, through the other engine's backward
        assert peak <= 4 * (window["live"] + 6 * 64), peak
    for k, v in want_state.items():
        close_enough(state[k], v, rel=1e-5)


class LoraLinear(nn.Module):
    """A frozen 256x256 weight with a trainable rank-4 update beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(256, 256, bias=False).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(256, 4) * 0.05)
        self.b = nn.Parameter(torch.randn(4, 256) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + x @ self.a @ self.b)


def lora_stack(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[LoraLinear() for _ in range(8)])


@pytest.mark.parametrize("placement", ["params-host", "params-nvme"])
def test_a_frozen_base_stays_within_the_window_in_backward(tmp_path, placement):
    """Eight frozen weights of 65,536 elements and a window of three: backward, which has no gradient to say when
    it is done with a frozen weight, keeps the device within the window (it held 7 of the 8 before, 2.3x) and
    trains as torch's AdamW does."""
    xs = [torch.randn(16, 256, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]
    want, want_state = beside(lora_stack().to(DEVICE), None, xs, lambda model, _, x: model(x).square().mean())
    window = 3 * 65_536
    with offload.initialize(lora_stack(), placement_config(tmp_path, placement, live=window, bucket=65_536)) as engine:
        got, state = beside(engine.module, None, xs, lambda _, __, x: engine(x).square().mean(), engine)
        peak = engine.memory_report()["device"]["peak"]
        buckets = engine.grads.staging_bytes  # the gradient buckets on the device (CUDA)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    for k, v in want_state.items():
        close_enough(state[k], v, rel=1e-5)
    assert peak <= 4 * window + buckets, peak
