"""Parameter offload against the same model trained without it: losses and parameters equal (fp32), the device
window held to its budget, and prefetch that keeps up once the order is known. The engine trains on the machine's
device; the un-offloaded reference runs there too (tests/models.py)."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from models import DEVICE, TinyGPT, batches, lm_loss, make, on_device, placement_config, reference_model
from nvme_swapper import PAGE
from offload.memory import arena_span
from offload.params import ParamState

LR = 3e-3


def config(tmp_path, home: str, optimizer: str = "cpu", *, live: int = 30_000, bucket: int = 8_000,
           persist: int = 100, **extra) -> dict:
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 4096,
            "offload_optimizer": {"device": optimizer, "nvme_path": str(tmp_path / "opt")},
            "offload_param": {"device": home, "nvme_path": str(tmp_path / "param")},
            "stage3_max_live_parameters": live, "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": persist,
        },
        "aio": {"block_size": 1 << 16},
    }
    cfg.update(extra)
    return cfg


def reference(model: nn.Module, steps, loss_fn, gas: int = 1) -> tuple[nn.Module, list[float]]:
    """torch's AdamW on the un-offloaded model. A parameter left without a gradient (an untaken branch) gets a
    zero one: the offloaded optimizer steps every element of a sub-group together, as DeepSpeed's does, where
    torch would skip that parameter."""
    model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for i in range(0, len(steps), gas):
        opt.zero_grad()
        for batch in steps[i : i + gas]:
            loss = loss_fn(model, on_device(batch))
            (loss / gas).backward()
        losses.append(loss.item())
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return model, losses


def run(engine, steps, loss_fn, gas: int = 1) -> list[float]:
    losses = []
    for i in range(0, len(steps), gas):
        for batch in steps[i : i + gas]:
            loss = loss_fn(engine.module, batch)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def assert_same(model: nn.Module, ref: nn.Module, losses: list[float], ref_losses: list[float],
                tol: float = 1e-5) -> None:
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.device == DEVICE, name  # close() hands the model back on the device
        err = ((p.detach().cpu() - r.detach().cpu()).abs() / r.detach().cpu().abs().clamp(min=1)).max().item()
        assert err <= tol, (name, err)


def gpt_loss(model, batch):
    x, y = batch
    return lm_loss(model(x), y)


@pytest.mark.parametrize("home, optimizer", [("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"), ("nvme", "none")])
def test_tiny_gpt_matches_unoffloaded(tmp_path, home, optimizer):
    data = batches(6)
    model = make()
    ref, ref_losses = reference(make(), data, gpt_loss)
    with offload.initialize(model, config(tmp_path, home, optimizer)) as engine:
        losses = run(engine, data, gpt_loss)
        stats = engine.stats()
        report = engine.memory_report()
        buckets = engine.grads.staging_bytes  # gradient buckets on the device (CUDA)
        layout_numel = sum(engine.layout.group_numel)
    assert_same(model, ref, losses, ref_losses)
    persistent = sum(p.numel() for p in model.parameters() if p.numel() <= 100) * 4
    # the live window plus persistent parameters and gradient buckets; with the optimizer not offloaded, also its
    # state and fp32 gradients over the whole layout
    if optimizer == "none":
        buckets += report["device"]["optimizer_state"] + 4 * layout_numel
    assert report["device"]["peak"] <= 30_000 * 4 + persistent + buckets
    assert stats["params"]["fetches"] > 0
    assert list((tmp_path / "param").glob("*")) == [] or home == "cpu"


@pytest.mark.parametrize("optimizer", ["cpu", "none"])
def test_nvme_reads_through_pinned_staging_as_on_cuda(tmp_path, monkeypatch, optimizer):
    """The CUDA path of NVMe homes, on this machine's device (offload.plan.STAGE_ON_CPU): reads land in staging
    buffers and the fetch thread copies them on; the new values of an update go home through staging, from the
    CPU kernel or (optimizer "none") from torch's fused kernel over state on the device. The results are torch's
    AdamW's. (On CUDA this is the real path.)"""
    monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    data = batches(6)
    model = make()
    ref, ref_losses = reference(make(), data, gpt_loss)
    with offload.initialize(model, config(tmp_path, "nvme", optimizer, live=10_000, bucket=4_000)) as engine:
        losses = run(engine, data, gpt_loss)
        arena = engine.weights.params.homes.arena  # a prefetch bucket's reads and the largest parameter, in whole pages
        homed = [arena_span(p.numel(), 4) for p in model.parameters() if p.numel() > 100]
        assert arena.buffer.numel() == min(arena_span(4_000, 4) + max(homed), sum(homed))
        swap = engine.stats()["params"]["nvme"]  # every read lands O_DIRECT in its piece, but for a sub-page tail
        assert swap["bytes_bounced"] < PAGE * (swap["reads"] + swap["writes"])
        assert engine.stats()["params"]["last_step"]["landed"] > 0
    assert_same(model, ref, losses, ref_losses)


