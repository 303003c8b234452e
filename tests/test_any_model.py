"""Any model trains unchanged with its parameters offloaded (issue 40): every module of ``torch.nn`` that holds
parameters, transformers architectures from tiny configs and torchvision's ViT, each trained 3 steps under stage 3
with parameters and optimizer state on NVMe and every parameter offloaded (``stage3_param_persistence_threshold``
0), against torch's AdamW on the un-offloaded model: losses and parameters (buffers too) equal, fp32, 1e-5.

Many of these modules read parameters outside their own module's forward (``nn.MultiheadAttention`` reads
``out_proj.weight`` itself, ``nn.LinearCrossEntropyLoss`` its ``linear``'s, a parent its ``nn.ParameterList``'s),
the pattern the engine must fetch on read. The engine trains on the machine's device; the reference runs there
too (tests/models.py)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import offload
from models import DEVICE, on_device, placement_config

# eps 1e-6, not 1e-8: attention's key bias has an analytically zero gradient (softmax ignores a shift shared by
# every key), so its gradient is rounding noise (~1e-10), which Adam with eps 1e-8 turns into steps of ~lr/100 that
# no two correct implementations share element by element (1e-4 apart after 3 steps); eps 1e-6 keeps them ~1e-7
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-6, 0.01
STEPS = 3
TOL = 1e-5

Batch = tuple[torch.Tensor, ...]


def all_nvme(tmp_path) -> dict:
    """Stage 3 with parameters and optimizer state on NVMe; a persistence threshold of 0: no parameter stays on the
    device between its uses."""
    return {"optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "param")},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "opt")}},
            "aio": {"block_size": 1 << 16}}


def torch_adamw(model: nn.Module, data: list[Batch], loss_fn) -> tuple[dict[str, torch.Tensor], list[float]]:
    """torch's AdamW on the un-offloaded model (on DEVICE), over its trainable parameters (Whisper freezes its
    encoder's positions). One left without a gradient gets a zero one: the offloaded optimizer steps every element
    of a sub-group together, as DeepSpeed's does."""
    model.to(DEVICE)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for batch in data:
        opt.zero_grad()
        loss = loss_fn(model, on_device(batch))
        loss.backward()
        losses.append(loss.item())
        for p in trained:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, losses


def offloaded(model: nn.Module, data: list[Batch], loss_fn, tmp_path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same run on the engine, every parameter and the optimizer state on NVMe."""
    losses = []
    with offload.initialize(model, all_nvme(tmp_path)) as engine:
        for batch in data:
            loss = loss_fn(engine.module, batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.consolidated_state_dict()
    return state, losses


def assert_trains_as_torch(build: Callable[[], nn.Module], data: list[Batch], loss_fn, tmp_path) -> None:
    """``build()`` (deterministic) trained on the engine and by torch's AdamW: the same losses and final state."""
    ref_state, ref_losses = torch_adamw(build(), data, loss_fn)
    state, losses = offloaded(build(), data, loss_fn, tmp_path)
    assert losses == pytest.approx(ref_losses, rel=TOL, abs=1e-6), (losses, ref_losses)
    assert set(state) >= set(ref_state), sorted(set(ref_state) - set(state))
    for key, want in ref_state.items():
        got = state[key].cpu()
        if not want.is_floating_point():
            assert torch.equal(got, want), key
            continue
        err = ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1.0)).max().item()
        assert err <= TOL, (key, err)


# ---------------------------------------------------------------------------------------------------- torch.nn

D = 512  # attention width: from 317 up MultiheadAttention's out_proj.weight outgrows the default persistence
HEADS, FF = 8, 64


class Probe(nn.Module):
    """An input projection (for float inputs), the module under test, and a head reducing its output (last
    dimension ``d_out``) to a scalar loss: every parameter of the module gets a gradient through a real use."""

    def __init__(self, module: nn.Module, call: Callable[..., torch.Tensor], d_in: int | None, d_out: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_in) if d_in else None
        self.module = module
        self.call = call
        self.head = nn.Linear(d_out, 1)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        return self.head(self.call(self.module, x, *rest)).square().mean()


