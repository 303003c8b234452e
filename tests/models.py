"""Small models for tests: a GPT-style transformer with tied embeddings and a position *parameter* (not a module),
deterministic (no dropout). Its blocks are the package's (offload/models.py).

``DEVICE`` is where the library trains on this machine (``offload.device: "auto"``: CUDA when present): engines
run there, and so do the references they are checked against (``reference_model``, ``on_device``), so the two
share kernels; results are compared on the CPU. On CUDA the attention runs its deterministic (math) kernel, so
runs that must agree bit for bit do, in this process and in the subprocesses that import this module.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from offload._device import resolve_device
from offload.models import Block, GPTConfig

# local_rank=0: the rank processes of the multi-rank tests import this module too (with LOCAL_RANK 1, 2, more ranks
# than a one-GPU machine has GPUs); their engines choose their own device, this is the test process's reference.
DEVICE = resolve_device("auto", local_rank=0)
if DEVICE.type == "cuda":
    torch.backends.cuda.enable_flash_sdp(False)  # flash and memory-efficient attention backward use atomics;
    torch.backends.cuda.enable_mem_efficient_sdp(False)  # torch calls cuDNN's attention nondeterministic (and
    torch.backends.cuda.enable_cudnn_sdp(False)  # prefers it on sm90 with recent cuDNN)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 96, d: int = 32, layers: int = 2, heads: int = 2, ctx: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(GPTConfig(width=d, heads=heads, layers=layers)) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make(seed: int = 0, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw)


def reference_model(seed: int = 0, **kw) -> TinyGPT:
    """``make(seed, **kw)`` on DEVICE: the un-offloaded model the engine is compared with."""
    return make(seed, **kw).to(DEVICE)


def on_device(batch):
    """A batch (tensors, or tuples/lists of them) on DEVICE, for references (the engine moves its own inputs)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(DEVICE)
    return type(batch)(on_device(t) for t in batch)


def batches(n: int, vocab: int = 96, bsz: int = 4, t: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (bsz, t), generator=g), torch.randint(0, vocab, (bsz, t), generator=g))
            for _ in range(n)]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of next-token logits; the targets follow the logits to their device."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.to(logits.device).reshape(-1))


PLACEMENTS = {  # zero_optimization of each placement: the optimizer state's tier, and stage 3's parameter homes
    "opt-host": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "opt-host-overlap": {"stage": 2, "offload_optimizer": {"device": "cpu", "overlap_forward": True}},
    "opt-nvme": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
    "params-host": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "params-nvme": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}},
    "all-nvme": {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}


def placement_config(tmp_path, placement: str, *, lr: float = 3e-3, live: int = 30_000, bucket: int = 8_000,
                     **extra) -> dict:
    """A config of TinyGPT's size for ``placement`` (swap files under ``tmp_path``): stage 3's window of ``live``
    elements, fetched ``bucket`` at a time; ``extra`` goes to the top level."""
    zero = {"sub_group_size": 4096, "stage3_max_live_parameters": live, "stage3_prefetch_bucket_size": bucket,
            "stage3_param_persistence_threshold": 100, **copy.deepcopy(PLACEMENTS[placement])}
    for section in ("offload_optimizer", "offload_param"):
        if section in zero:
            zero[section]["nvme_path"] = str(tmp_path / section)
    return {"optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "zero_optimization": zero, "aio": {"block_size": 1 << 16}, **extra}


def train_steps(engine, data, loss=None) -> None:
    """One engine step per batch of ``data`` ((inputs, targets) pairs), with ``loss`` (default: lm_loss)."""
    for x, y in data:
        engine.backward((loss or lm_loss)(engine(x), y))
        engine.step()


def close_enough(a: torch.Tensor, b: torch.Tensor, rel: float) -> float:
    """Largest |a - b| / max(1, |b|), compared on the CPU in float64; asserts it is within ``rel``."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    err = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
    assert err <= rel, err
    return err


class Bag(nn.Module):
    """A 50k-row embedding feeding a small head: a batch of 6 x 20 ids touches under 0.3% of its rows (the sparse
    gradient case). ``sparse``: nn.Embedding(sparse=True), whose gradient is a sparse COO tensor."""

    def __init__(self, rows: int = 50_000, width: int = 16, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, width, sparse=sparse)
        self.head = nn.Linear(width, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def make_bag(seed: int = 0, **kw) -> Bag:
    torch.manual_seed(seed)
    return Bag(**kw)


def bag_batches(n: int, bsz: int = 6, t: int = 20, rows: int = 50_000, seed: int = 2) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, rows, (bsz, t), generator=g), torch.randint(0, 8, (bsz,), generator=g))
            for _ in range(n)]


def bag_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y.to(out.device))


def lazy_adamw_reference(data, steps: int) -> dict[str, torch.Tensor]:
    """Lazy AdamW by hand (float64 on the CPU): rows of the embedding with a zero gradient in a step keep their
    value and moments (no decay either); everything else is AdamW."""
    model = make_bag().double()
    lr, wd, (b1, b2), eps = 3e-3, 0.01, (0.9, 0.99), 1e-8
    moments = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in model.named_parameters()}
    for t, (x, y) in enumerate(data[:steps], 1):
        model.zero_grad()
        bag_loss(model(x), y).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                g, (m, v) = p.grad, moments[n]
                keep = g.ne(0).any(1, keepdim=True) if n == "emb.weight" else torch.ones_like(g, dtype=torch.bool)
                m_new, v_new = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
                step = lr * (m_new / (1 - b1**t)) / ((v_new / (1 - b2**t)).sqrt() + eps)
                p_new = p * (1 - lr * wd) - step
                m.copy_(torch.where(keep, m_new, m))
                v.copy_(torch.where(keep, v_new, v))
                p.copy_(torch.where(keep, p_new, p))
    return {k: v.float() for k, v in model.state_dict().items()}