def test_prefetch_keeps_up_in_steady_state(tmp_path):
    data = batches(6)
    model = make()
    with offload.initialize(model, config(tmp_path, "nvme")) as engine:
        run(engine, data[:2], gpt_loss)  # the first step records the order
        engine.weights.params.reset_counters()
        run(engine, data[2:], gpt_loss)
        s = engine.stats()["params"]
    assert s["trace_invalidations"] == 0
    assert s["hit_rate"] >= 0.95, s  # resident or already in flight when asked for
    assert s["last_step"]["hit_rate"] >= 0.95 and s["last_step"]["waited"] == 0
    assert s["last_step"]["fetches"] * 4 == s["fetches"]  # four identical steps since the reset


def test_first_parameters_land_from_the_update(tmp_path):
    """With NVMe homes, the parameters the next forward needs first take their new values from the optimizer as it
    writes them home, instead of being read back: every step lands the same ones, the next forward finds them on
    the device, and the result is still torch's."""
    data = batches(6)
    model = make()
    ref, ref_losses = reference(make(), data, gpt_loss)
    with offload.initialize(model, config(tmp_path, "nvme", "nvme")) as engine:
        losses = run(engine, data[:2], gpt_loss)  # the first step records the order
        engine.weights.params.reset_counters()
        read_before = engine.stats()["params"]["nvme"]["bytes_read"]
        losses += run(engine, data[2:], gpt_loss)
        s = engine.stats()["params"]
        first = model.tok.weight  # the forward's first parameter, updated last
        assert engine.weights.params.params[engine.weights.params.index_of(first)].state is ParamState.AVAILABLE
    assert_same(model, ref, losses, ref_losses)
    assert s["last_step"]["landed"] >= 2 and s["landed"] == 4 * s["last_step"]["landed"], s
    assert s["last_step"]["waited"] == 0
    homed = sum(p.numel() * 4 for p in model.parameters() if p.numel() > 100)
    assert s["nvme"]["bytes_read"] - read_before < 4 * 2 * homed  # forward and backward each read less than all


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_write_parameter_reaches_a_prefetched_or_landed_copy(tmp_path, home):
    """A value written between steps (a checkpoint load) replaces the copy a landing left on the device (NVMe
    homes), and the one the next forward's prefetch was bringing in from the old value."""
    data = batches(3)
    model = make()
    with offload.initialize(model, config(tmp_path, home, live=10_000, bucket=4_000)) as engine:
        run(engine, data[:2], gpt_loss)
        assert engine.stats()["params"]["last_step"]["landed"] > 0 or home == "cpu"
        initial = reference_model()  # the values before training
        for p, r in zip(model.parameters(), initial.parameters()):
            engine.write_parameter(p, r.detach())
        with torch.no_grad():
            got = engine(data[2][0])
            want = initial(on_device(data[2][0]))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_persistent_parameters_read_between_steps_hold_the_new_values(tmp_path, home):
    """A persistent parameter (small: on the device all along) read outside a forward, as a Trainer callback or
    code after train() reads ``model.ln.weight``: after each step it holds that step's value, not the one before,
    and after a load the loaded one."""
    data = batches(3)
    model = make()
    ref, _ = reference(make(), data[:1], gpt_loss)
    with offload.initialize(model, config(tmp_path, home)) as engine:
        small = [(n, p) for n, p in model.named_parameters() if p.numel() <= 100]
        assert small
        run(engine, data[:1], gpt_loss)
        want = dict(ref.named_parameters())
        for name, p in small:
            assert torch.allclose(p.detach(), want[name].detach(), rtol=1e-5, atol=1e-7), name
        initial = dict(make().named_parameters())
        engine.load_state_dict({n: initial[n].detach() for n, _ in small}, strict=False)
        for name, p in small:
            assert torch.equal(p.detach().cpu(), initial[name].detach()), name


@pytest.mark.parametrize("home, optimizer, frozen", [("none", "nvme", False), ("nvme", "nvme", False),
                                                     ("nvme", "cpu", False), ("nvme", "cpu", True)])