@dataclasses.dataclass(frozen=True)
class NnCase:
    """One module of torch.nn in a Probe. ``cls``: the class it sweeps (a lazy module becomes another after its
    dry run). ``batch(g)``: one batch of inputs on the CPU. ``dry``: a forward before training, which a lazy module
    needs to create its parameters."""

    cls: type[nn.Module]
    make: Callable[[], nn.Module]
    call: Callable[..., torch.Tensor]
    batch: Callable[[torch.Generator], Batch]
    d_in: int | None
    d_out: int
    dry: bool = False
    slow: bool = False


def floats(*shape: int) -> Callable[[torch.Generator], Batch]:
    return lambda g: (torch.randn(*shape, generator=g),)


def channels_first(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A channel-first module on channel-last activations (the projection and head work on the last dimension)."""
    return m(x.movedim(-1, 1)).movedim(1, -1)


def first(m: nn.Module, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return m(x, *rest)[0]


def two_steps(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A recurrent cell over two time steps (x: time, batch, features); an LSTMCell's state is (h, c)."""
    state = m(x[0])
    state = m(x[1], state)
    return state[0] if isinstance(state, tuple) else state


def self_attention(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x, x, x, need_weights=False)[0]


def causal_attention(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
    return m(x, x, x, attn_mask=mask, is_causal=True)[0]


def decode(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder (layer) attending to the first positions of its own input as the memory."""
    return m(x, x[:, :4])


def classes_out(m: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample outputs of a loss module (AdaptiveLogSoftmaxWithLoss, LinearCrossEntropyLoss)."""
    out = m(x, target.to(x.device))
    return getattr(out, "output", out).unsqueeze(-1)


def read_list(m: nn.ParameterList, x: torch.Tensor) -> torch.Tensor:
    """Its parent reads a ParameterList (which has no forward of its own)."""
    return torch.tanh(x @ m[0]) @ m[1] + m[2]


def read_dict(m: nn.ParameterDict, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ m["w"]) * m["scale"]


def ids(rows: int, *shape: int) -> Callable[[torch.Generator], Batch]:
    return lambda g: (torch.randint(0, rows, shape, generator=g),)


def with_targets(classes: int, n: int, d: int) -> Callable[[torch.Generator], Batch]:
    return lambda g: (torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g))


def with_keys(g: torch.Generator) -> Batch:
    return torch.randn(2, 6, D, generator=g), torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 32, generator=g)


def bag_offsets(g: torch.Generator) -> Batch:
    return torch.randint(0, 50, (12,), generator=g), torch.tensor([0, 3, 7, 7])


def apply(m: nn.Module, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return m(x, *rest)


def encoder_layer(**kw) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, **kw)


def decoder_layer(**kw) -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, **kw)


