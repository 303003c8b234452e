"""Small models for tests: a GPT-style transformer with tied embeddings, deterministic (no dropout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # no qkv bias: the key part of it has an analytically zero gradient, so its Adam update is normalized
        # rounding noise and no two correct implementations agree on it element by element
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 96, d: int = 32, layers: int = 2, heads: int = 2, ctx: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
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


def batches(n: int, vocab: int = 96, bsz: int = 4, t: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (bsz, t), generator=g), torch.randint(0, vocab, (bsz, t), generator=g))
            for _ in range(n)]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