def test_swap_files_stay_within_the_nvme_space_initialize_claimed(tmp_path, home, optimizer, frozen):
    """Many steps of rewrites (sub-groups and a shorter last one; parameters of many sizes, a frozen one), then
    every parameter written again (a load's path: all of a parameter's parts): the swap files on disk never
    outgrow the NVMe space initialize checked and claimed (they grew 10-21% past it: a disk that passed the check
    ran out of space mid-run), and the estimate charges what is claimed."""
    from offload.planner import estimate

    model = make()
    if frozen:
        model.tok.weight.requires_grad_(False)
    cfg = config(tmp_path, home, optimizer)
    if home == "none":
        cfg["zero_optimization"]["stage"] = 2
    with offload.initialize(model, cfg) as engine:
        claimed = engine.memory_report()["nvme"]["current"]

        def on_disk() -> int:
            return sum(f.stat().st_size for f in tmp_path.rglob("swap.*"))

        for _ in range(3):
            run(engine, batches(8), gpt_loss)
            assert on_disk() <= claimed, (on_disk(), claimed)
        for p in model.parameters():
            engine.write_parameter(p, torch.full(p.shape, 0.5))
            assert on_disk() <= claimed, (on_disk(), claimed)
    names = {("none", "nvme"): "optimizer on nvme", ("nvme", "nvme"): "optimizer + parameters on nvme"}
    if (home, optimizer) in names and DEVICE.type == "cpu" and not frozen:
        plan = engine.plan()
        est = next(e for e in estimate(model=make(), cuda=False, sub_group_size=plan.sub_group_size,
                                       buffer_count=plan.buffer_count, max_live_parameters=plan.max_live,
                                       prefetch_bucket_size=plan.prefetch_bucket, persistence_threshold=100,
                                       dtype_bytes=4) if e.placement == names[home, optimizer])
        assert est.nvme == claimed


@pytest.mark.parametrize("home, host", [("nvme", None), ("nvme", 400_000), ("cpu", None)],
                         ids=["nvme homes", "nvme homes, host budget tight", "host homes"])
def test_close_hands_back_a_model_larger_than_the_device_where_it_fits(tmp_path, home, host, caplog):
    """A model offloaded because the device budget cannot hold it (113 KiB of parameters, 59 KiB of budget):
    close() hands its parameters back in host memory, with their trained values, instead of running the device
    out of memory, logged; a host budget the training filled does not matter (what it holds is freed then); host
    homes are handed over as they are."""
    model = make()
    cfg = config(tmp_path, home, "nvme", live=10_000, bucket=4_000)
    cfg["offload"] = {"device_memory_budget": 60_000, **({"host_memory_budget": host} if host else {})}
    cfg["zero_optimization"]["reduce_bucket_size"] = 1_000  # on CUDA the gradient staging is in the budget too
    caplog.set_level("INFO", logger="offload")  # (a warning on a GPU; on the CPU, where both are RAM, said quietly)
    with offload.initialize(model, cfg) as engine:
        run(engine, batches(2), gpt_loss)
        state = engine.consolidated_state_dict()
    assert re.search(r"do not fit the device \(budget 58.59 KiB, [^)]*\) beside what it holds: they are handed back "
                     r"in host memory", caplog.text)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p.detach(), state[name]), name


def test_close_of_a_model_no_memory_holds_says_so(tmp_path, monkeypatch, caplog):
    """Parameters homed on NVMe that neither the device budget nor the machine's free memory can hold (the
    ZeRO-Infinity case, a model larger than RAM; here the free memory is made small): close() leaves NaN
    placeholders rather than read them all into memory the machine does not have, frees everything else, and
    raises saying so and how to keep the weights."""
    from offload.params import _offload

    model = make()
    cfg = config(tmp_path, "nvme", "nvme", live=10_000, bucket=4_000)
    cfg["offload"] = {"device_memory_budget": 60_000}
    cfg["zero_optimization"]["reduce_bucket_size"] = 1_000  # on CUDA the gradient staging is in the budget too
    engine = offload.initialize(model, cfg)
    run(engine, batches(1), gpt_loss)
    monkeypatch.setattr(_offload, "default_host_budget", lambda: 1000)
    with pytest.raises(RuntimeError, match=r"fit neither the device budget nor this machine's free memory, so they "
                                           r"were not handed back .* Save the weights before close"):
        engine.close()
    assert engine.phase is offload.Phase.CLOSED and not list((tmp_path / "param").rglob("*.swp"))
    assert all(p.isnan().all() for p in model.parameters())
    assert "nor does this machine's free memory hold" in caplog.text