ATTN = floats(2, 6, D)
SEQ = floats(5, 3, 16)  # time, batch, features
NN_CASES: dict[str, NnCase] = {
    "MultiheadAttention": NnCase(nn.MultiheadAttention, lambda: nn.MultiheadAttention(D, HEADS), self_attention,
                                 floats(6, 2, D), D, D),
    "MultiheadAttention-batch-first": NnCase(nn.MultiheadAttention,
                                             lambda: nn.MultiheadAttention(D, HEADS, batch_first=True),
                                             self_attention, ATTN, D, D, slow=True),
    "MultiheadAttention-no-bias": NnCase(nn.MultiheadAttention,
                                         lambda: nn.MultiheadAttention(D, HEADS, bias=False, batch_first=True),
                                         self_attention, ATTN, D, D, slow=True),
    "MultiheadAttention-bias-kv-zero-attn": NnCase(
        nn.MultiheadAttention, lambda: nn.MultiheadAttention(D, HEADS, add_bias_kv=True, add_zero_attn=True,
                                                             batch_first=True),
        self_attention, ATTN, D, D, slow=True),
    "MultiheadAttention-kdim-vdim": NnCase(
        nn.MultiheadAttention, lambda: nn.MultiheadAttention(D, HEADS, kdim=64, vdim=32, batch_first=True),
        first, with_keys, D, D),
    "MultiheadAttention-causal-weights": NnCase(nn.MultiheadAttention,
                                                lambda: nn.MultiheadAttention(D, HEADS, batch_first=True),
                                                causal_attention, ATTN, D, D, slow=True),
    "TransformerEncoderLayer": NnCase(nn.TransformerEncoderLayer, encoder_layer, apply, ATTN, D, D),
    "TransformerEncoderLayer-norm-first-gelu": NnCase(nn.TransformerEncoderLayer,
                                                      lambda: encoder_layer(norm_first=True, activation="gelu"),
                                                      apply, ATTN, D, D, slow=True),
    "TransformerDecoderLayer": NnCase(nn.TransformerDecoderLayer, decoder_layer, decode, ATTN, D, D, slow=True),
    "TransformerEncoder": NnCase(nn.TransformerEncoder,
                                 lambda: nn.TransformerEncoder(encoder_layer(), 2, norm=nn.LayerNorm(D),
                                                               enable_nested_tensor=False),
                                 apply, ATTN, D, D, slow=True),
    "TransformerDecoder": NnCase(nn.TransformerDecoder, lambda: nn.TransformerDecoder(decoder_layer(), 1),
                                 decode, ATTN, D, D, slow=True),
    "Transformer": NnCase(nn.Transformer,
                          lambda: nn.Transformer(D, HEADS, 1, 1, FF, dropout=0.0, batch_first=True), decode,
                          ATTN, D, D, slow=True),
    "RNN": NnCase(nn.RNN, lambda: nn.RNN(16, 24, num_layers=2), first, SEQ, 16, 24, slow=True),
    "RNN-relu-bidirectional": NnCase(nn.RNN, lambda: nn.RNN(16, 24, nonlinearity="relu", bidirectional=True),
                                     first, SEQ, 16, 48, slow=True),
    "LSTM": NnCase(nn.LSTM, lambda: nn.LSTM(16, 24, num_layers=2), first, SEQ, 16, 24),
    "LSTM-proj-bidirectional-batch-first": NnCase(
        nn.LSTM, lambda: nn.LSTM(16, 24, proj_size=8, bidirectional=True, batch_first=True), first, SEQ, 16, 16,
        slow=True),
    "GRU": NnCase(nn.GRU, lambda: nn.GRU(16, 24, num_layers=2, bias=False), first, SEQ, 16, 24, slow=True),
    "RNNCell": NnCase(nn.RNNCell, lambda: nn.RNNCell(16, 24), two_steps, SEQ, 16, 24, slow=True),
    "LSTMCell": NnCase(nn.LSTMCell, lambda: nn.LSTMCell(16, 24), two_steps, SEQ, 16, 24, slow=True),
    "GRUCell": NnCase(nn.GRUCell, lambda: nn.GRUCell(16, 24), two_steps, SEQ, 16, 24, slow=True),
    "Conv1d": NnCase(nn.Conv1d, lambda: nn.Conv1d(4, 6, 3, padding=1), channels_first, floats(2, 10, 4), 4, 6,
                     slow=True),
    "Conv2d": NnCase(nn.Conv2d, lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1), channels_first,
                     floats(2, 8, 8, 4), 4, 6),
    "Conv2d-groups-dilation-reflect": NnCase(
        nn.Conv2d, lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2, padding_mode="reflect"),
        channels_first, floats(2, 8, 8, 4), 4, 6, slow=True),
    "Conv3d": NnCase(nn.Conv3d, lambda: nn.Conv3d(4, 6, 3), channels_first, floats(2, 5, 5, 5, 4), 4, 6,
                     slow=True),
    "ConvTranspose1d": NnCase(nn.ConvTranspose1d, lambda: nn.ConvTranspose1d(4, 6, 3, stride=2), channels_first,
                              floats(2, 10, 4), 4, 6, slow=True),
    "ConvTranspose2d": NnCase(nn.ConvTranspose2d, lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2),
                              channels_first, floats(2, 5, 5, 4), 4, 6, slow=True),
    "ConvTranspose3d": NnCase(nn.ConvTranspose3d, lambda: nn.ConvTranspose3d(4, 6, 2), channels_first,
                              floats(2, 3, 3, 3, 4), 4, 6, slow=True),
    "Linear": NnCase(nn.Linear, lambda: nn.Linear(16, 24), apply, floats(4, 16), 16, 24, slow=True),
    "Linear-weight-norm": NnCase(nn.Linear, lambda: parametrizations.weight_norm(nn.Linear(16, 24)), apply,
                                 floats(4, 16), 16, 24, slow=True),
    "Linear-spectral-norm": NnCase(nn.Linear, lambda: parametrizations.spectral_norm(nn.Linear(16, 24)), apply,
                                   floats(4, 16), 16, 24, slow=True),
    "Linear-orthogonal": NnCase(nn.Linear, lambda: parametrizations.orthogonal(nn.Linear(16, 16)), apply,
                                floats(4, 16), 16, 16, slow=True),
    "Bilinear": NnCase(nn.Bilinear, lambda: nn.Bilinear(16, 16, 24), lambda m, x: m(x, x.flip(-1)),
                       floats(4, 16), 16, 24),
    "Embedding": NnCase(nn.Embedding, lambda: nn.Embedding(50, 16, padding_idx=0), apply, ids(50, 4, 6), None, 16),
    "EmbeddingBag": NnCase(nn.EmbeddingBag, lambda: nn.EmbeddingBag(50, 16, mode="mean"), apply, ids(50, 4, 6),
                           None, 16, slow=True),
    "EmbeddingBag-offsets-max": NnCase(nn.EmbeddingBag, lambda: nn.EmbeddingBag(50, 16, mode="max"), apply,
                                       bag_offsets, None, 16, slow=True),
    "LayerNorm": NnCase(nn.LayerNorm, lambda: nn.LayerNorm(16), apply, floats(4, 16), 16, 16, slow=True),
    "RMSNorm": NnCase(nn.RMSNorm, lambda: nn.RMSNorm(16), apply, floats(4, 16), 16, 16, slow=True),
    "GroupNorm": NnCase(nn.GroupNorm, lambda: nn.GroupNorm(2, 6), channels_first, floats(2, 7, 6), 6, 6,
                        slow=True),
    "BatchNorm1d": NnCase(nn.BatchNorm1d, lambda: nn.BatchNorm1d(16), apply, floats(8, 16), 16, 16, slow=True),
    "BatchNorm2d": NnCase(nn.BatchNorm2d, lambda: nn.BatchNorm2d(6), channels_first, floats(4, 5, 5, 6), 6, 6),
    "BatchNorm3d": NnCase(nn.BatchNorm3d, lambda: nn.BatchNorm3d(6), channels_first, floats(2, 3, 3, 3, 6), 6, 6,
                          slow=True),
    "SyncBatchNorm": NnCase(nn.SyncBatchNorm, lambda: nn.SyncBatchNorm(6), channels_first, floats(4, 5, 5, 6),
                            6, 6, slow=True),
    "InstanceNorm1d": NnCase(nn.InstanceNorm1d, lambda: nn.InstanceNorm1d(6, affine=True), channels_first,
                             floats(2, 7, 6), 6, 6, slow=True),
    "InstanceNorm2d": NnCase(nn.InstanceNorm2d,
                             lambda: nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
                             channels_first, floats(2, 5, 5, 6), 6, 6, slow=True),
    "InstanceNorm3d": NnCase(nn.InstanceNorm3d, lambda: nn.InstanceNorm3d(6, affine=True), channels_first,
                             floats(2, 3, 3, 3, 6), 6, 6, slow=True),
    "PReLU": NnCase(nn.PReLU, lambda: nn.PReLU(), apply, floats(4, 16), 16, 16, slow=True),
    "PReLU-per-channel": NnCase(nn.PReLU, lambda: nn.PReLU(6), channels_first, floats(2, 7, 6), 6, 6, slow=True),
    "AdaptiveLogSoftmaxWithLoss": NnCase(nn.AdaptiveLogSoftmaxWithLoss,
                                         lambda: nn.AdaptiveLogSoftmaxWithLoss(16, 40, [10, 20], head_bias=True),
                                         classes_out, with_targets(40, 12, 16), 16, 1),
    "LinearCrossEntropyLoss": NnCase(nn.LinearCrossEntropyLoss,
                                     lambda: nn.LinearCrossEntropyLoss(16, 40, bias=True, reduction="none"),
                                     classes_out, with_targets(40, 12, 16), 16, 1),
    "ParameterList": NnCase(nn.ParameterList,
                            lambda: nn.ParameterList([torch.randn(16, 32) / 4, torch.randn(32, 8) / 6,
                                                      torch.zeros(8)]),
                            read_list, floats(4, 16), 16, 8),
    "ParameterDict": NnCase(nn.ParameterDict,
                            lambda: nn.ParameterDict({"w": torch.randn(16, 8) / 4, "scale": torch.ones(8)}),
                            read_dict, floats(4, 16), 16, 8, slow=True),
    "ParameterDict-0-dim": NnCase(nn.ParameterDict,
                                  lambda: nn.ParameterDict({"w": torch.randn(16, 8) / 4, "scale": torch.tensor(1.5)}),
                                  read_dict, floats(4, 16), 16, 8),
    "LazyLinear": NnCase(nn.LazyLinear, lambda: nn.LazyLinear(24), apply, floats(4, 16), 16, 24, dry=True),
    "LazyConv1d": NnCase(nn.LazyConv1d, lambda: nn.LazyConv1d(6, 3), channels_first, floats(2, 10, 4), 4, 6,
                         dry=True, slow=True),
    "LazyConv2d": NnCase(nn.LazyConv2d, lambda: nn.LazyConv2d(6, 3), channels_first, floats(2, 6, 6, 4), 4, 6,
                         dry=True, slow=True),
    "LazyConv3d": NnCase(nn.LazyConv3d, lambda: nn.LazyConv3d(6, 2), channels_first, floats(2, 3, 3, 3, 4), 4, 6,
                         dry=True, slow=True),
    "LazyConvTranspose1d": NnCase(nn.LazyConvTranspose1d, lambda: nn.LazyConvTranspose1d(6, 3), channels_first,
                                  floats(2, 10, 4), 4, 6, dry=True, slow=True),
    "LazyConvTranspose2d": NnCase(nn.LazyConvTranspose2d, lambda: nn.LazyConvTranspose2d(6, 3), channels_first,
                                  floats(2, 5, 5, 4), 4, 6, dry=True, slow=True),
    "LazyConvTranspose3d": NnCase(nn.LazyConvTranspose3d, lambda: nn.LazyConvTranspose3d(6, 2), channels_first,
                                  floats(2, 3, 3, 3, 4), 4, 6, dry=True, slow=True),
    "LazyBatchNorm1d": NnCase(nn.LazyBatchNorm1d, nn.LazyBatchNorm1d, apply, floats(8, 16), 16, 16, dry=True,
                              slow=True),
    "LazyBatchNorm2d": NnCase(nn.LazyBatchNorm2d, nn.LazyBatchNorm2d, channels_first, floats(4, 5, 5, 6), 6, 6,
                              dry=True, slow=True),
    "LazyBatchNorm3d": NnCase(nn.LazyBatchNorm3d, nn.LazyBatchNorm3d, channels_first, floats(2, 3, 3, 3, 6), 6, 6,
                              dry=True, slow=True),
    "LazyInstanceNorm1d": NnCase(nn.LazyInstanceNorm1d, lambda: nn.LazyInstanceNorm1d(affine=True),
                                 channels_first, floats(2, 7, 6), 6, 6, dry=True, slow=True),
    "LazyInstanceNorm2d": NnCase(nn.LazyInstanceNorm2d, lambda: nn.LazyInstanceNorm2d(affine=True),
                                 channels_first, floats(2, 5, 5, 6), 6, 6, dry=True, slow=True),
    "LazyInstanceNorm3d": NnCase(nn.LazyInstanceNorm3d, lambda: nn.LazyInstanceNorm3d(affine=True),
                                 channels_first, floats(2, 3, 3, 3, 6), 6, 6, dry=True, slow=True),
}

