"""Small models for tests: a GPT-style transformer with tied embeddings and a position *parameter* (not a module),
deterministic (no dropout). Its blocks are the package's (offload/models.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from offload.models import Block, GPTConfig


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


def batches(n: int, vocab: int = 96, bsz: int = 4, t: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (bsz, t), generator=g), torch.randint(0, vocab, (bsz, t), generator=g))
            for _ in range(n)]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