def test_a_skipped_step_cancels_the_landing(tmp_path):
    """An fp16 step skipped for overflow writes nothing: the parameters set to land are read from their homes."""
    data = batches(4)
    model = make()
    cfg = config(tmp_path, "nvme", fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    with offload.initialize(model, cfg) as engine:
        run(engine, data[:2], gpt_loss)
        x = data[2][0]
        with torch.no_grad():
            before = engine(x)
        engine.backward(gpt_loss(engine.module, data[2]) * float("inf"))
        engine.step()
        assert engine.stats()["skipped_steps"] == 1
        with torch.no_grad():
            after = engine(x)
        run(engine, data[3:], gpt_loss)
        assert engine.stats()["params"]["last_step"]["landed"] > 0
    assert torch.equal(before, after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_allocations_stay_within_the_window(tmp_path):
    """On a GPU, torch's own allocator counts what the store's accounting claims: the peak of everything allocated
    while training stays within the DEVICE tier's peak (window plus persistent parameters) plus what one
    un-offloaded forward+backward needs besides its parameters (activations and gradients), and under the whole
    model's parameters plus that."""
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    ref = make().cuda()
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    gpt_loss(ref, data[0]).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before  # activations and every gradient
    del ref
    torch.cuda.empty_cache()
    # a window of a third of the model (its largest parameter is 4096 elements)
    with offload.initialize(make(), config(tmp_path, "nvme", live=10_000, bucket=4_000)) as engine:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()  # the persistent parameters are in here already
        run(engine, data, gpt_loss)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        window = engine.memory_report()["device"]["peak"]
    assert window < param_bytes  # the test means something only if the model does not fit the window
    assert peak <= window + extra, (peak, window, extra)
    assert peak < param_bytes + extra


class Branchy(nn.Module):
    """A module called twice per forward, and a branch that depends on the data."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.shared = nn.Linear(d, d)
        self.left, self.right = nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))  # the same module again
        h = self.left(h) if x[:, 0].sum() > 0 else self.right(h)  # data-dependent
        return self.out(h).squeeze(-1)


def branchy_loss(model, batch):
    x, y = batch
    out = model(x)
    return F.mse_loss(out, y.to(out.device))


def branchy_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        x = torch.randn(16, 8, generator=g)
        x[:, 0] = x[:, 0].abs() * (1 if i % 3 else -1)  # every third batch takes the other branch
        out.append((x, torch.randn(16, generator=g)))
    return out


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_module_called_twice_and_data_dependent_branch(tmp_path, home):
    data = branchy_data(7)
    torch.manual_seed(0)
    model = Branchy()
    ref, ref_losses = reference(copy.deepcopy(model), data, branchy_loss)
    with offload.initialize(model, config(tmp_path, home, live=1500, bucket=700, persist=30)) as engine:
        losses = run(engine, data, branchy_loss)
        s = engine.stats()["params"]
    assert_same(model, ref, losses, ref_losses)
    assert s["trace_invalidations"] > 0  # the order changed with the branch, and results stayed right


@pytest.mark.parametrize("live, persist", [(30_000, 100), (5_000, 0)])
def test_eval_no_grad_checkpointing_and_accumulation(tmp_path, live, persist):
    """Activation checkpointing, non-reentrant and reentrant, with a window that holds the model and one that
    holds the largest parameter but not a block (every parameter offloaded): a reentrant recomputation runs inside
    backward, and what it saves of a parameter must be fetched again when the window evicted it (it read NaN
    placeholders, trained into the weights)."""

    class Checkpointed(nn.Module):
        """Calls the GPT's pieces itself, reading ``gpt.pos`` outside ``gpt.forward``."""

        def __init__(self):
            super().__init__()
            self.gpt = make()

        def forward(self, idx):
            g = self.gpt
            x = g.tok(idx) + g.pos[: idx.shape[1]]
            x = checkpoint(g.blocks[0], x, use_reentrant=False)
            x = checkpoint(g.blocks[1], x, use_reentrant=True)
            return g.head(g.ln(x))

    data = batches(8)
    model, ref_model = Checkpointed(), Checkpointed()
    ref, ref_losses = reference(ref_model, data, gpt_loss, gas=2)
    with offload.initialize(model, config(tmp_path, "nvme", live=live, bucket=min(live, 8_000), persist=persist,
                                          gradient_accumulation_steps=2)) as engine:
        engine.register_external_parameter(model, model.gpt.pos)  # read by the root, owned by model.gpt
        losses = run(engine, data, gpt_loss, gas=2)
        engine.eval()
        with torch.no_grad():
            evaluated = engine(data[0][0])
        engine.train()
    assert_same(model, ref, losses, ref_losses)
    with torch.no_grad():
        expected = ref(on_device(data[0][0]))
        assert torch.allclose(evaluated, expected, rtol=1e-4, atol=1e-4)  # logits of ~20 after 4 steps


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_inference_mode_between_steps(tmp_path, home):
    """Evaluation under ``torch.inference_mode()`` (an eval harness's way) between steps: the device buffers and
    placeholders its fetches make are ordinary tensors, so training after it goes on as without it (host homes
    failed: a buffer made in inference mode cannot be copied into outside it). Its logits are the reference's."""
    data = batches(6)
    model = make()
    ref, ref_losses = reference(copy.deepcopy(model), data, gpt_loss)
    with offload.initialize(model, config(tmp_path, home, live=9000, bucket=4000)) as engine:
        losses = run(engine, data[:3], gpt_loss)
        with torch.inference_mode():
            evaluated = [engine(x) for x, _ in data[3:]]
        losses += run(engine, data[3:], gpt_loss)
    assert_same(model, ref, losses, ref_losses)
    part, _ = reference(make(), data[:3], gpt_loss)  # the weights the evaluation saw
    with torch.no_grad():
        for got, (x, _) in zip(evaluated, data[3:]):
            assert torch.allclose(got, part(x.to(DEVICE)), rtol=1e-4, atol=1e-4)


def test_parameter_larger_than_the_prefetch_bucket(tmp_path):
    data = batches(4)
    model = make()
    big = model.tok.weight.numel()
    ref, ref_losses = reference(make(), data, gpt_loss)
    with offload.initialize(model, config(tmp_path, "cpu", bucket=big // 4, live=big * 3)) as engine:
        losses = run(engine, data, gpt_loss)
    assert_same(model, ref, losses, ref_losses)


def test_gpt2_from_transformers_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=48, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg).float()

    def loss_fn(m, batch):
        x, y = batch
        return m(input_ids=x, labels=y).loss

    data = [(x, x) for x, _ in batches(5, vocab=128)]
    for home in ("cpu", "nvme"):
        model = build()
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
        ref_first = build().to(DEVICE)
        loss_fn(ref_first, on_device(data[0])).backward()
        ref, ref_losses = reference(build(), data, loss_fn)
        settings = config(tmp_path / home, home, live=60_000, bucket=20_000)
        if home == "cpu":  # whole gradient buffers, to read the first step's gradients (nvme: sub-group slots)
            settings["zero_optimization"]["offload_optimizer"]["overlap_step"] = False
        with offload.initialize(model, settings) as engine:
            engine.backward(loss_fn(engine.module, data[0]))
            layout, whole = engine.layout, engine.optimizer.grads.whole
            assert (whole is None) == (home == "nvme")
            for i, (name, r) in enumerate(ref_first.named_parameters() if whole else ()):  # first step's gradients
                engine.grads.wait()
                got = layout.param_view(whole[layout.param_group[i]], i)
                assert torch.allclose(got, r.grad.cpu(), rtol=1e-4, atol=1e-7), name
            engine.step()
            losses = [ref_losses[0]] + run(engine, data[1:], loss_fn)
        # 1e-4: the key third of c_attn.bias has an analytically zero gradient, so Adam turns its rounding
        # noise into lr-sized steps that no two correct implementations share element by element
        assert_same(model, ref, losses, ref_losses, tol=1e-4)


class HiddenGPT(TinyGPT):
    """TinyGPT whose forward stops at the hidden states: the loss applies the output embedding (tied to the input
    one) itself, as memory-saving chunked cross-entropy losses do, so it reads that weight outside any forward."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x)


def hidden_gpt() -> HiddenGPT:
    torch.manual_seed(0)
    return HiddenGPT()


def chunked_loss(model: HiddenGPT, h: torch.Tensor, y: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    w = model.head.weight
    parts = [F.cross_entropy(F.linear(h[:, i : i + chunk], w).flatten(0, 1), y[:, i : i + chunk].flatten().to(h.device),
                             reduction="sum") for i in range(0, h.shape[1], chunk)]
    return sum(parts) / y.numel()


@pytest.mark.parametrize("home, inside", [("cpu", True), ("nvme", True), ("nvme", False)])
def test_a_loss_that_reads_a_weight_outside_the_forward_inside_gathered(tmp_path, home, inside):
    """The head's weight, read by the loss between forward and backward: inside ``engine.gathered(weight)`` the
    run trains as the un-offloaded model does, with backward inside the block or after it (what the block saved is
    fetched again); without the block, the read is the NaN placeholder and backward refuses the loss."""
    data = batches(4)
    ref, ref_losses = reference(hidden_gpt(), data, lambda m, batch: chunked_loss(m, m(batch[0]), batch[1]))
    model = hidden_gpt()
    with offload.initialize(model, config(tmp_path, home, live=8192, bucket=4096)) as engine:
        head = model.head.weight
        x, y = data[0]
        with pytest.raises(FloatingPointError, match="outside any forward"):
            engine.backward(chunked_loss(model, engine(x), y))
        losses = []
        for x, y in data:
            h = engine(x)
            with engine.gathered(head):
                loss = chunked_loss(model, h, y)
                if inside:
                    engine.backward(loss)
                    with pytest.raises(RuntimeError, match="inside an engine.gathered"):
                        engine.step()
            if not inside:
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.consolidated_state_dict()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref.state_dict().items():
        err = ((state[k].double() - v.detach().cpu().double()).abs() / v.detach().cpu().double().abs().clamp(min=1))
        assert err.max().item() <= 1e-5, k


def test_gathered_keeps_every_parameter_on_the_device_for_a_generation_loop(tmp_path):
    """``engine.gathered()`` (every parameter) around forwards under no_grad: no fetch waits inside the block,
    the outputs are the model's, and after it the window holds again."""
    data = batches(3)
    ref = reference_model()
    model = make()
    with offload.initialize(model, config(tmp_path, "nvme", live=8192, bucket=4096)) as engine:
        with torch.no_grad():
            engine(data[0][0])  # the traces
            with engine.gathered():
                assert all(torch.isfinite(p).all() for p in model.parameters())  # whole, on the device
                before = dict(engine.stats()["params"])
                for x, _ in data:
                    assert torch.equal(engine(x), ref(x.to(DEVICE)))
                inside = engine.stats()["params"]
            assert inside["waited"] == before["waited"] and inside["in_flight"] == before["in_flight"]
            assert inside["resident"] > before["resident"]
            engine(data[0][0])
        assert engine.weights.params.window.live_numel <= 8192
        with pytest.raises(ValueError, match="entry 0 of params is not a parameter"):
            with engine.gathered([torch.nn.Parameter(torch.zeros(2))]):
                pass


def test_a_gathered_block_larger_than_the_device_names_what_helps(tmp_path):
    """Every parameter gathered under a device budget smaller than the model: BudgetExceeded names the block and
    what helps (fewer at a time, a larger budget), not the window size, which cannot; the engine trains on as a
    run without the attempt (the same losses)."""
    losses = []
    for attempt in (False, True):
        model = make()
        cfg = config(tmp_path / str(attempt), "nvme", "nvme", live=10_000, bucket=4_000)
        cfg["offload"] = {"device_memory_budget": 60_000}
        cfg["zero_optimization"]["reduce_bucket_size"] = 1_000
        with offload.initialize(model, cfg) as engine:
            if attempt:
                with pytest.raises(offload.BudgetExceeded, match=r"holding the \d+ parameter\(s\) asked for at once "
                                   r"\(.*engine.gathered\(\)\).*gather fewer at a time") as info:
                    with engine.gathered():
                        pass
                assert "stage3_max_live_parameters" not in str(info.value)
            losses.append(run(engine, batches(2), gpt_loss))
    assert losses[0] == losses[1]


def test_what_a_gathered_block_saved_is_fetched_again_after_its_buffer_was_reused(tmp_path):
    """A block uses the first layer's weight outside its forward; a forward after the block, with a window of one
    layer, hands that weight's device buffer to the next layers; backward still gets the weight itself."""
    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(3)])

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    ref = layers().to(DEVICE)
    (ref(x.to(DEVICE)).square().mean() + ref[0].weight.pow(3).mean()).backward()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    opt.step()
    model = layers()
    with offload.initialize(model, config(tmp_path, "nvme", live=6000, bucket=4096, persist=0)) as engine:
        with engine.gathered(model[0].weight):
            extra = model[0].weight.pow(3).mean()  # its backward reads the weight
        loss = engine(x).square().mean() + extra  # fetches every layer through a one-layer window
        engine.backward(loss)
        engine.step()
        state = engine.consolidated_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.allclose(state[k], v.detach().cpu(), rtol=1e-5, atol=1e-7), k


def edit(model: nn.Module, rank: int = 0) -> None:
    """A re-initialisation after the model was built: one weight in place through ``.data`` (which torch's
    version counters do not see), the position table replaced whole, and, when the first block's fc weight is
    frozen, that weight drawn from a seed of ``rank``'s own (several ranks: rank 0's must win)."""
    def drawn(p: torch.Tensor, seed: int) -> torch.Tensor:  # on the CPU: the same values whatever p's device
        return 0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))

    model.blocks[1].fc.weight.data.copy_(drawn(model.blocks[1].fc.weight, 5))
    model.pos.data = torch.full_like(model.pos, 0.25)
    frozen = model.blocks[0].fc.weight
    if not frozen.requires_grad:
        frozen.data.copy_(drawn(frozen, 100 + rank))


