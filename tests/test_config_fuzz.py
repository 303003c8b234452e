"""Property-based fuzz of the JSON configuration (``OffloadConfig.load(dict)``).

A table here lists every key with its full dotted path and what it accepts. From it hypothesis builds valid
configurations (which must load and round-trip through ``to_dict``), and configurations with one invalid value or
one unknown key planted at a random place (which must raise ValueError naming the full dotted key and saying what
is allowed; never another exception type).
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import OffloadConfig
from offload.config import _IGNORED, _IGNORED_IN

BOOL, INT, FLOAT, CHOICE, BYTES, BETAS, PATH, POW2, DEVICE, DERIVED, SPARSE = \
    "bool int float choice bytes betas path pow2 device derived sparse".split()

# dotted key -> (kind, arguments); ints and floats: (lo, hi or None), floats also whether lo itself is excluded
SCHEMA: dict[str, tuple] = {
    "train_micro_batch_size_per_gpu": (INT, 1, None),
    "gradient_accumulation_steps": (INT, 1, None),
    "train_batch_size": (INT, 1, None),
    "seed": (INT, 0, None),
    "gradient_clipping": (FLOAT, 0.0, None, False),
    "sparse_gradients": (SPARSE,),
    "fp16.enabled": (BOOL,),
    "fp16.loss_scale": (FLOAT, 0.0, None, False),
    "fp16.initial_scale_power": (INT, 0, 64),
    "fp16.loss_scale_window": (INT, 1, None),
    "fp16.hysteresis": (INT, 1, None),
    "fp16.consecutive_hysteresis": (BOOL,),
    "fp16.min_loss_scale": (FLOAT, 0.0, None, True),
    "fp16.auto_cast": (BOOL,),
    "bf16.enabled": (BOOL,),
    "optimizer.type": (CHOICE, ("adam", "adamw")),
    "optimizer.params.lr": (FLOAT, 0.0, None, False),
    "optimizer.params.eps": (FLOAT, 0.0, None, True),
    "optimizer.params.weight_decay": (FLOAT, 0.0, None, False),
    "optimizer.params.betas": (BETAS,),
    "optimizer.params.bias_correction": (BOOL,),
    "optimizer.params.adam_w_mode": (BOOL,),
    "zero_optimization.stage": (INT, 0, 3),
    "zero_optimization.sub_group_size": (DERIVED, 1, None),
    "zero_optimization.stage3_max_live_parameters": (DERIVED, 1, None),
    "zero_optimization.stage3_prefetch_bucket_size": (DERIVED, 1, None),
    "zero_optimization.stage3_param_persistence_threshold": (DERIVED, 0, None),
    "zero_optimization.stage3_max_reuse_distance": (INT, 1, None),
    "zero_optimization.contiguous_gradients": (BOOL,),
    "zero_optimization.overlap_comm": (BOOL,),
    "zero_optimization.reduce_scatter": (BOOL,),
    "zero_optimization.reduce_bucket_size": (DERIVED, 1, None),
    "zero_optimization.allgather_bucket_size": (INT, 1, None),
    "zero_optimization.allgather_partitions": (BOOL,),
    "zero_optimization.round_robin_gradients": (BOOL,),
    "zero_optimization.offload_optimizer.device": (CHOICE, ("none", "cpu", "nvme")),
    "zero_optimization.offload_optimizer.nvme_path": (PATH,),
    "zero_optimization.offload_optimizer.pin_memory": (BOOL,),
    "zero_optimization.offload_optimizer.buffer_count": (DERIVED, 1, 64),
    "zero_optimization.offload_optimizer.fast_init": (BOOL,),
    "zero_optimization.offload_optimizer.delayed_update": (BOOL,),
    "zero_optimization.offload_optimizer.overlap_step": (BOOL,),
    "zero_optimization.offload_param.device": (CHOICE, ("none", "cpu", "nvme")),
    "zero_optimization.offload_param.nvme_path": (PATH,),
    "zero_optimization.offload_param.pin_memory": (BOOL,),
    "zero_optimization.offload_param.buffer_count": (INT, 1, 1024),
    "zero_optimization.offload_param.buffer_size": (INT, 1, None),
    "zero_optimization.offload_param.max_in_cpu": (INT, 1, None),
    "aio.block_size": (POW2, 4096, 256 << 20),
    "aio.queue_depth": (INT, 8, 8),  # valid range depends on thread_count; the generator keeps them consistent
    "aio.thread_count": (INT, 1, 8),
    "aio.backend": (CHOICE, ("auto", "aio", "threads", "aiofiles")),
    "aio.single_submit": (BOOL,),
    "aio.overlap_events": (BOOL,),
    "aio.o_direct": (BOOL,),
    "aio.checksum": (BOOL,),
    "offload.device": (DEVICE,),
    "offload.device_memory_budget": (BYTES,),
    "offload.host_memory_budget": (BYTES,),
    "offload.nvme_memory_budget": (BYTES,),
}
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in SCHEMA if "." in k} | {""})
huge = st.integers(min_value=1 << 40, max_value=1 << 62)


def valid_value(key: str) -> st.SearchStrategy:
    kind, *args = SCHEMA[key]
    if kind == BOOL:
        return st.booleans()
    if kind in (INT, DERIVED):
        lo, hi = args
        out = st.integers(lo, hi if hi is not None else lo + 10**6) | (huge if hi is None else st.nothing())
        return out | st.sampled_from([None, "auto", "AUTO"]) if kind == DERIVED else out
    if kind == FLOAT:
        lo, hi, open_lo = args
        return st.floats(lo, 1e6, exclude_min=open_lo, allow_nan=False) | st.integers(int(lo) + 1, 100)
    if kind == CHOICE:
        return st.sampled_from(args[0]) | st.sampled_from(args[0]).map(str.upper)
    if kind == BETAS:
        return st.lists(st.floats(0.0, 0.999), min_size=2, max_size=2)
    if kind == PATH:
        return st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1,
                       max_size=30)
    if kind == POW2:
        return st.integers(12, 28).map(lambda b: 1 << b)
    if kind == BYTES:
        return (st.integers(0, 1 << 50) | st.sampled_from(["1GiB", "512 MB", "0.5GB", "1e9", "4096", "2 TiB"])
                | st.none())
    if kind == DEVICE:
        return st.sampled_from(["auto", "cpu", "cuda", "CUDA", "Auto"]) | st.integers(0, 99).map(lambda i: f"cuda:{i}")
    if kind == SPARSE:
        return st.booleans() | st.sampled_from(["lazy", "Lazy"])
    raise AssertionError(kind)


def invalid_value(key: str) -> st.SearchStrategy:
    """Values the key must refuse: wrong types, out-of-range numbers, non-finite numbers, unknown choices."""
    kind, *args = SCHEMA[key]
    junk = st.sampled_from([[], {}, "x", [1, 2, 3], {"a": 1}])
    nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])
    if kind == BOOL:
        return junk | st.integers() | st.sampled_from(["true", "yes", 0.0, None])
    if kind in (INT, DERIVED):
        lo, hi = args
        out = junk | st.booleans() | st.integers(max_value=lo - 1) | nonfinite | st.floats(0.1, 0.9) | \
            st.sampled_from(["8", None] if key not in ("train_batch_size", "seed") and kind == INT else ["8"])
        return out | st.integers(min_value=hi + 1) if hi is not None else out
    if kind == FLOAT:
        lo, hi, open_lo = args
        out = junk | st.booleans() | nonfinite | st.floats(max_value=lo, exclude_max=not open_lo) | st.just(None)
        return out
    if kind == CHOICE:
        return junk | st.booleans() | st.integers() | st.text(max_size=8).filter(lambda s: s.lower() not in args[0])
    if kind == BETAS:
        return (junk | st.lists(st.floats(0.0, 0.5), max_size=4).filter(lambda v: len(v) != 2)
                | st.tuples(st.floats(1.0, 10.0), st.floats(0.0, 0.5)).map(list)
                | st.tuples(st.floats(max_value=-0.001), st.floats(0.0, 0.5)).map(list)
                | st.tuples(st.booleans(), st.floats(0.0, 0.5)).map(list)
                | st.tuples(nonfinite, st.floats(0.0, 0.5)).map(list))
    if kind == PATH:
        return st.integers() | st.booleans() | st.sampled_from([[], {}, "a\x00b"])
    if kind == POW2:
        return (junk | st.booleans() | st.integers(max_value=4095) | st.integers(min_value=(256 << 20) + 1)
                | st.integers(4097, 1 << 20).filter(lambda v: v & (v - 1)) | st.floats(4096.0, 8192.0))
    if kind == BYTES:
        return (junk.filter(lambda v: v != "x") | st.just("x") | st.booleans() | st.integers(max_value=-1)
                | nonfinite | st.floats(0.1, 0.9) | st.sampled_from(["12 parsecs", "-5GB", "1e400", "GB", ""]))
    if kind == DEVICE:
        return (junk | st.booleans() | st.integers() | st.sampled_from(["gpu", "cuda:", "cuda:-1", "cuda:0:1", " cpu",
                                                                        "tpu", "", None]))
    if kind == SPARSE:
        return junk | st.integers() | st.sampled_from(["true", "lazyy", "", None])
    raise AssertionError(kind)


def put(cfg: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


@st.composite
def valid_configs(draw) -> dict:
    cfg: dict = {}
    keys = draw(st.lists(st.sampled_from(sorted(SCHEMA)), unique=True, max_size=20))
    for key in keys:
        if key in ("aio.queue_depth", "fp16.enabled", "bf16.enabled") or \
                key.startswith("zero_optimization.") and key.endswith((".device", ".nvme_path")):
            continue  # drawn below, consistently
        put(cfg, key, draw(valid_value(key)))
    if draw(st.booleans()):
        threads = cfg.get("aio", {}).get("thread_count", 1)
        put(cfg, "aio.queue_depth", draw(st.integers(threads, 256 * threads)))
    precision = draw(st.sampled_from(["fp32", "fp16", "bf16"]))
    if precision != "fp32":
        put(cfg, f"{precision}.enabled", True)
    for section in ("offload_optimizer", "offload_param"):
        device = draw(st.sampled_from(["none", "cpu", "nvme", None]))
        if device is not None:
            put(cfg, f"zero_optimization.{section}.device", device)
        if device == "nvme" or draw(st.booleans()):
            put(cfg, f"zero_optimization.{section}.nvme_path", draw(valid_value(f"zero_optimization.{section}."
                                                                              "nvme_path")))
        if section == "offload_param" and device in ("cpu", "nvme"):
            put(cfg, "zero_optimization.stage", 3)
    return cfg


def check_error(exc: ValueError, key: str) -> None:
    msg = str(exc)
    assert key in msg, f"{key} not named in: {msg}"
    assert any(w in msg for w in ("must", "allowed", "required", "one of", "needs")), msg


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs())
def test_valid_configs_load_and_round_trip(cfg):
    loaded = OffloadConfig.load(cfg)
    plain = loaded.to_dict()
    assert OffloadConfig.load(json.loads(json.dumps(plain))) == loaded


@settings(max_examples=600, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_one_invalid_value_names_its_key(data):
    cfg = data.draw(valid_configs())
    key = data.draw(st.sampled_from(sorted(SCHEMA)))
    bad = data.draw(invalid_value(key))
    if key == "aio.queue_depth":  # invalid against the thread_count the config ends up with
        threads = cfg.get("aio", {}).get("thread_count", 1)
        bad = data.draw(st.integers(max_value=threads - 1) | st.integers(min_value=256 * threads + 1)
                        | st.sampled_from(["8", 8.5, True, None]))
    if key == "aio.thread_count":
        cfg.get("aio", {}).pop("queue_depth", None)
    put(cfg, key, bad)
    with pytest.raises(ValueError) as info:
        OffloadConfig.load(cfg)
    check_error(info.value, key)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_unknown_keys_are_named(data):
    cfg = data.draw(valid_configs())
    section = data.draw(st.sampled_from(SECTIONS))
    known = {k.rsplit(".", 1)[-1] for k in SCHEMA if (k.rsplit(".", 1)[0] if "." in k else "") == section}
    known |= {k.split(".")[0] for k in SCHEMA} if section == "" else set()
    known |= {"params", "intra_op_parallelism", "use_gds", "bfloat16", "ignored", "batch_keys"} | _IGNORED | \
        _IGNORED_IN.get(section, set())
    name = data.draw(st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True).filter(lambda n: n not in known))
    full = f"{section}.{name}" if section else name
    put(cfg, full, 1)
    with pytest.raises(ValueError, match="unknown key") as info:
        OffloadConfig.load(cfg)
    assert full in str(info.value) and "allowed" in str(info.value)


@pytest.mark.parametrize("value", [{"ignored": ["x"]}, {"ignored": 5}, {"batch_keys": ["train_batch_size"]}])
def test_ignored_is_not_a_user_key(value):
    with pytest.raises(ValueError, match=f"unknown key {next(iter(value))}"):
        OffloadConfig.load(value)


def test_batch_keys_complete_alike_from_json_python_and_a_round_trip():
    """train_batch_size with a micro-batch gives the accumulation steps whether the config came as JSON, was built
    in Python or went through to_dict() (which writes only the batch keys that were set); three that disagree are
    refused either way. warmup_num_steps 0 is DeepSpeed's 2 (Hugging Face's config fills it from warmup_steps 0)."""
    given = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}
    built = [OffloadConfig.load(given), OffloadConfig(**given)]
    built.append(OffloadConfig.load(json.loads(json.dumps(built[0].to_dict()))))
    assert [c.for_world(2).gradient_accumulation_steps for c in built] == [2, 2, 2]
    assert OffloadConfig.load({"train_batch_size": 16}).for_world(2).train_micro_batch_size_per_gpu == 8
    with pytest.raises(ValueError, match="train_batch_size 16 must equal"):
        OffloadConfig(**given, gradient_accumulation_steps=3).for_world(1)
    assert OffloadConfig.load({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})


def test_deepspeed_keys_without_effect_here_are_accepted_and_named(caplog):
    """The keys of a Hugging Face DeepSpeed config that change nothing here (16-bit weights gathered on save:
    every export here is the fp32 masters; DeepSpeed's gradient pre-division) load, with a warning naming them."""
    with caplog.at_level("WARNING", logger="offload"):
        cfg = OffloadConfig.load({"prescale_gradients": False, "gradient_predivide_factor": 1.0,
                                  "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                                        "memory_efficient_linear": False}})
    assert cfg.zero_optimization.stage == 3 and cfg.ignored == ("prescale_gradients", "gradient_predivide_factor")
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="offload"):  # read and checked, but the engine sizes its own
        OffloadConfig.load({"zero_optimization": {
            "stage": 3, "reduce_scatter": True, "allgather_bucket_size": 5e8, "stage3_max_reuse_distance": 1e9,
            "offload_optimizer": {"device": "cpu", "fast_init": False},
            "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5, "max_in_cpu": 1e9}}})
    for key in ("zero_optimization.reduce_scatter", "zero_optimization.allgather_bucket_size",
                "zero_optimization.stage3_max_reuse_distance", "zero_optimization.offload_optimizer.fast_init",
                "zero_optimization.offload_param.pin_memory", "zero_optimization.offload_param.buffer_count",
                "zero_optimization.offload_param.max_in_cpu"):
        assert f"without effect: {key}" in caplog.text, key


def test_deepspeed_switches_for_what_is_not_built_are_taken_off_and_refused_on(caplog):
    """Keys of DeepSpeed's config examples for features not built here load at the value that leaves them off
    (DeepSpeed's default) and are refused at any other, naming what they would turn on; the old spelling
    zero_optimization.cpu_offload reads as offload_optimizer.device "cpu"."""
    with caplog.at_level("WARNING", logger="offload"):
        cfg = OffloadConfig.load({
            "bf16": {"enabled": True, "immediate_grad_update": True, "check_grad_overflow": True,
                     "bf16_master_weights_and_grads": False},
            "fp16": {"fp16_master_weights_and_grads": False},
            "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "amsgrad": False}},
            "data_types": {"grad_accum_dtype": "fp32"}, "torch_autocast": {"enabled": False}, "compile": {},
            "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                  "zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                                  "mics_shard_size": -1, "stage3_module_granularity_threshold": 0,
                                  "offload_optimizer": {"ratio": 1.0, "pipeline_read": False}}})
    zero = cfg.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_param.device) == ("cpu", "cpu")
    assert "zero_optimization.cpu_offload is DeepSpeed's old spelling of zero_optimization.offload_optimizer" \
        in caplog.text
    for key in ("bf16.immediate_grad_update", "optimizer.params.torch_adam",
                "zero_optimization.offload_optimizer.pipeline_read",
                "zero_optimization.stage3_module_granularity_threshold"):
        assert f"without effect: {key}" in caplog.text, key
    assert "without effect: data_types, compile" in caplog.text
    for bad, key, what in [({"optimizer": {"params": {"amsgrad": True}}}, "optimizer.params.amsgrad", "AMSGrad"),
                           ({"zero_optimization": {"zero_quantized_gradients": True}},
                            "zero_optimization.zero_quantized_gradients", "ZeRO\\+\\+"),
                           ({"zero_optimization": {"zero_hpz_partition_size": 8}},
                            "zero_optimization.zero_hpz_partition_size", "hierarchical"),
                           ({"zero_optimization": {"offload_optimizer": {"ratio": 0.3}}},
                            "zero_optimization.offload_optimizer.ratio", "partial optimizer offload"),
                           ({"bf16": {"bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads",
                            "bf16 master weights"),
                           ({"torch_autocast": {"enabled": True}}, "torch_autocast", 'only "enabled": false')]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.") + " = .*" + what):
            OffloadConfig.load(bad)
    OffloadConfig.load({"zero_optimization": {"zero_hpz_partition_size": 0, "mics_shard_size": 0,
                                              "cpu_offload_params": False}})  # DeepSpeed's other "off"s
    with pytest.raises(ValueError, match=r"zero_optimization.cpu_offload \(DeepSpeed's old spelling\) and "
                                         r"zero_optimization.offload_optimizer.device are both given"):
        OffloadConfig.load({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme"}}})


@pytest.mark.parametrize("bad, key", [({"seed": math.nan}, "seed"), ({"seed": math.inf}, "seed"),
                                      ({"offload": {"host_memory_budget": math.inf}}, "offload.host_memory_budget"),
                                      ({"offload": {"host_memory_budget": "1e400"}}, "offload.host_memory_budget"),
                                      ({"optimizer": {"params": {"lr": math.inf}}}, "optimizer.params.lr")])
def test_non_finite_numbers_are_value_errors(bad, key):
    """Found by the fuzz: these raised OverflowError or an unnamed ValueError from int()/float()."""
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        OffloadConfig.load(bad)


@pytest.mark.parametrize("key, cfg", [
    ("train_batch_size", {"train_batch_size": "auto"}),
    ("gradient_clipping", {"gradient_clipping": "auto"}),
    ("optimizer.params.lr", {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}),
])
def test_auto_outside_the_trainer_says_where_it_is_filled_in(key, cfg):
    """A config written for transformers' Trainer has "auto" values; with offload.initialize they name the key and
    say that OffloadTrainer fills them in (it said only "must be an integer")."""
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + r" must be .*got 'auto': \"auto\" is filled in "
                       r"from the TrainingArguments by OffloadTrainer"):
        OffloadConfig.load(cfg)


@pytest.mark.parametrize("section, message", [
    ({"params": {}}, "scheduler.type is required"),
    ({"type": "Cosine"}, "scheduler.type must be one of warmuplr, warmupdecaylr, warmupcosinelr"),
    ({"type": "OneCycle"}, r"scheduler.type 'OneCycle' is not built in here .* a torch scheduler on "
                           r"engine.optimizer"),
    ({"type": "WarmupDecayLR"}, "scheduler.params.total_num_steps is required for WarmupDecayLR"),
    ({"type": "WarmupCosineLR"}, "scheduler.params.total_num_steps is required for WarmupCosineLR"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_max_lr": 1e-3}},
     r"scheduler.params.warmup_max_lr does not apply to warmupcosinelr .*takes warmup_min_ratio"),
    ({"type": "WarmupLR", "params": {"total_num_steps": 9}}, "scheduler.params.total_num_steps does not apply to "
                                                             "warmuplr"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}},
     r"scheduler.params.cos_min_ratio must be in \[0.0, 1.0\]"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "scheduler.params.warmup_type must be one of"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, r"scheduler.params.warmup_num_steps must be in"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "unknown key scheduler.params.warmup_steps"),
    ({"type": "WarmupLR", "extra": 1}, "unknown key scheduler.extra"),
])
def test_scheduler_section_errors_name_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.load({"scheduler": section})


@pytest.mark.parametrize("section", [
    {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                                         "warmup_type": "linear", "total_num_steps": 100}},
    {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.0}}])
def test_scheduler_section_round_trips(section):
    cfg = OffloadConfig.load({"scheduler": section})
    assert OffloadConfig.load(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "scheduler" not in OffloadConfig.load({}).to_dict()
