"""The model's own ``state_dict()`` and ``load_state_dict()`` while an engine holds it (engine/_model_state.py), and
a model whose tensors were replaced behind the engine (``Weights.check_held``).

Before, both went quietly wrong: a load wrote only the low-precision copies and the next step put the old fp32
masters back (stages 0-2), or failed copying into a placeholder (stage 3); ``state_dict()`` with parameters offloaded
returned NaN placeholders. References: ``engine.load_state_dict`` (the documented path), torch's own
``load_state_dict`` on a plain model (what ``strict`` and the returned keys mean), ``consolidated_state_dict``.
"""

from __future__ import annotations

import io

import pytest
import torch

import offload
from models import DEVICE, PLACEMENTS, batches, lm_loss, make, placement_config, train_steps

ALL = sorted(PLACEMENTS)
OFFLOADED = [p for p in ALL if "offload_param" in PLACEMENTS[p]]


def cpu(sd) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def run(tmp_path, placement: str, load) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two steps, ``load(model, engine)``, two steps: the losses, the masters right after the load, at the end."""
    model = make()
    data = batches(4)
    losses = []
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        for x, y in data[:2]:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        load(model, engine)
        after_load = engine.consolidated_state_dict()
        for x, y in data[2:]:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, after_load, engine.consolidated_state_dict()


@pytest.mark.parametrize("placement", ALL)
def test_model_load_state_dict_reaches_the_masters(tmp_path, placement):
    """``model.load_state_dict(sd)`` after initialize is ``engine.load_state_dict(sd)``: the masters hold the
    loaded values and training goes on from them, bit for bit as through the engine (it used to be undone by the
    next step, or to fail in stage 3)."""
    other = cpu(make(seed=5).state_dict())
    losses, loaded, end = run(tmp_path / "model", placement, lambda model, engine: model.load_state_dict(other))
    ref_losses, ref_loaded, ref_end = run(tmp_path / "engine", placement,
                                          lambda model, engine: engine.load_state_dict(other))
    for name, value in other.items():
        assert torch.equal(loaded[name], value), name
    assert losses == ref_losses
    for name, value in ref_end.items():
        assert torch.equal(end[name], value), name


def test_strict_and_the_returned_keys_mean_what_torch_says(tmp_path):
    """Missing and unexpected keys, strict or not, as torch's own load reports them for the plain model; a
    submodule's load reaches the masters of its parameters only; ``assign=True`` keeps the engine's tensors."""
    other = cpu(make(seed=5).state_dict())
    partial = {k: v for k, v in other.items() if not k.startswith("blocks.1.")}
    partial["bogus.weight"] = torch.zeros(3)
    plain = make().load_state_dict(partial, strict=False)
    with offload.initialize(make(), placement_config(tmp_path, "params-nvme")) as engine:
        model = engine.module
        before = engine.consolidated_state_dict()
        with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\) in state_dict: \"blocks\.1\..*Unexpected key"):
            model.load_state_dict(partial)
        result = model.load_state_dict(partial, strict=False)
        assert sorted(result.missing_keys) == sorted(plain.missing_keys)
        assert result.unexpected_keys == plain.unexpected_keys == ["bogus.weight"]
        now = engine.consolidated_state_dict()
        for name in now:
            want = before[name] if name.startswith("blocks.1.") else other[name]
            assert torch.equal(now[name], want), name

        block = {k.removeprefix("blocks.1."): v + 1 for k, v in other.items() if k.startswith("blocks.1.")}
        result = model.blocks[1].load_state_dict(block, assign=True)
        assert result.missing_keys == result.unexpected_keys == []
        now = engine.consolidated_state_dict()
        for name in now:
            want = block[name.removeprefix("blocks.1.")] if name.startswith("blocks.1.") else other[name]
            assert torch.equal(now[name], want), name


@pytest.mark.parametrize("placement", OFFLOADED)
def test_state_dict_with_parameters_offloaded_holds_the_current_values(tmp_path, placement):
    """``model.state_dict()`` with parameters offloaded: every key torch gives (tied aliases too), each the
    parameter's current value (the masters in the training dtype), not the placeholder; a plain model loaded from
    it (``torch.save`` and back) computes what the engine computes. ``keep_vars=True`` gives the parameters."""
    model = make()
    data = batches(3)
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        train_steps(engine, data[:2])
        masters = engine.consolidated_state_dict()
        sd = model.state_dict()
        assert list(sd) == list(make().state_dict())
        for name, value in sd.items():
            assert torch.equal(value.cpu(), masters[name].to(engine.dtype)), name
        kept = model.state_dict(keep_vars=True)
        assert all(kept[name] is p for name, p in model.named_parameters(remove_duplicate=False))
        saved = io.BytesIO()
        torch.save(sd, saved)
        with torch.no_grad():
            expected = engine(data[2][0]).float().cpu()
    saved.seek(0)
    plain = make().to(DEVICE, engine.dtype)
    plain.load_state_dict(torch.load(saved))
    with torch.no_grad():
        assert torch.equal(plain(data[2][0].to(DEVICE)).float().cpu(), expected)


def test_a_held_model_loads_through_its_engine_and_is_not_initialized_twice(tmp_path):
    """``offload.load_state_dict(model, file)`` on a model an engine holds loads through the engine (the masters
    too); a second ``initialize`` of it (a notebook cell run again) names the fix instead of failing later with
    a misleading gradient error, and works once the first engine is closed."""
    from safetensors.torch import save_file

    other = cpu(make(seed=5).state_dict())
    del other["head.weight"]  # tied to tok.weight: safetensors stores shared tensors once
    save_file(other, str(tmp_path / "other.safetensors"))
    model = make()
    with offload.initialize(model, placement_config(tmp_path, "params-host")) as engine:
        offload.load_state_dict(model, tmp_path / "other.safetensors")
        now = engine.consolidated_state_dict()
        assert all(torch.equal(now[name], value) for name, value in other.items())
        with pytest.raises(ValueError, match="held by an engine that is still open.*close it first"):
            offload.initialize(model, placement_config(tmp_path / "again", "opt-host"))
        train_steps(engine, batches(1))  # the first engine is unharmed
    with offload.initialize(model, placement_config(tmp_path / "again", "opt-host")) as engine:
        train_steps(engine, batches(1))


@pytest.mark.parametrize("placement", ["opt-host", "params-nvme"])
@pytest.mark.parametrize("convert", ["double", "bfloat16"])
def test_a_model_converted_after_initialize_fails_its_next_forward(tmp_path, placement, convert):
    """``model.double()`` after initialize used to stop training silently (stages 0-2: the optimizer kept
    updating the tensors the engine held, no longer the model's) or fail deep in a layer (stage 3). Now the next
    forward names the parameter and the fix; a ``.to()`` that changes nothing is fine."""
    model = make()
    data = batches(2)
    with offload.initialize(model, placement_config(tmp_path, placement, bf16={"enabled": convert == "double"})) \
            as engine:
        model.to(DEVICE, engine.dtype)  # already there: the same tensors
        train_steps(engine, data[:1])
        getattr(model, convert)()
        with pytest.raises(RuntimeError, match=r"parameter 'pos' is now torch\.\w+ on .*no longer the tensor the "
                                               r"engine trains .*convert the model before initialize"):
            engine(data[1][0])


@pytest.mark.parametrize("placement", ["opt-host", "params-nvme"])
@pytest.mark.parametrize("flip", ["freeze", "unfreeze"])
def test_requires_grad_flipped_after_initialize_fails_the_next_forward(tmp_path, placement, flip):
    """Freezing or unfreezing a parameter after initialize (gradual unfreezing) trained silently wrong: a newly
    frozen one went on moving with Adam's momentum, a newly unfrozen one never trained while its ``.grad`` grew.
    The next backward names it and the fix (a forward alone may flip flags for its duration: peft's
    ``disable_adapter()``, test_peft); after close, a new engine trains the new set."""
    model = make()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    data = batches(3)
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        train_steps(engine, data[:1])
        target = model.blocks[1].ln1.weight if flip == "freeze" else model.blocks[0].fc.weight
        target.requires_grad_(flip == "unfreeze")
        name = "blocks.1.ln1.weight" if flip == "freeze" else "blocks.0.fc.weight"
        x, y = data[1]
        loss = lm_loss(engine(x), y)
        with pytest.raises(RuntimeError, match=rf"parameter '{name}' was( not)? trainable at offload.initialize and "
                                               rf"has requires_grad={flip == 'unfreeze'} at this backward.*initialize "
                                               "again"):
            engine.backward(loss)
    with offload.initialize(model, placement_config(tmp_path / "again", placement)) as engine:
        train_steps(engine, data[1:])
        assert any(p is target for p in engine.layout.params) == (flip == "unfreeze")


@pytest.mark.parametrize("placement", ["opt-host", "params-host"])
def test_the_models_own_load_names_a_second_value_of_a_tied_weight(tmp_path, placement):
    """A state dict saved untied (its own head.weight, other values) into the engine's model, whose head is tied to
    the embedding, through the model's own load_state_dict: strict, torch's error names head.weight as unexpected
    (before, it was dropped without a word); the embedding's value is loaded."""
    model = make()
    state = {k: v.clone() for k, v in make(seed=3).state_dict().items()}
    state["head.weight"] = torch.randn_like(state["head.weight"])
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "head.weight"'):
            model.load_state_dict(state)
        assert torch.equal(engine.consolidated_state_dict()["tok.weight"], state["tok.weight"])