@pytest.mark.parametrize("placement", ["opt-host", "params-host", "params-nvme"])
def test_changes_made_in_a_gathered_block_are_kept(tmp_path, placement):
    """What the block writes becomes the parameters' fp32 masters and homes (stage 3) or device copies (stage 2):
    training then goes on as torch's AdamW from the edited model; the rest keep their masters bit for bit."""
    data = batches(3)
    ref = make()
    edit(ref)
    ref, ref_losses = reference(ref, data, gpt_loss)
    model = make()
    cfg = placement_config(tmp_path, placement, lr=LR, live=8192, bucket=4096)
    with offload.initialize(model, cfg) as engine:
        before = engine.consolidated_state_dict()
        with engine.gathered([model.blocks[1].fc.weight, model.pos, model.ln.weight]):
            edit(model)
        after = engine.consolidated_state_dict()
        assert torch.equal(after["pos"], torch.full_like(after["pos"], 0.25))
        assert all(torch.equal(after[k], before[k]) for k in before if k not in ("pos", "blocks.1.fc.weight"))
        losses = run(engine, data, gpt_loss)
        with pytest.raises(ValueError, match="'pos' was given a tensor of shape \\(3,\\)"):
            with engine.gathered(model.pos):
                model.pos.data = torch.zeros(3, device=engine.device)
        assert model.pos.shape == (16, 32)
    assert_same(model, ref, losses, ref_losses)