# Public nn.Module classes of torch.nn the sweep leaves out, and why. Everything else either holds no parameters
# when built from simple arguments or is swept above (test_every_torch_nn_module_with_parameters_is_swept).
NN_SKIPPED = {
    "RNNBase": "the base class of RNN, LSTM and GRU (swept); built through them",
    "RNNCellBase": "the base class of RNNCell, LSTMCell and GRUCell (swept); built through them",
    "Module": "the base class: each case here is one (Probe), and so is TinyGPT, whose forward reads its own pos",
    "Container": "deprecated container; holds no parameters of its own",
    "Unflatten": "a reshape: needs a dimension and a shape, holds no parameters",
}


def nn_probe(case: NnCase) -> Probe:
    torch.manual_seed(0)
    probe = Probe(case.make(), case.call, case.d_in, case.d_out)
    if case.dry:
        with torch.no_grad():
            probe(*case.batch(torch.Generator().manual_seed(99)))
    return probe


def nn_batches(case: NnCase) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [case.batch(g) for _ in range(STEPS)]


def probe_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(*batch)


def marked(cases: dict) -> list:
    return [pytest.param(name, id=name, marks=[pytest.mark.slow] if case.slow else []) for name, case in cases.items()]


@pytest.mark.parametrize("name", marked(NN_CASES))
def test_torch_nn_module_trains_as_torch_with_every_parameter_on_nvme(tmp_path, name):
    case = NN_CASES[name]
    assert_trains_as_torch(lambda: nn_probe(case), nn_batches(case), probe_loss, tmp_path)


