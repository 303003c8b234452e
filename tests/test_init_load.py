"""Building a model inside ``offload.init`` and streaming weights in: the arena keeps a model that is built on NVMe
out of RAM and trains exactly like the same model built plainly; ``load_state_dict`` reads safetensors (single and
sharded), torch files and dicts tensor by tensor, into a model before ``initialize`` and into an engine after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import offload
import offload.persist._load as offload_load
from nvme_swapper import in_arena
from models import DEVICE, batches, close_enough, make, train_steps

ROOT = Path(__file__).resolve().parent.parent


def config(tmp_path: Path, opt: str = "nvme", param: str = "nvme", **zero) -> dict:
    return {"zero_optimization": {"stage": 3 if param != "none" else 2,
                                  "offload_optimizer": {"device": opt, "nvme_path": str(tmp_path / "opt")},
                                  "offload_param": {"device": param, "nvme_path": str(tmp_path / "param")},
                                  "stage3_param_persistence_threshold": 100, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "aio": {"block_size": 1 << 16}}


def test_a_model_built_in_the_arena_trains_like_one_built_plainly(tmp_path):
    cfg = config(tmp_path)
    torch.manual_seed(0)
    with offload.init(cfg) as ctx:
        model = make()
    assert ctx.active and ctx.params >= len(list(model.parameters()))  # with the head's own, dropped by tying
    assert all(in_arena(p) for p in model.parameters())
    assert model.head.weight is model.tok.weight  # tying survives the move
    plain = make()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)  # the same values: the modules' own init ran on the arena tensors
    assert list((tmp_path / "param").iterdir()) == []  # the arena file has no name
    data = batches(4)
    results = []
    for m, sub in ((model, "a"), (plain, "b")):
        with offload.initialize(m, config(tmp_path / sub)) as engine:
            train_steps(engine, data)
            results.append(engine.consolidated_state_dict())
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_from_pretrained_inside_init_loads_the_checkpoint(tmp_path):
    """DeepSpeed's ``with zero.Init(): model = from_pretrained(...)``, with offload.init and a config written for
    OffloadTrainer ("auto" values, which init does not need): every tensor is the checkpoint's (before, the moved
    parameters lost transformers' mark of a loaded tensor, and from_pretrained initialized them again at random)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ck")
    auto = {"bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p")},
                                  "stage3_prefetch_bucket_size": "auto"}}
    with offload.init(auto) as ctx:
        model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ck"))
    assert ctx.active and all(in_arena(p) for p in model.parameters())
    want = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ck")).state_dict()
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])] == []


def test_a_checkpoint_saved_untied_into_a_tied_model_is_named(tmp_path):
    """A checkpoint holding its own lm_head.weight (saved untied) into a model that ties it to the embedding: strict
    refuses, naming both and the fix, loading nothing; strict=False takes the embedding's for both and reports the
    head unexpected (before, it was dropped without a word, strict or not)."""
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, tie_word_embeddings=False))
    untied.save_pretrained(tmp_path / "untied")
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, tie_word_embeddings=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"holds lm_head.weight apart from model.embed_tokens.weight, with other "
                                         r"values \(saved untied\), but this model ties them"):
        offload.load_state_dict(model, tmp_path / "untied")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    result = offload.load_state_dict(model, tmp_path / "untied", strict=False)
    assert result.missing == [] and result.unexpected == ["lm_head.weight"]
    assert torch.equal(model.model.embed_tokens.weight, untied.model.embed_tokens.weight)