@pytest.mark.parametrize("placement", ["opt-nvme", "all-nvme"])
def test_a_gathered_edit_of_one_weight_reads_only_its_optimizer_sub_groups(tmp_path, placement):
    """The edit's new value goes into the fp32 masters of the sub-groups holding that weight: only those are read
    from NVMe, not the whole optimizer state (12 bytes a parameter), twice (once to tell the edit from the engine's
    own writes, once to write the masters), plus the weight's own home; the edit is kept, the rest bit for bit."""
    model = make()
    weight = model.blocks[1].fc.weight
    with offload.initialize(model, placement_config(tmp_path, placement)) as engine:
        layout = engine.layout
        index = next(i for i, p in enumerate(layout.params) if p is weight)
        holding = [sg for sg in layout.sub_groups if any(seg.param == index for seg in sg.segments)]
        assert len(holding) < len(layout.sub_groups) / 3
        before = engine.consolidated_state_dict()
        read = engine.stats()["bytes_moved"].get("nvme->host", 0)
        with engine.gathered([weight]):
            weight.data.fill_(0.5)
        read = engine.stats()["bytes_moved"].get("nvme->host", 0) - read
        state_of = lambda sgs: sum(12 * sg.numel for sg in sgs)  # noqa: E731 - [master | exp_avg | exp_avg_sq]
        home = weight.numel() * weight.element_size() if placement == "all-nvme" else 0
        assert read == 2 * state_of(holding) + home, (read, state_of(holding), state_of(layout.sub_groups))
        after = engine.consolidated_state_dict()
    assert torch.equal(after["blocks.1.fc.weight"], torch.full_like(after["blocks.1.fc.weight"], 0.5))
    assert all(torch.equal(after[k], before[k]) for k in before if k != "blocks.1.fc.weight")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       edit=st.sampled_from(["one bit", "swap", "none"]), data=st.data())