SIMPLE_ARGUMENTS = [(), (8,), (8, 8), (8, 8, 3), (2, 8)]


def test_every_torch_nn_module_with_parameters_is_swept():
    """Every public module class of torch.nn is swept, skipped with a reason, or holds no parameters when built
    from simple arguments, so a module a new torch adds is not missed silently."""
    swept = {case.cls.__name__ for case in NN_CASES.values()}
    assert not swept & set(NN_SKIPPED)
    classes = {name: cls for name, cls in vars(nn).items()
               if not name.startswith("_") and inspect.isclass(cls) and issubclass(cls, nn.Module)}
    assert set(NN_SKIPPED) <= set(classes), sorted(set(NN_SKIPPED) - set(classes))
    missed = []
    for name, cls in sorted(classes.items()):
        if name in swept or name in NN_SKIPPED:
            continue
        built = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for args in SIMPLE_ARGUMENTS:
                try:
                    built.append(cls(*args))
                except Exception:  # noqa: BLE001 -- any failure: these are not its arguments
                    continue
        if not built or any(next(m.parameters(), None) is not None for m in built):
            missed.append(name)
    assert not missed, f"torch.nn modules neither swept nor in NN_SKIPPED (with a reason): {missed}"


# ---------------------------------------------------------------------------------------------------- transformers

