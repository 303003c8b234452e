"""offload.estimate against the engine: for the demo's model, every placement's estimated peak per tier is within
10% of the peak the engine measures, with sizes given and with the sizes both derive from the budgets."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.models import GPT, GPTConfig
from offload.params import check_window
from offload.planner import PLACEMENTS, DecoderShape, best, config_for, estimate, table
from models import DEVICE

CFG = GPTConfig(vocab_size=512, context=64, layers=3, heads=4, width=256)  # the demo's shape, smaller
KNOBS = dict(sub_group_size=200_000, buffer_count=3, max_live_parameters=600_000, persistence_threshold=10_000)


BUDGETS = {"derived": dict(gpu_mem=48 << 20, host_mem=64 << 20),  # the derived sizes follow these
           # initialize's default on CUDA: the card's whole memory, where the parameter window holds the whole model
           "whole-gpu": dict(gpu_mem=140 << 30, host_mem=8 << 30)}


def frozen_base() -> GPT:
    """The demo's model frozen but for the attention projections of its last block (the weight above the
    persistence threshold, the bias below): a large base and a small trainable part, as in a LoRA run."""
    torch.manual_seed(0)
    model = GPT(CFG)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(f"blocks.{CFG.layers - 1}.proj."))
    return model


def measured(tmp_path, opt: str, par: str, budgets: str, model: GPT | None = None, gas: int = 1,
             **options) -> dict[str, int]:
    """Each tier's peak over two steps, with the sizes of KNOBS (``budgets`` "given") or derived from BUDGETS;
    ``options``: top-level config sections, and offload_optimizer keys (``overlap_step``, ``delayed_update``)."""
    torch.manual_seed(0)
    config = config_for(offload.planner.Estimate("", opt, par, 0, 0, 0, None, None), str(tmp_path))
    z = config["zero_optimization"]
    z["stage3_param_persistence_threshold"] = KNOBS["persistence_threshold"]
    if budgets != "given":
        config["offload"] = {"device_memory_budget": BUDGETS[budgets]["gpu_mem"],
                             "host_memory_budget": BUDGETS[budgets]["host_mem"]}
    else:
        z.update(sub_group_size=KNOBS["sub_group_size"], stage3_max_live_parameters=KNOBS["max_live_parameters"])
        z["offload_optimizer"]["buffer_count"] = KNOBS["buffer_count"]
    config["aio"] = {"block_size": 1 << 16}
    config["gradient_accumulation_steps"] = gas
    for key in ("overlap_step", "delayed_update"):
        if key in options:
            z["offload_optimizer"][key] = options.pop(key)
    config.update(options)
    x = torch.randint(0, CFG.vocab_size, (2, 32))
    with offload.initialize(model if model is not None else GPT(CFG), config) as engine:
        for _ in range(2 * gas):
            engine.backward(GPT.loss(engine(x), x))
            engine.step()
        return {t: r["peak"] for t, r in engine.memory_report().items()}


@pytest.mark.parametrize("variant, knobs, options", [
    ("fp16", {"fp16": True}, {"fp16": {"enabled": True}, "bf16": {"enabled": False}}),
    ("no overlap", {"overlap_step": False}, {"overlap_step": False}),
    ("delayed", {"delayed_update": True}, {"delayed_update": True}),
    ("accumulation", {"gradient_accumulation_steps": 2}, {"gas": 2}),
], ids=["fp16", "no-overlap", "delayed", "gas2"])
@pytest.mark.parametrize("staged", [False, True], ids=["own", "cuda-path"])
@pytest.mark.parametrize("name, opt, par", [p for p in PLACEMENTS if p[1] != "none" and p[2] == "none"])
def test_estimate_of_a_run_that_holds_every_gradient(tmp_path, monkeypatch, name, opt, par, variant, knobs, options,
                                                     staged):
    """fp16, overlap_step false, the delayed update and accumulation hold every gradient on the host until the
    step (the delayed update two sets): the estimate (and so estimate --config) charges it as the engine does
    (it charged a window's slots: 79 GiB for a 7B fp16 run that takes 91)."""
    if staged:
        monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    cuda = DEVICE.type == "cuda" or staged
    est = next(e for e in estimate(model=GPT(CFG), cuda=cuda, **KNOBS, **knobs) if e.placement == name)
    plain = next(e for e in estimate(model=GPT(CFG), cuda=cuda, **KNOBS) if e.placement == name)
    got = measured(tmp_path, opt, par, "given", **options)["host"]
    assert est.host > plain.host and abs(est.host - got) <= 0.10 * got, (est.host, got, plain.host)


@pytest.mark.parametrize("staged", [False, True], ids=["own", "cuda-path"])
@pytest.mark.parametrize("budgets", ["given", "derived", "whole-gpu"])
@pytest.mark.parametrize("name, opt, par", PLACEMENTS)
def test_estimate_within_ten_percent_of_measured_peaks(tmp_path, monkeypatch, name, opt, par, budgets, staged):
    """``cuda-path``: the CUDA estimate against the CUDA path's buffers (gradient buckets, pinned staging of
    uploads and NVMe reads), run on this machine's device (offload.plan.STAGE_ON_CPU); on CUDA both are that."""
    if staged:
        monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    knobs = KNOBS if budgets == "given" else dict(persistence_threshold=KNOBS["persistence_threshold"],
                                                  **BUDGETS[budgets])
    cuda = DEVICE.type == "cuda" or staged
    est = next(e for e in estimate(model=GPT(CFG), cuda=cuda, **knobs) if e.placement == name)
    peaks = measured(tmp_path, opt, par, budgets)
    for tier in ("device", "host", "nvme"):
        want, got = getattr(est, tier), peaks[tier]
        assert abs(want - got) <= 0.10 * max(got, 1), (tier, want, got)


@pytest.mark.parametrize("staged", [False, True], ids=["own", "cuda-path"])
@pytest.mark.parametrize("name, opt, par", PLACEMENTS)
def test_estimate_of_a_model_with_a_frozen_base(tmp_path, monkeypatch, name, opt, par, staged):
    """Frozen parameters are homed and fetched like trainable ones under parameter offload: the window derived
    without a device budget counts them (it was sized from the trainable ones alone, below the largest frozen
    parameter, and initialize failed), and the estimate counts their homes, host copies and NVMe keys. With
    parameters on NVMe and CUDA's pinned read staging, how many reads are in flight at once depends on the disk
    and the copies: the estimate takes the prefetch bucket's worth, an upper bound (within 1.5x here)."""
    if staged:
        monkeypatch.setattr(offload.plan, "STAGE_ON_CPU", True)
    knobs = dict(persistence_threshold=KNOBS["persistence_threshold"], **BUDGETS["derived"])
    est = next(e for e in estimate(model=frozen_base(), cuda=DEVICE.type == "cuda" or staged, **knobs)
               if e.placement == name)
    peaks = measured(tmp_path, opt, par, "derived", frozen_base())
    for tier in ("device", "host", "nvme"):
        want, got = getattr(est, tier), peaks[tier]
        if tier == "host" and par == "nvme" and (staged or DEVICE.type == "cuda"):
            assert got <= want <= 1.5 * got, (tier, want, got)
        else:
            assert abs(want - got) <= 0.10 * max(got, 1), (tier, want, got)
    if par != "none":  # no device budget, nothing given: the window still holds the largest (frozen) parameter
        zero = {"stage": 3, "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": par, "nvme_path": str(tmp_path / "window")}}
        with offload.initialize(frozen_base(), {"zero_optimization": zero}) as engine:
            assert engine.plan().max_live >= max(p.numel() for p in engine.module.parameters())