def test_fingerprints_see_every_kind_of_edit(n, dtype, edit, data):
    """Both fingerprints (the C checksum for host tensors, the position-weighted sum a GPU computes, run here on
    the CPU) change with a flipped bit anywhere or two unequal elements swapped, and stay with no edit."""
    from offload.engine._gathered import _weighted_sum, fingerprints

    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    before = (fingerprints([t])[0], int(_weighted_sum(t)))
    bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    if edit == "one bit":
        i, b = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, 8 * t.element_size() - 2))
        bits[i] ^= 1 << b
    elif edit == "swap":
        if n < 2 or bool((t == t[0]).all()):
            return
        i = data.draw(st.integers(0, n - 1))
        j = data.draw(st.integers(0, n - 1).filter(lambda k: bool(bits[k] != bits[i])))
        bits[i], bits[j] = bits[j].clone(), bits[i].clone()
    after = (fingerprints([t])[0], int(_weighted_sum(t)))
    assert (after[0] != before[0], after[1] != before[1]) == ((edit != "none"),) * 2


@pytest.mark.parametrize("placement", ["opt-host", "params-host", "params-nvme"])
def test_the_engines_own_writes_in_a_gathered_block_are_not_taken_for_edits(tmp_path, placement):
    """bf16 parameters over fp32 masters: a load inside the block (the usual GatheredParameters pattern) keeps the
    loaded fp32 values exactly, and a backward inside it whose updates run during backward (stage 2) leaves the
    masters those of the same run without the block; before, both came back rounded to bf16."""
    data = batches(3)
    runs = {}
    for block in (False, True):
        cfg = placement_config(tmp_path / str(block), placement, lr=LR, live=8192, bucket=4096,
                               bf16={"enabled": True})
        with offload.initialize(make(), cfg) as engine:
            for x, y in data:
                with engine.gathered() if block else contextlib.nullcontext():
                    engine.backward(lm_loss(engine(x), y))
                engine.step()
            runs[block] = engine.consolidated_state_dict()
            loaded = {k: v + 1e-4 for k, v in runs[block].items() if k.startswith("blocks.1.")}  # not bf16 values
            with engine.gathered():
                engine.load_state_dict(loaded, strict=False)
            after = engine.consolidated_state_dict()
        assert all(torch.equal(after[k], v) for k, v in loaded.items())
    assert all(torch.equal(runs[True][k], runs[False][k]) for k in runs[False])