VOCAB = 128
DECODER = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


@dataclasses.dataclass(frozen=True)
class HfCase:
    """A transformers model from a tiny config (random init, no download). ``keys``: the keyword each tensor of a
    batch is given as; the model's own loss (``labels``) is trained."""

    model: str
    config: str
    settings: dict
    keys: tuple[str, ...]
    batch: Callable[[torch.Generator], Batch]
    slow: bool = False


def tokens(*shape: int, vocab: int = VOCAB) -> Callable[[torch.Generator], Batch]:
    """Causal LM: the ids are their own labels (the model shifts them)."""
    def batch(g: torch.Generator) -> Batch:
        x = torch.randint(1, vocab, shape, generator=g)
        return x, x
    return batch


def masked(g: torch.Generator) -> Batch:
    """Masked LM: about a third of the positions scored, the rest ignored (-100)."""
    x = torch.randint(1, VOCAB, (2, 12), generator=g)
    labels = torch.where(torch.rand(x.shape, generator=g) < 0.35, x, torch.full_like(x, -100))
    labels[:, 0] = x[:, 0]
    return x, labels


def seq2seq(g: torch.Generator) -> Batch:
    return torch.randint(1, VOCAB, (2, 10), generator=g), torch.randint(1, VOCAB, (2, 6), generator=g)


def images(g: torch.Generator) -> Batch:
    return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 5, (2,), generator=g)


def mel(g: torch.Generator) -> Batch:
    return torch.randn(2, 8, 16, generator=g), torch.randint(2, VOCAB, (2, 6), generator=g)


def speech(g: torch.Generator) -> Batch:
    return torch.randn(2, 400, generator=g), torch.randint(1, 32, (2, 5), generator=g)


def image_text(g: torch.Generator) -> Batch:
    return torch.randint(1, VOCAB, (3, 8), generator=g), torch.randn(3, 3, 16, 16, generator=g)