def test_a_model_built_under_a_device_context_goes_to_the_arena_too(tmp_path):
    """``with torch.device("cuda"), offload.init(...)`` (a habit, or a library that picks the device): each
    parameter is made on the device and moved into the arena as its module registers it, so the device never holds
    the model (before, such parameters were skipped and the context did nothing). On the CPU this is the plain
    path. On CUDA a module's initialisation after the registration (nn.Linear's reset_parameters) draws on the
    arena tensor, from the CPU's generator: the values are then another draw, not those of a model built plainly."""
    before = torch.cuda.memory_allocated(DEVICE) if DEVICE.type == "cuda" else 0
    with torch.device(DEVICE), offload.init(config(tmp_path)) as ctx:
        model = make()
    assert ctx.params >= len(list(model.parameters()))
    assert all(in_arena(p) and p.device.type == "cpu" for p in model.parameters())
    if DEVICE.type == "cuda":
        assert torch.cuda.memory_allocated(DEVICE) == before
    with torch.device(DEVICE):
        plain = make()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.shape == q.shape and p.dtype == q.dtype and bool(p.isfinite().all())
        if DEVICE.type == "cpu":
            assert torch.equal(p, q)


def test_a_parameter_registered_in_two_modules_stays_one(tmp_path):
    """A weight tied before either registration moved it (``w = Parameter(...)``, then ``a.weight = w`` and
    ``b.weight = w``): both modules get the one arena parameter (each registration made a copy of its own, and
    the tie was lost)."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = torch.nn.Parameter(torch.randn(8, 4))
            self.a, self.b = torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(4, 8, bias=False)
            self.a.weight = w
            self.b.weight = w

    with offload.init(config(tmp_path)):
        model = Tied()
    assert model.a.weight is model.b.weight and in_arena(model.a.weight)
    assert len(list(model.parameters())) == 1


def test_the_arena_gives_its_disk_back_as_parameters_leave(tmp_path):
    """``initialize`` moves every parameter out of the arena into its homes; each parameter's range of the arena
    file frees its disk blocks as it goes, so the disk never holds the arena and all homes at once."""
    from nvme_swapper._arena import _region_of

    cfg = config(tmp_path)
    with offload.init(cfg) as ctx:
        model = make()
    file = _region_of(next(model.parameters()))._file  # keeps the descriptor open to look at the file
    assert os.fstat(file.fd).st_blocks * 512 >= ctx.bytes > 0
    with offload.initialize(model, cfg):
        assert os.fstat(file.fd).st_blocks == 0


def test_the_arena_counts_as_free_disk_for_the_nvme_budget(tmp_path, monkeypatch):
    """The NVMe budget (95% of the free disk by default) adds the bytes of a model built in the arena on that
    disk: initialize frees them as it writes the homes. With free space that holds the swap files only once the
    arena is gone, a model built inside offload.init starts and one built in RAM is refused."""
    import shutil

    cfg = config(tmp_path)
    with offload.initialize(make(), {**cfg, "offload": {"nvme_memory_budget": "1TiB"}}) as engine:
        need = engine.memory_report()["nvme"]["peak"]
    with offload.init(cfg):
        model = make()
    arena = sum(p.numel() * 4 for p in model.parameters())  # the tied weight once (the head's own died at once)
    real = shutil.disk_usage
    free = (need - arena // 2) * 100 // 95  # 95% of it is half the arena short of the swap files
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))
    with pytest.raises(offload.BudgetExceeded, match="nvme tier"):
        offload.initialize(make(), cfg)
    with offload.initialize(model, cfg) as engine:
        assert engine.memory_report()["nvme"]["budget"] == free * 95 // 100 + arena


def test_without_nvme_the_context_changes_nothing(tmp_path):
    with offload.init(config(tmp_path, "cpu", "cpu")) as ctx:
        model = make()
    assert not ctx.active and not any(in_arena(p) for p in model.parameters())


BUILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import offload
    from offload.models import GPT, GPTConfig
    def peak():
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    cfg = GPTConfig(vocab_size=8192, context=64, layers=12, heads=12, width=768)
    before = peak()
    config = {{"zero_optimization": {{"offload_optimizer": {{"device": "nvme", "nvme_path": {nvme!r}}}}}}}
    with offload.init(config):
        model = GPT(cfg)
    print(peak() - before, cfg.num_parameters * 4)
""")