def test_fits_best_and_table():
    n = 3_000_000_000
    ests = estimate(n, gpu_mem=24 << 30, host_mem=24 << 30, nvme_free=80 << 30)
    by = {e.placement: e for e in ests}
    assert not by["no offload"].fits and by["no offload"].limiting == "device"
    assert by["optimizer on nvme"].nvme >= 12 * n
    assert best(ests).placement == "optimizer on nvme"  # 3B params: 36 GB of Adam state fits only on disk
    assert "optimizer + parameters on nvme" in table(ests)
    with pytest.raises(ValueError, match="exactly one"):
        estimate()


@pytest.mark.parametrize("device, param, ranks, counted", [
    ("cuda", "none", 1, True),  # the parameters go to the GPU
    ("cpu", "cpu", 1, True),  # to host homes, each as the masters have read it
    ("cuda", "cpu", 2, False),  # pieces: the whole model is read into the masters before any is freed
    ("cpu", "nvme", 1, True),  # to NVMe homes, likewise
    ("cpu", "none", 1, False),  # a CPU device: the flat buffers take the RAM back
], ids=["gpu", "host-homes", "pieces", "nvme-homes", "cpu-device"])
def test_the_default_host_budget_counts_the_model_initialize_frees(tmp_path, monkeypatch, device, param, ranks,
                                                                   counted):
    """The model was built before MemAvailable was read; where initialize frees it while it fills the host tier,
    90% of its bytes count in the default host budget (an explicit budget stays as given)."""
    monkeypatch.setattr(offload.plan, "default_host_budget", lambda: 1000 << 20)
    zero = {"stage": 3 if param != "none" else 2, "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": param, "nvme_path": str(tmp_path)}}
    resolve = offload.plan.resolve
    for explicit in (None, 500 << 20):
        cfg = offload.OffloadConfig.load({"zero_optimization": zero, "offload": {
            "device_memory_budget": 1 << 30, "host_memory_budget": explicit}})
        plan = resolve(cfg, offload.plan.ModelSizes((1 << 20,)), device=torch.device(device), world_size=ranks,
                       local_world_size=ranks, model_in_ram=400 << 20)
        want = explicit or (1000 << 20) // ranks + (360 << 20 if counted else 0)
        assert plan.budgets[offload.memory.Tier.HOST] == want, plan.why["host budget"]


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_a_host_budget_that_needs_the_model_freed_fits(tmp_path, monkeypatch, param):
    """The optimizer on the host and the parameters homed on the host or NVMe, the default budget set below the
    host tier's peak by half the model's fp32 bytes (as if the model in RAM had left that little available):
    initialize fits, because the model's memory comes back as it fills the tier."""
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": param, "nvme_path": str(tmp_path)}}}
    with offload.initialize(GPT(CFG), config) as engine:
        peak = engine.memory_report()["host"]["peak"]
    model = GPT(CFG)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(offload.plan, "default_host_budget", lambda: peak - model_bytes // 2)
    with offload.initialize(model, config) as engine:
        assert engine.memory_report()["host"]["peak"] == peak > peak - model_bytes // 2
        assert engine.plan().budgets[offload.memory.Tier.HOST] == peak - model_bytes // 2 + model_bytes * 9 // 10


def test_the_plan_says_what_unpinned_memory_costs_on_a_gpu():
    """Planning only (nothing runs on the device): on CUDA, pin_memory false is named with its cost."""
    sizes = offload.plan.ModelSizes((1 << 20,))
    def why(pin: bool, device: str) -> dict[str, str]:
        cfg = offload.OffloadConfig.load({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                                      "pin_memory": pin}},
                                          "offload": {"device_memory_budget": 1 << 30}})
        return offload.plan.resolve(cfg, sizes, device=torch.device(device)).why

    assert "blocks the thread" in why(False, "cuda")["pinned memory"]
    assert "pinned memory" not in why(True, "cuda") and "pinned memory" not in why(False, "cpu")