LM = ("input_ids", "labels")
HF_CASES: dict[str, HfCase] = {
    "gpt2": HfCase("GPT2LMHeadModel", "GPT2Config",
                   {"vocab_size": VOCAB, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4}, LM,
                   tokens(2, 12)),
    "llama": HfCase("LlamaForCausalLM", "LlamaConfig", DECODER, LM, tokens(2, 12), slow=True),
    "qwen2-tied": HfCase("Qwen2ForCausalLM", "Qwen2Config", {**DECODER, "tie_word_embeddings": True}, LM,
                         tokens(2, 12), slow=True),
    "qwen3": HfCase("Qwen3ForCausalLM", "Qwen3Config", {**DECODER, "head_dim": 16}, LM, tokens(2, 12), slow=True),
    "mistral-sliding": HfCase("MistralForCausalLM", "MistralConfig", {**DECODER, "sliding_window": 4}, LM,
                              tokens(2, 12), slow=True),
    "mixtral-moe": HfCase("MixtralForCausalLM", "MixtralConfig",
                          {**DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}, LM, tokens(2, 12)),
    "qwen3-moe": HfCase("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        {**DECODER, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "decoder_sparse_step": 1}, LM, tokens(2, 12), slow=True),
    "gemma": HfCase("GemmaForCausalLM", "GemmaConfig", {**DECODER, "head_dim": 16}, LM, tokens(2, 12), slow=True),
    "phi3": HfCase("Phi3ForCausalLM", "Phi3Config", {**DECODER, "pad_token_id": 0}, LM, tokens(2, 12), slow=True),
    "gpt-neox": HfCase("GPTNeoXForCausalLM", "GPTNeoXConfig",
                       {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "max_position_embeddings": 32, "rotary_pct": 0.5}, LM,
                       tokens(2, 12), slow=True),
    "opt": HfCase("OPTForCausalLM", "OPTConfig",
                  {"vocab_size": VOCAB, "hidden_size": 64, "ffn_dim": 96, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "max_position_embeddings": 32, "word_embed_proj_dim": 64}, LM,
                  tokens(2, 12), slow=True),
    "falcon": HfCase("FalconForCausalLM", "FalconConfig",
                     {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
                     LM, tokens(2, 12), slow=True),
    "bloom-alibi": HfCase("BloomForCausalLM", "BloomConfig",
                          {"vocab_size": VOCAB, "hidden_size": 64, "n_layer": 2, "n_head": 4}, LM, tokens(2, 12),
                          slow=True),
    "bert-mlm": HfCase("BertForMaskedLM", "BertConfig",
                       {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "intermediate_size": 96, "max_position_embeddings": 32}, LM, masked),
    "roberta-mlm": HfCase("RobertaForMaskedLM", "RobertaConfig",
                          {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "intermediate_size": 96, "max_position_embeddings": 40}, LM, masked, slow=True),
    "t5": HfCase("T5ForConditionalGeneration", "T5Config",
                 {"vocab_size": VOCAB, "d_model": 64, "d_kv": 16, "d_ff": 96, "num_layers": 2,
                  "num_decoder_layers": 2, "num_heads": 4, "decoder_start_token_id": 0, "pad_token_id": 0}, LM,
                 seq2seq),
    "bart": HfCase("BartForConditionalGeneration", "BartConfig",
                   {"vocab_size": VOCAB, "d_model": 64, "encoder_layers": 1, "decoder_layers": 1,
                    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 96,
                    "decoder_ffn_dim": 96, "max_position_embeddings": 32}, LM, seq2seq, slow=True),
    "vit": HfCase("ViTForImageClassification", "ViTConfig",
                  {"image_size": 16, "patch_size": 4, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "intermediate_size": 96, "num_labels": 5},
                  ("pixel_values", "labels"), images),
    "whisper": HfCase("WhisperForConditionalGeneration", "WhisperConfig",
                      {"vocab_size": VOCAB, "num_mel_bins": 8, "encoder_layers": 1, "decoder_layers": 1, "d_model": 64,
                       "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 96,
                       "decoder_ffn_dim": 96, "max_source_positions": 8, "max_target_positions": 16,
                       "decoder_start_token_id": 1, "pad_token_id": 0},
                      ("input_features", "labels"), mel, slow=True),
    "wav2vec2-ctc": HfCase("Wav2Vec2ForCTC", "Wav2Vec2Config",
                           {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "intermediate_size": 96, "conv_dim": (16, 16), "conv_stride": (5, 4),
                            "conv_kernel": (10, 4), "num_conv_pos_embeddings": 8, "num_conv_pos_embedding_groups": 4,
                            "mask_time_prob": 0.0, "ctc_zero_infinity": True, "pad_token_id": 0},
                           ("input_values", "labels"), speech, slow=True),
    "clip": HfCase("CLIPModel", "CLIPConfig",
                   {"text_config": {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 16},
                    "vision_config": {"image_size": 16, "patch_size": 4, "hidden_size": 64, "intermediate_size": 96,
                                      "num_hidden_layers": 1, "num_attention_heads": 4},
                    "projection_dim": 32},
                   ("input_ids", "pixel_values"), image_text, slow=True),
}


def without_dropout(config) -> None:
    """Every dropout and layer-drop probability of ``config`` (and its sub-configs) set to 0: the runs compared
    must draw nothing at random."""
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict"):
            without_dropout(value)
        elif isinstance(value, float) and any(s in key for s in ("dropout", "pdrop", "layerdrop", "drop_prob")):
            setattr(config, key, 0.0)


def hf_model(case: HfCase) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, case.config)(**case.settings, attn_implementation="eager")
    without_dropout(config)
    torch.manual_seed(0)
    return getattr(transformers, case.model)(config).float()


def hf_loss(case: HfCase) -> Callable[[nn.Module, Batch], torch.Tensor]:
    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        extra = {"return_loss": True} if "labels" not in case.keys else {}
        return model(**dict(zip(case.keys, batch)), **extra).loss
    return loss


@pytest.mark.parametrize("name", marked(HF_CASES))
def test_transformers_model_trains_as_torch_with_every_parameter_on_nvme(tmp_path, name):
    case = HF_CASES[name]
    g = torch.Generator().manual_seed(1)
    assert_trains_as_torch(lambda: hf_model(case), [case.batch(g) for _ in range(STEPS)], hf_loss(case), tmp_path)


# ---------------------------------------------------------------------------------------------------- torchvision


def torchvision_vit() -> nn.Module:
    """torchvision's ViT (its blocks are nn.MultiheadAttention), width 512, one layer, 32x32 images."""
    try:
        from torchvision.models.vision_transformer import VisionTransformer
    except (ImportError, RuntimeError) as exc:  # RuntimeError: a wheel built for another torch (CUDA's, on a CPU one)
        pytest.skip(f"torchvision is not usable here ({type(exc).__name__}: {exc}); pip install torchvision matching "
                    f"torch {torch.__version__}")
    torch.manual_seed(0)
    return VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=HEADS, hidden_dim=D, mlp_dim=FF,
                             num_classes=5)


def classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y.to(logits.device))


def test_torchvision_vit_trains_as_torch_with_every_parameter_on_nvme(tmp_path):
    torchvision_vit()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 5, (2,), generator=g)) for _ in range(STEPS)]
    assert_trains_as_torch(torchvision_vit, data, classify, tmp_path)


@pytest.mark.parametrize("make_module", [lambda: nn.Embedding(50, 16, max_norm=1.0),
                                         lambda: nn.EmbeddingBag(50, 16, max_norm=2.0)], ids=["Embedding", "Bag"])
def test_an_embedding_whose_forward_writes_its_weight_is_refused_naming_it(tmp_path, make_module):
    """``max_norm`` renormalises, in place, the rows a forward reads: the engine's fp32 masters never saw it and the
    next step wrote the rows back unrenormalised, so the run drifted from torch's from step 2 without a word (with
    nothing offloaded too). Refused at initialize, naming the module and the ways out; frozen, it is accepted."""
    model = nn.Sequential(make_module())
    with pytest.raises(ValueError, match=r"Embedding(Bag)? '0' has max_norm=.*Set max_norm=None"):
        offload.initialize(model, placement_config(tmp_path, "all-nvme"))
    model.requires_grad_(False)
    offload.initialize(model, placement_config(tmp_path, "all-nvme")).close()