def test_building_inside_init_needs_a_fraction_of_the_model_in_ram(tmp_path):
    """A 92M-parameter GPT (368 MB of fp32) built inside offload.init: the process's peak RSS grows by less than a
    third of that (the largest module, the embedding, is 25 MB; then pages leave as modules complete)."""
    done = subprocess.run([sys.executable, "-c", BUILD.format(root=str(ROOT), nvme=str(tmp_path))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    grew, model_bytes = map(int, done.stdout.split())
    assert grew < model_bytes / 3, (grew, model_bytes)


INITIALIZE = textwrap.dedent("""
    import gc, sys, torch
    sys.path.insert(0, {root!r})
    import offload
    from offload.models import GPT, GPTConfig
    def status(key):
        return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
    torch.empty(1, device=offload.default_device())  # CUDA's context is up before anything is measured
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, context=64, layers=8, heads=8, width=512))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    zero = {{"stage": {stage}, "offload_optimizer": {{"device": "cpu"}},
            "offload_param": {{"device": {param!r}, "nvme_path": {nvme!r}}}}}
    gc.collect()
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts from here
    engine = offload.initialize(model, {{"zero_optimization": zero}})
    print(before, status("VmHWM"), status("VmRSS"), model_bytes)
    engine.close()
""")


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"],
                         ids=["optimizer on cpu", "optimizer + parameters on cpu", "parameters on nvme"])
def test_initialize_holds_a_model_built_in_ram_and_its_state_one_at_a_time(param, tmp_path):
    """A 25M-parameter GPT built in RAM in fp32 (100 MB), optimizer state on the host (12 B/param): each parameter
    is read into the masters and moved to its home before the next is read, so initialize's peak RSS stays within
    a quarter of the model of the larger of before (the model) and after (the state); it was their sum."""
    done = subprocess.run([sys.executable, "-c", INITIALIZE.format(root=str(ROOT), stage=3 if param != "none" else 2,
                                                                   param=param, nvme=str(tmp_path))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, peak, after, model_bytes = map(int, done.stdout.split())
    assert after > before - model_bytes / 4  # the state (3x the model) was allocated: the measure sees memory
    assert peak - max(before, after) < model_bytes / 4, (before, peak, after, model_bytes)


def save_checkpoint(tmp_path: Path, kind: str, state: dict[str, torch.Tensor]) -> Path:
    """``state`` written as transformers would: one safetensors file, two shards with an index, or a torch file."""
    from safetensors.torch import save_file

    folder = tmp_path / f"ckpt-{kind}"
    folder.mkdir()
    if kind == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
        return folder / "model.safetensors"
    if kind == "torch":
        torch.save(state, folder / "pytorch_model.bin")
        return folder / "pytorch_model.bin"
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    return folder


def pretrained() -> dict[str, torch.Tensor]:
    """Other weights than make()'s, fp32, without the tied head's second name (as transformers saves them)."""
    state = {k: v.clone() for k, v in make(seed=42).state_dict().items()}
    del state["head.weight"]
    return state


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "torch"])
def test_load_into_a_model_built_in_the_arena(tmp_path, kind):
    source = save_checkpoint(tmp_path, kind, want := pretrained())
    cfg = config(tmp_path)
    with offload.init(cfg):
        model = make()
    result = offload.load_state_dict(model, source)
    assert result.missing == [] and result.unexpected == []
    with offload.initialize(model, cfg) as engine:
        state = engine.consolidated_state_dict()  # fp32 masters: exactly the checkpoint's values
    for k, v in want.items():
        assert torch.equal(state[k], v), k


@pytest.mark.parametrize("opt, param", [("cpu", "none"), ("nvme", "cpu"), ("nvme", "nvme")])
def test_load_into_an_engine_keeps_the_moments(tmp_path, opt, param):
    source = save_checkpoint(tmp_path, "sharded", want := pretrained())
    cfg = config(tmp_path, opt, param, sub_group_size=1000)
    cfg["bf16"] = {"enabled": True}
    with offload.initialize(make(), cfg) as engine:
        train_steps(engine, batches(2))
        before = []
        for sg in engine.layout.sub_groups:  # one staged block at a time (NVMe state)
            before.append(engine.optimizer.read_state(sg)[sg.numel:].clone())
            engine.optimizer.done_state(sg, dirty=False)
        engine.load_state_dict(source)
        state = engine.consolidated_state_dict()
        for sg, m in zip(engine.layout.sub_groups, before):
            assert torch.equal(engine.optimizer.read_state(sg)[sg.numel:], m)  # Adam's moments untouched
            engine.optimizer.done_state(sg, dirty=False)
        for name, p in engine.module.named_parameters():
            if name in want:
                assert torch.equal(engine.read_parameter(p), want[name].to(torch.bfloat16)), name
        assert engine.global_steps == 2
        train_steps(engine, batches(1, seed=3))  # and it trains on from there
    for k, v in want.items():
        assert torch.equal(state[k], v), k


def test_a_mismatched_checkpoint_is_named_or_reported(tmp_path):
    state = pretrained()
    state["extra.weight"] = torch.zeros(3)
    del state["pos"]
    source = save_checkpoint(tmp_path, "safetensors", state)
    model = make()
    with pytest.raises(ValueError, match=r"missing \['pos'\].*unexpected \['extra.weight'\]"):
        offload.load_state_dict(model, source)
    result = offload.load_state_dict(model, source, strict=False)
    assert result.missing == ["pos"] and result.unexpected == ["extra.weight"]
    close_enough(model.tok.weight, state["tok.weight"], 0.0)
    bad = {**pretrained(), "tok.weight": torch.zeros(5, 5)}
    with pytest.raises(ValueError, match=r"checkpoint tensor tok.weight has shape \(5, 5\), the model's is"):
        offload.load_state_dict(make(), bad)
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors"):
        offload.load_state_dict(make(), tmp_path)


def test_a_folder_with_model_safetensors_and_an_index_loads_what_from_pretrained_loads(tmp_path):
    """from_pretrained reads model.safetensors before model.safetensors.index.json, as the export's crash order
    assumes (a new single file is renamed in before the old index goes); the load read the index."""
    import shutil

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(transformers.LlamaForCausalLM(cfg))
    new, old, model = models
    old.save_pretrained(tmp_path / "x", max_shard_size="20KB")  # an earlier sharded export
    new.save_pretrained(tmp_path / "single")
    shutil.copy(tmp_path / "single" / "model.safetensors", tmp_path / "x" / "model.safetensors")
    assert (tmp_path / "x" / "model.safetensors.index.json").exists()
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "x")).state_dict()
    offload.load_state_dict(model, tmp_path / "x")
    for name, want in new.state_dict().items():
        assert torch.equal(hf[name], want) and torch.equal(model.state_dict()[name], want), name