def test_the_reduce_pool_holds_two_buckets_unless_the_model_is_one():
    """Stages 1-2 on several ranks: the engine starts with two device buffers of a bucket (one per bucket that
    copies, if fewer: a model of one bucket), never larger than its largest param group; the estimate, which sees
    one group, charges one buffer only for a model of one bucket's worth. Two groups of a small model (a
    Trainer's decay / no-decay split) are two buckets, so two buffers: one would be allocated mid-backward."""
    from offload.dist._buckets import pool_buffers

    assert pool_buffers(1000, 700, 4096, pooled=2) == (2, 700)
    assert pool_buffers(1000, 1000, 4096, pooled=1) == (1, 1000)
    assert pool_buffers(50_000, 50_000, 4096, pooled=0) == (0, 4096)
    assert pool_buffers(1000, 1000, 4096) == (1, 1000)
    assert pool_buffers(50_000, 50_000, 4096) == (2, 4096)


def test_a_common_decoders_shape_from_its_parameter_count():
    """Given only a count, the shape a decoder of that size commonly has: at 8B exactly Llama 3 8B's (32 layers of
    4096, MLP 14336, 128,256 tokens), its largest parameter the embedding (0.5B elements, where the whole model as
    one parameter charged the device for a gradient of 8B); small models get a smaller vocabulary, never a
    parameter larger than the model."""
    llama = DecoderShape.typical(8_030_261_248)
    assert (llama.layers, llama.width, llama.mlp, llama.vocab) == (32, 4096, 14336, 128_256)
    assert llama.largest_param == 128_256 * 4096 and "the embedding" in llama.describe()
    for n in (1, 1000, 10**6, 10**8, 10**9, 7 * 10**9, 70 * 10**9, 10**12):
        shape = DecoderShape.typical(n)
        assert 1 <= shape.largest_param <= n and shape.layers >= 1, shape
        if n >= 10**8:  # the embeddings and the layers add up to about the count
            total = 2 * shape.vocab * shape.width + shape.layers * 13 * shape.width**2
            assert 0.8 * n <= total <= 1.2 * n, (n, total, shape)
    with pytest.raises(ValueError, match="num_params must be positive, got 0"):
        DecoderShape.typical(0)


