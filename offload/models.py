"""A GPT-style decoder defined in the package, so the demo and the benchmarks need no downloads.

Pre-norm blocks (causal self-attention through scaled_dot_product_attention, a 4x GELU MLP), learned positions,
no biases on the attention projections, and an output head tied to the token embedding, as in GPT-2.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    context: int = 1024
    layers: int = 12
    heads: int = 12
    width: int = 768

    @property
    def num_parameters(self) -> int:
        """Trainable parameters (the tied head counted once)."""
        d = self.width
        per_block = 4 * d + 3 * d * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d
        return self.vocab_size * d + self.context * d + self.layers * per_block + 2 * d


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then a 4x GELU MLP, each residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.width
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"GPTConfig.width ({cfg.width}) must be a multiple of heads ({cfg.heads})")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (2 * cfg.layers) ** 0.5 if name.endswith(("proj.weight", "out.weight"))
                                else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy in fp32; the targets follow the logits to their device."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.to(logits.device).reshape(-1))


def synthetic_batches(vocab: int, batch: int, tokens: int,
                      seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) batches where each next token is a fixed random permutation of the current one:
    learnable, not trivial, and no download (the demo's and the benchmarks' task)."""
    g = torch.Generator().manual_seed(seed)
    rule = torch.randperm(vocab, generator=g)
    while True:
        seq = torch.empty(batch, tokens + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(tokens):
            seq[:, t + 1] = rule[seq[:, t]]
        yield seq[:, :-1], seq[:, 1:]