def test_a_damaged_shard_is_named_and_nothing_loads(tmp_path):
    """A truncated shard (a partial copy): safetensors' own error names no file; with many shards the load's does."""
    folder = save_checkpoint(tmp_path, "sharded", pretrained())
    victim = folder / "model-00002-of-00002.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"checkpoint file .*model-00002-of-00002.safetensors is not a readable "
                                         r"safetensors file .*copy it again"):
        offload.load_state_dict(model, folder)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_checkpoints_match_as_from_pretrained_matches_them(tmp_path):
    """A transformers model takes what from_pretrained takes: a checkpoint of its base model (names without the
    ``model.`` prefix) into the model with a head, one with an older transformers' per-layer
    ``rotary_emb.inv_freq`` (a buffer the model computes, in no state dict now), both strictly and equal to
    from_pretrained's model; and a model on the meta device is refused (a copy into it did nothing, silently)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = transformers.LlamaModel(cfg)
    base.save_pretrained(tmp_path / "base")
    legacy = {f"model.{k}": v.contiguous() for k, v in base.state_dict().items()}
    legacy.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": base.rotary_emb.inv_freq.clone()
                   for i in range(2)})
    (tmp_path / "legacy").mkdir()
    save_file(legacy, str(tmp_path / "legacy" / "model.safetensors"))
    cfg.save_pretrained(tmp_path / "legacy")
    x = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        want = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))(x).logits
    for folder in ("base", "legacy"):
        torch.manual_seed(1)
        model = transformers.LlamaForCausalLM(cfg)
        result = offload.load_state_dict(model, tmp_path / folder)
        assert result.missing == result.unexpected == [], folder
        with torch.no_grad():
            assert torch.equal(model(x).logits, want), folder
    # the decision is the whole checkpoint's: a base model's norm never fills the head's own norm of that name too
    class Base(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(4)

    class Head(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model, self.norm = Base(), torch.nn.LayerNorm(4)

    head = Head()
    result = offload.load_state_dict(head, {"norm.weight": torch.full((4,), 3.0), "norm.bias": torch.zeros(4)},
                                     strict=False)
    assert result.missing == ["norm.weight", "norm.bias"] and bool((head.model.norm.weight == 3).all())
    assert bool((head.norm.weight == 1).all())
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"on the meta device, where nothing can be written"):
        offload.load_state_dict(empty, tmp_path / "base")


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
HUB_LAYOUTS = {  # architectures whose save_pretrained writes another layout than the model holds
    "Mixtral": dict(SMALL, num_local_experts=4),
    "Qwen2Moe": dict(SMALL, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "Qwen3Moe": dict(SMALL, num_experts=4, moe_intermediate_size=16),
    "Olmoe": dict(SMALL, num_experts=4),
    "Phimoe": dict(SMALL, num_local_experts=4),
    "DeepseekV3": dict(SMALL, n_routed_experts=4, moe_intermediate_size=16, n_group=1, topk_group=1,
                       first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8),
    "Jamba": dict(SMALL, num_experts=4),
    "GPTNeoX": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4),
}


def test_a_checkpoint_in_the_hubs_layout_loads_as_from_pretrained_converts_it(tmp_path):
    """transformers 5 fuses Mixtral's experts (``mlp.experts.gate_up_proj``) where its checkpoints, and its own
    save_pretrained, hold ``block_sparse_moe.experts.{i}.w1/w2/w3.weight``: a load converts them with the model's
    mapping, as from_pretrained does, into a model built under offload.init and into an engine (masters, and the
    forward after it), equal to from_pretrained's model; the engine's export writes them back as save_pretrained
    does, whole or sharded; a checkpoint of narrower experts is refused, naming the tensors it came from, before
    anything is written."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(pytest.importorskip("transformers.conversion_mapping"), "get_model_conversion_mapping"):
        pytest.skip("this transformers keeps Mixtral's experts as the checkpoints do")
    cfg = transformers.MixtralConfig(**HUB_LAYOUTS["Mixtral"], num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "hub")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hub" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in f.keys()  # the Hub's layout
    ref = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hub"))
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    assert want["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        logits = ref(x).logits
    torch.manual_seed(1)
    with offload.init(config(tmp_path / "a")):
        model = transformers.MixtralForCausalLM(cfg)
    result = offload.load_state_dict(model, tmp_path / "hub")
    assert result.missing == result.unexpected == []
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    torch.manual_seed(2)
    with offload.initialize(transformers.MixtralForCausalLM(cfg), config(tmp_path / "b")) as engine:
        assert engine.load_state_dict(tmp_path / "hub").missing == []
        state = engine.consolidated_state_dict()
        assert all(torch.equal(state[k], want[k]) for k in state)
        with torch.no_grad():
            close_enough(engine(x).logits.float().cpu(), logits, 1e-5)
        for name, shard in (("one", "5GB"), ("shards", "20KB")):  # 20 KB: an expert tensor's parts straddle shards
            files = engine.save_safetensors(tmp_path / name, max_shard_size=shard)
            assert (len(files) > 2) is (name == "shards")
            with offload_load.StateSource(tmp_path / name) as ours, offload_load.StateSource(tmp_path / "hub") as hub:
                assert sorted(ours.names()) == sorted(hub.names())  # what save_pretrained wrote
                assert all(torch.equal(ours.get(n), hub.get(n)) for n in hub.names())
    other = transformers.MixtralConfig(**{**cfg.to_dict(), "intermediate_size": 40})
    transformers.MixtralForCausalLM(other).save_pretrained(tmp_path / "narrow")
    model = transformers.MixtralForCausalLM(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"tensor model.layers.0.mlp.experts.gate_up_proj \(converted from "
                                         r"model.layers.0.block_sparse_moe.experts.0.w1.weight and 7 more\) has "
                                         r"shape \(4, 80, 32\), the model's is \(4, 96, 32\)"):
        offload.load_state_dict(model, tmp_path / "narrow")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("arch", list(HUB_LAYOUTS))
def test_hub_layouts_of_moe_and_renamed_models_load_as_from_pretrained(tmp_path, arch):
    """Fused experts (their checkpoints hold one tensor per expert and projection) and renamed heads (GPT-NeoX's
    ``embed_out``): strictly, every tensor equal to from_pretrained's; an engine's export of the model writes
    save_pretrained's files back, name for name and bit for bit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.core_model_loading")
    config_class = getattr(transformers, f"{arch}Config", None)
    if config_class is None:
        pytest.skip(f"this transformers has no {arch}")
    cfg = config_class(**HUB_LAYOUTS[arch])
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    torch.manual_seed(0)
    model_class(cfg).save_pretrained(tmp_path)
    want = model_class.from_pretrained(str(tmp_path)).state_dict()
    torch.manual_seed(1)
    model = model_class(cfg)
    offload.load_state_dict(model, tmp_path)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])] == []
    with offload.initialize(model, config(tmp_path / "e", "cpu", "none")) as engine:  # and back, as save_pretrained
        engine.save_safetensors(tmp_path / "out")
    with offload_load.StateSource(tmp_path) as hub, offload_load.StateSource(tmp_path / "out") as ours:
        assert sorted(ours.names()) == sorted(hub.names())
        assert all(torch.equal(ours.get(n), hub.get(n)) for n in hub.names())


def test_the_cli_export_of_a_checkpoint_takes_the_hubs_layout_from_the_config_beside_it(tmp_path):
    """``python -m offload export`` of an engine checkpoint of a MoE: with the model's config.json beside the
    checkpoint (as OffloadTrainer's checkpoint-N folders hold it) or given with --model, the files are
    save_pretrained's, config.json included (from_pretrained(out) needs nothing else); without one, the model's own
    names, which from_pretrained loads too."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.core_model_loading")
    from offload.cli import main

    cfg = transformers.MixtralConfig(**HUB_LAYOUTS["Mixtral"])
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "hub")
    with offload.initialize(transformers.MixtralForCausalLM(cfg), config(tmp_path / "e", "cpu", "none")) as engine:
        engine.load_state_dict(tmp_path / "hub")
        engine.save_checkpoint(tmp_path / "run" / "offload_state")
    with offload_load.StateSource(tmp_path / "hub") as hub:
        saved = {n: hub.get(n) for n in hub.names()}
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hub")).state_dict()
    assert main(["export", str(tmp_path / "run" / "offload_state"), str(tmp_path / "own")]) == 0
    with offload_load.StateSource(tmp_path / "own") as own:
        assert "model.layers.0.mlp.experts.gate_up_proj" in own.names()  # no config: the model's names
    cfg.dtype = torch.bfloat16  # a run's config (the weights exported are the fp32 masters)
    cfg.save_pretrained(tmp_path / "run")  # beside the checkpoint, as the Trainer leaves it
    assert main(["export", str(tmp_path / "run" / "offload_state"), str(tmp_path / "beside")]) == 0
    assert main(["export", str(tmp_path / "run" / "offload_state"), str(tmp_path / "given"), "--model",
                 str(tmp_path / "run" / "config.json"), "--max-shard-size", "20KB"]) == 0
    for out in ("beside", "given"):
        with offload_load.StateSource(tmp_path / out) as ours:
            assert sorted(ours.names()) == sorted(saved), out
            assert all(torch.equal(ours.get(n), saved[n]) for n in saved), out
        # the config.json goes with the weights, saying fp32: from_pretrained(out) alone reads the model
        assert json.loads((tmp_path / out / "config.json").read_text())["dtype"] == "float32"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / out), dtype="auto").state_dict()
        assert type(transformers.AutoConfig.from_pretrained(str(tmp_path / out))) is type(cfg), out
        assert loaded.keys() == want.keys() and all(torch.equal(loaded[n], want[n]) for n in want), out
    assert not (tmp_path / "own" / "config.json").exists()