def test_activations_and_zero_budgets_in_the_estimate():
    """``activations`` are charged to the device tier (and so to what fits there); a budget of 0 is one (it was
    taken for none given: with no NVMe, the placements on NVMe were said to fit)."""
    n, largest = 3 * 10**9, DecoderShape.typical(3 * 10**9).largest_param
    plain = {e.placement: e for e in estimate(n, largest_param=largest, gpu_mem=24 << 30)}
    more = {e.placement: e for e in estimate(n, largest_param=largest, gpu_mem=24 << 30, activations=20 << 30)}
    for name, e in plain.items():
        assert (more[name].device, more[name].host, more[name].nvme) == (e.device + (20 << 30), e.host, e.nvme)
    assert plain["optimizer on nvme"].fits and not more["optimizer on nvme"].fits
    assert more["optimizer on nvme"].limiting == "device"
    no_disk = {e.placement: e for e in estimate(n, largest_param=largest, gpu_mem=24 << 30, nvme_free=0)}
    assert [(no_disk[p].fits, no_disk[p].limiting) for p in ("optimizer on nvme", "optimizer + parameters on nvme")] \
        == [(False, "nvme")] * 2
    assert no_disk["optimizer on cpu"].fits
    with pytest.raises(ValueError, match="activations must be 0 or more bytes, got -1"):
        estimate(n, activations=-1)


@pytest.mark.parametrize("budget, persistent, fix", [
    # the largest parameter (12 MiB) alone is over the budget: lowering the persistence threshold cannot help
    (1 << 20, 1000, "raise offload.device_memory_budget to at least 12586912 B: the largest parameter (3145728 "
                    "elements) is on the device whole while its module runs, beside 4000 B of persistent"),
    (1 << 20, 0, "raise offload.device_memory_budget to at least 12582912 B: the largest parameter"),
    # room for the largest, not beside the persistent ones: fewer of them helps, or a budget of both
    ((12 << 20) + 2000, 1000, "lower zero_optimization.stage3_param_persistence_threshold (fewer of the 4000 B of "
                              "persistent parameters kept on the device) or raise offload.device_memory_budget to "
                              "at least 12586912 B"),
    # room for both: a smaller window
    (13 << 20, 1000, "lower zero_optimization.stage3_max_live_parameters to at most 3406872 or raise "
                     "offload.device_memory_budget to at least 25169824 B"),
], ids=["largest-over-budget", "largest-over-budget-alone", "persistent-in-the-way", "window"])
def test_a_window_over_the_device_budget_names_the_change_that_helps(budget, persistent, fix):
    """A 12 MiB parameter (fp32) under a 1 MiB device budget was told to lower the persistence threshold, which
    cannot make 12 MiB fit in 1: the advice names what does, with the bytes needed."""
    sizes = [3 << 20] + ([persistent] if persistent else [])  # elements
    with pytest.raises(offload.BudgetExceeded) as info:
        check_window(sizes, persistence_threshold=100_000, max_live=2 * (3 << 20), dtype=torch.float32,
                     budget=budget)
    assert fix in str(info.value), str(info.value)


def test_initialize_names_the_budget_a_large_parameter_needs():
    """The reported case end to end: initialize with a 1 MiB device budget and a 12 MiB parameter (fp32, its
    parameters on the host) fails before anything moves, naming the device budget to raise and by how much."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 1536), torch.nn.LayerNorm(1536), torch.nn.Linear(1536, 8))
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}},
              "offload": {"device_memory_budget": "1MiB"}}
    with pytest.raises(offload.BudgetExceeded, match=r"raise offload.device_memory_budget to at least \d+ B: the "
                       r"largest parameter \(3145728 elements\)") as info:
        offload.initialize(model, config)
    assert "persistence_threshold" not in str(info.value)