class ReadsOutside(nn.Module):
    """Every way a forward reads a parameter outside the forward of the module that owns it: a parent reading a
    child's weight (``F.linear`` on ``self.proj.weight``, ``proj`` never called), torch's own
    ``nn.MultiheadAttention`` (its forward reads ``out_proj``'s weight and bias itself), a head tied to the
    embedding through ``F.linear``, a loss term in the forward reading the embedding, and a block under activation
    checkpointing (its recomputation in backward reads them again)."""

    def __init__(self, vocab: int = 96, d: int = 64, checkpointed: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True, bias=False)
        self.ln = nn.LayerNorm(d)
        self.checkpointed = checkpointed

    def block(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.linear(x, self.proj.weight, self.proj.bias).relu()
        return x + self.attn(x, x, x, need_weights=False)[0]

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(idx)
        x = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return F.linear(self.ln(x), self.tok.weight), 1e-3 * self.tok.weight.pow(2).mean()


def reads_loss(model, batch):
    x, y = batch
    logits, penalty = model(x)
    return lm_loss(logits, y) + penalty


@pytest.mark.parametrize("home, checkpointed", [("cpu", False), ("nvme", False), ("nvme", True)])
def test_parameters_read_outside_their_own_forward_are_fetched_without_a_declaration(tmp_path, home, checkpointed):
    """Every parameter offloaded (persistence 0), nothing declared: each read outside the owner's forward is
    fetched when it is read (the first forward) and from then on with the module that reads it (the model's
    root, or the MultiheadAttention, fetched whole from the start), so no later forward finds one. Before, those
    reads saw the NaN placeholder and the first backward refused the loss. Losses and parameters equal torch's
    AdamW on the un-offloaded model."""
    data = batches(4)
    torch.manual_seed(0)
    model = ReadsOutside(checkpointed=checkpointed)
    ref, ref_losses = reference(copy.deepcopy(model), data, reads_loss)
    # a window of the largest parameter (attn's 3 x 64 x 64 in_proj): every other fetch evicts
    with offload.initialize(model, config(tmp_path, home, persist=0, live=12_288, bucket=4_096)) as engine:
        assert "fetched whole: 1 module(s) (attn)" in engine.plan().describe()
        losses = run(engine, data[:1], reads_loss)
        first = engine.stats()["params"]["read_outside"]
        losses += run(engine, data[1:], reads_loss)
        assert first >= 2 and engine.stats()["params"]["read_outside"] == first  # proj's and tok's, once
    assert_same(model, ref, losses, ref_losses)


def test_bytes_moved_per_step_count_every_home_write_and_read_of_nvme_parameter_homes(tmp_path):
    """One rank, every parameter homed on NVMe, the optimizer state on the host: each step writes every trainable
    parameter home once (the update), and reads what the window fetched. ``stats()["bytes_moved"]`` counted the
    reads but none of the update's writes (the optimizer thread's ``write_home_part``); the swap engine's own
    counters are the independent measure."""
    model = make()
    size = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    with offload.initialize(model, config(tmp_path, "nvme", persist=0, live=9000, bucket=4000)) as engine:
        offloaded = engine.weights.params
        swap = offloaded.homes.space
        for batch in batches(3):
            offloaded.finish_fetches()  # (a read is counted as it starts; the swap engine counts it once done)
            moved, io = dict(engine.stats()["bytes_moved"]), swap.stats()
            run(engine, [batch], gpt_loss)
            offloaded.finish_fetches()
            after, io_after = engine.stats()["bytes_moved"], swap.stats()
            assert after.get("host->nvme", 0) - moved.get("host->nvme", 0) == size
            assert after.get("host->nvme", 0) - moved.get("host->nvme", 0) == \
                io_after["bytes_written"] - io["bytes_written"]
            assert after.get("nvme->host", 0) - moved.get("nvme->host", 0) == io_after["bytes_read"] - io["bytes_read"]