def test_an_incomplete_or_doubled_expert_set_is_named_and_the_rest_loads(tmp_path):
    """One expert's projection missing: strictly refused, naming how many tensors of each kind the checkpoint holds
    for that fused tensor; with strict=False everything else loads and that tensor is missing, its parts
    unexpected (as checkpoint keys). A layer held both fused and per expert: the fused one (the model's spelling)
    loads, the per-expert keys are reported, never dropped silently."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.core_model_loading")
    cfg = transformers.MixtralConfig(**HUB_LAYOUTS["Mixtral"])
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    want = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    with offload_load.StateSource(tmp_path) as src:
        hub = {n: src.get(n) for n in src.names()}
    short = {k: v for k, v in hub.items() if k != "model.layers.0.block_sparse_moe.experts.3.w3.weight"}
    model = transformers.MixtralForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"into model.layers.0.mlp.experts.gate_up_proj .*holds 4 x \S*w1\S*, "
                                         r"3 x \S*w3\S* for it"):
        offload.load_state_dict(model, short)
    result = offload.load_state_dict(model, short, strict=False)
    assert result.missing == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert result.unexpected == sorted(k for k in short if ".layers.0.block_sparse_moe.experts." in k and
                                       (".w1." in k or ".w3." in k))
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if k not in result.missing)
    doubled = {**hub, "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 96, 32)}
    result = offload.load_state_dict(model, doubled, strict=False)
    assert result.missing == [] and len(result.unexpected) == 8  # layer 0's w1 and w3 of 4 experts
    assert not model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].any()


def test_a_conversion_that_keeps_the_name_still_applies(tmp_path):
    """Qwen3-VL-MoE's checkpoints for transformers 4.57 hold its experts transposed under the names the model
    has now (transformers' mapping transposes them back): read as from_pretrained reads them, the base model's
    checkpoint into the model with a head too."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.core_model_loading")
    if not hasattr(transformers, "Qwen3VLMoeConfig"):
        pytest.skip("this transformers has no Qwen3-VL-MoE")
    from safetensors.torch import save_file

    cfg = transformers.Qwen3VLMoeConfig(
        text_config=dict(SMALL, num_experts=4, moe_intermediate_size=8, num_experts_per_tok=2, head_dim=8,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]}),
        vision_config=dict(hidden_size=32, intermediate_size=48, depth=1, num_heads=4, out_hidden_size=32,
                           patch_size=14, deepstack_visual_indexes=[0]))
    cls = transformers.Qwen3VLMoeForConditionalGeneration
    torch.manual_seed(0)
    state = cls(cfg).state_dict()
    released = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                else v.contiguous() for k, v in state.items()}
    cfg.save_pretrained(tmp_path)
    save_file(released, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    want = cls.from_pretrained(str(tmp_path)).state_dict()
    assert torch.equal(want["model.language_model.layers.0.mlp.experts.gate_up_proj"],
                       state["model.language_model.layers.0.mlp.experts.gate_up_proj"])
    torch.manual_seed(1)
    model = cls(cfg)
    offload.load_state_dict(model, tmp_path)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])] == []
    # the base model's checkpoint (no "model." prefix): the transpose looks its target up under the model's name
    base = {k.removeprefix("model."): v for k, v in released.items() if k.startswith("model.")}
    torch.manual_seed(1)
    model = cls(cfg)
    result = offload.load_state_dict(model, base, strict=False)
    assert result.missing == ["lm_head.weight"] and result.unexpected == []
    assert [k for k, v in model.state_dict().items() if k != "lm_head.weight" and not torch.equal(v, want[k])] == []


