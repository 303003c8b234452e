"""torch.compile and the engine: a model handed over compiled (``torch.compile(model)``), compiled in place
(``model.compile()``) or compiled after ``initialize`` (``torch.compile(engine.module)``) trains, in every placement,
as the same model compiled the same way trains under torch's AdamW without offload. Under parameter offload the
window is small enough that parameters are released between forward and backward, so what the compiled graphs save
for backward must go through the engine's saved-tensor hooks (a graph holding a released parameter's buffer would
compute with the placeholder or another parameter's values). Names, checkpoints and exports are those of the
uncompiled model. Most cases use the ``aot_eager`` backend (dynamo and AOTAutograd, which is where hooks and saved
tensors meet the engine, without code generation); one uses inductor. The engine trains on the machine's device,
the reference runs there too (tests/models.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters, get_compilation_metrics

import offload
from models import PLACEMENTS, batches, lm_loss, make, on_device, placement_config, reference_model

LR = 3e-3
STEPS = 4

COMPILE_PLACEMENTS = ["opt-host", "opt-host-overlap", "params-host", "all-nvme"]


def config(tmp_path, placement: str) -> dict:
    return placement_config(tmp_path, placement, lr=LR, live=8_000, bucket=2_000)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles new modules: without a reset, dynamo's per-function cache limit would soon make later
    tests run eagerly without a word."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def reference(data, backend: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = reference_model()
    run = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(run(*on_device((x,))), on_device(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, losses


def train(tmp_path, placement: str, how: str, backend: str, data) -> tuple[offload.Engine, list[float], dict]:
    model = make()
    if how == "wrapped":
        model = torch.compile(model, backend=backend)
    elif how == "in place":
        model.compile(backend=backend)
    losses = []
    with offload.initialize(model, config(tmp_path, placement)) as engine:
        run = torch.compile(engine.module, backend=backend) if how == "after" else engine
        for x, y in data:
            loss = lm_loss(run(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.consolidated_state_dict()
        stats = engine.stats()
        engine.save_checkpoint(tmp_path / "ckpt")
    return engine, losses, {"state": state, "stats": stats}


CASES = [("wrapped", p, "aot_eager") for p in COMPILE_PLACEMENTS] + [
    ("in place", "params-host", "aot_eager"),
    ("after", "all-nvme", "aot_eager"),
    ("wrapped", "all-nvme", "inductor"),
]


@pytest.mark.parametrize("how, placement, backend", CASES)
def test_a_compiled_model_trains_like_torch(tmp_path, how, placement, backend):
    data = batches(STEPS)
    want, ref_losses = reference(data, backend)
    torch._dynamo.reset()  # else the engine's forward may reuse the reference's graphs, whose guards still hold
    counters.clear()
    engine, losses, out = train(tmp_path, placement, how, backend, data)
    assert counters["stats"]["unique_graphs"] > 0  # the engine's forward did run compiled graphs
    hooks = [m for m in get_compilation_metrics() if (m.co_filename or "").endswith("offload/_hooks.py")]
    assert not hooks  # dynamo never enters a hook's frame (it compiled each, and recompiled per kind of hook)
    if "offload_param" in PLACEMENTS[placement]:
        assert out["stats"]["params"]["released"] > 0  # parameters left the window between forward and backward
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    state = out["state"]
    assert set(state) == set(want)  # no "_orig_mod." prefix
    for k, v in state.items():
        err = ((v.double() - want[k].double()).abs() / want[k].double().abs().clamp(min=1)).max().item()
        assert err <= 1e-5, (k, err)
    with offload.initialize(make(seed=5), config(tmp_path / "plain", placement)) as plain:  # not compiled
        plain.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(plain.consolidated_state_dict()[k], state[k]) for k in state)


def test_weights_load_into_a_compiled_model_by_the_plain_names(tmp_path):
    from safetensors.torch import save_file

    source = make(seed=7)
    weights = {k: v.contiguous() for k, v in source.state_dict().items() if k != "head.weight"}  # tied
    save_file(weights, str(tmp_path / "w.safetensors"))
    model = torch.compile(make(), backend="aot_eager")
    offload.load_state_dict(model, tmp_path / "w.safetensors")
    assert all(torch.equal(model._orig_mod.state_dict()[k], weights[k]) for k in weights)
