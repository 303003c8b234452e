"""A GPT built from torch's own ``nn.TransformerEncoderLayer`` with every parameter homed on NVMe, trained two ways
in the same run: as it is (nothing declared: ``MultiheadAttention`` reads ``out_proj``'s weight itself, which the
engine fetches with it, and the first forward finds the head's read of the embedding), and with those reads declared
by hand (``engine.register_external_parameter``, DeepSpeed's way). Both engines are open at once and
take turns, a few steps each per round; each round's median step time, then the median over rounds.

Target: undeclared <= 1.05 x declared (the finding costs the first forward only).

    python bench/param_reads.py [--width 768] [--layers 4] [--tokens 128] [--steps 3] [--rounds 5] [--nvme-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from _common import count, exit_on_sigterm, out_help  # noqa: E402

import offload  # noqa: E402


class EncoderGPT(nn.Module):
    """Token and position embeddings, causal ``nn.TransformerEncoderLayer`` blocks, and the embedding as the head
    through ``F.linear`` (read by the root's forward, not the embedding's)."""

    def __init__(self, vocab: int, width: int, layers: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, width // 64, 4 * width, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.ln = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return nn.functional.linear(self.ln(x), self.tok.weight)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=count(64), default=768)
    ap.add_argument("--layers", type=count(1), default=4)
    ap.add_argument("--vocab", type=count(1), default=8192)
    ap.add_argument("--tokens", type=count(2), default=128, help="tokens per step (batch 1)")
    ap.add_argument("--steps", type=count(1), default=3, help="steps per engine per round")
    ap.add_argument("--rounds", type=count(1), default=5)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--out", default="results/param_reads.json", help=out_help("param_reads"))
    args = ap.parse_args()
    exit_on_sigterm()
    torch.manual_seed(0)
    data = [torch.randint(args.vocab, (1, args.tokens + 1)) for _ in range(args.steps)]
    with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="param-reads-") as swap:
        def config(name: str) -> dict:
            nvme = {"device": "nvme", "nvme_path": f"{swap}/{name}"}
            return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "aio": {"block_size": 1 << 20},
                    "zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": dict(nvme),
                                          "stage3_param_persistence_threshold": 0}}

        engines = {}
        for name in ("undeclared", "declared"):
            torch.manual_seed(1)
            model = EncoderGPT(args.vocab, args.width, args.layers, args.tokens)
            engines[name] = offload.initialize(model, config(name))
            if name == "declared":
                engines[name].register_external_parameter(model, model.tok.weight)
                for block in model.blocks:
                    for p in block.self_attn.out_proj.parameters():
                        engines[name].register_external_parameter(block.self_attn, p)
        try:
            def steps(engine: offload.Engine) -> list[float]:
                times = []
                for seq in data:
                    start = time.perf_counter()
                    logits = engine(seq[:, :-1])
                    engine.backward(nn.functional.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten()))
                    engine.step()
                    times.append(time.perf_counter() - start)
                return times

            for engine in engines.values():  # the first steps: the undeclared one finds the reads here
                steps(engine)
            rounds: dict[str, list[float]] = {name: [] for name in engines}
            for r in range(args.rounds):
                for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                    rounds[name].append(statistics.median(steps(engines[name])))
            found = engines["undeclared"].stats()["params"]["read_outside"]
        finally:
            for engine in engines.values():
                engine.close()
    med = {name: statistics.median(times) for name, times in rounds.items()}
    ratio = med["undeclared"] / med["declared"]
    print(f"{'engine':<12}{'median step (s)':>16}  per round")
    for name, times in rounds.items():
        print(f"{name:<12}{med[name]:>16.4f}  " + " ".join(f"{t:.4f}" for t in times))
    print(f"undeclared / declared = {ratio:.3f} (target <= 1.05); reads found outside a module's forward: {found}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": med, "ratio": ratio,
                               "read_outside": found}, indent=1))


if __name__ == "__main__":
    main()