@pytest.mark.parametrize("arch", ["Dinov2", "NomicBert"])
def test_an_export_joins_what_a_load_split(tmp_path, arch):
    """Dinov2 with SwiGLU and NomicBert split one checkpoint tensor in two at load: an engine's export joins them
    again, as save_pretrained does (its files, name for name and bit for bit), whole and in 3 KB shards."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.core_model_loading")
    if not hasattr(transformers, f"{arch}Config"):
        pytest.skip(f"this transformers has no {arch}")
    if arch == "Dinov2":
        cfg = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, image_size=28, patch_size=14, use_swiglu_ffn=True)
    else:
        cfg = transformers.NomicBertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=48)
    cls = getattr(transformers, f"{arch}Model")
    torch.manual_seed(0)
    cls(cfg).save_pretrained(tmp_path / "hub")
    with offload_load.StateSource(tmp_path / "hub") as hub:
        saved = {n: hub.get(n) for n in hub.names()}
    with offload.initialize(cls(cfg), config(tmp_path / "e", "cpu", "none")) as engine:
        engine.load_state_dict(tmp_path / "hub")
        for shard in ("5GB", "3KB"):
            engine.save_safetensors(tmp_path / shard, max_shard_size=shard)
            with offload_load.StateSource(tmp_path / shard) as ours:
                assert sorted(ours.names()) == sorted(saved)
                assert all(torch.equal(ours.get(n), saved[n]) for n in saved)


@pytest.mark.parametrize("opt", ["nvme", "cpu"])
def test_a_load_that_fails_midway_gives_its_staged_state_back(tmp_path, opt, monkeypatch):
    """A tensor of the wrong shape fails the load before anything is written (shapes come from the source's
    headers). A read that fails midway (here the source's 6th tensor) stops the load after it has read some
    sub-groups: every staged block goes back (none stays claimed, holding an NVMe staging buffer), what was loaded
    before it is kept whole (masters and homes), nothing of it or after it is, and the engine trains on."""
    from offload.persist import _load

    cfg = config(tmp_path, opt, "none", sub_group_size=1000)
    with offload.initialize(make(), cfg) as engine:
        layout = engine.layout
        names = {id(p): n for n, p in engine.module.named_parameters()}
        order = [names[id(p)] for p in layout.params]
        bad = order[len(order) // 2]
        before = engine.consolidated_state_dict()
        with pytest.raises(ValueError, match=f"checkpoint tensor {bad} has shape .*nothing was loaded"):
            engine.load_state_dict({**pretrained(), bad: torch.zeros(3)}, strict=False)
        assert all(torch.equal(v, before[k]) for k, v in engine.consolidated_state_dict().items())

        source, reads, get = pretrained(), [], _load.StateSource.get

        def failing_get(self, name):
            reads.append(name)
            if len(reads) == 6:
                raise OSError(5, "Input/output error (injected)")
            return get(self, name)

        monkeypatch.setattr(_load.StateSource, "get", failing_get)
        with pytest.raises(OSError, match="injected"):
            engine.load_state_dict(source, strict=False)
        monkeypatch.undo()
        failed = order.index(reads[-1])
        if opt == "nvme":
            assert not [m.key for m in engine.optimizer.store._managed.values() if m.claimed]
        state = engine.consolidated_state_dict()  # read from the tier: nothing written was only in a staged copy
        params = dict(engine.module.named_parameters())
        for name in order[:failed]:
            assert torch.equal(state[name], source[name]), name
            assert torch.equal(engine.read_parameter(params[name]), source[name]), name
        for name in order[failed:]:
            assert torch.equal(state[name], before[name]), name
        train_steps(engine, batches(2, seed=3))
