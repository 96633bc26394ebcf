"""Weight bytes of a Llama-shaped checkpoint at full precision, q8 and q4 (affine, MLX's
packing, ``ir.quantization``), by arithmetic on its tensor shapes: what the weight segment
of an export holds (the file adds the graph, the manifest and the tokenizer).

    .venv/bin/python bench/quant_sizes.py MODEL_DIR [--dtype bfloat16] [--group-size 64]
    .venv/bin/python bench/quant_sizes.py --llama-1b       # Llama-3.2-1B's shape

Every linear and the embedding are quantized (a tied head shares the embedding); norms stay.
Checked against exports by ``mlx-pte inspect`` (its "all weights" total).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_pte.ir.payload import ITEMSIZE
from mlx_pte.ir.quantization import QuantSpec

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)  # fmt: skip


def matrices(c: dict) -> list[tuple[int, int]]:
    """[N, K] of every linear and the embedding (and an untied head)."""
    hidden, ffn, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, c["num_key_value_heads"] * head_dim
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    embed = [(c["vocab_size"], hidden)] * (1 if c.get("tie_word_embeddings", True) else 2)
    return embed + layer * c["num_hidden_layers"]


def weight_bytes(c: dict, dtype: str, spec: QuantSpec | None) -> int:
    norms = (2 * c["num_hidden_layers"] + 1) * c["hidden_size"] * ITEMSIZE[dtype]
    total = norms
    for n, k in matrices(c):
        if spec is None:
            total += n * k * ITEMSIZE[dtype]
        else:
            total += sum(t.shape[0] * t.shape[1] * ITEMSIZE[t.dtype] for t in spec.parts((n, k), dtype) if t)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", type=Path, help="checkpoint directory (its config.json)")
    parser.add_argument("--llama-1b", action="store_true", help="use Llama-3.2-1B's shape")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()
    if args.llama_1b == (args.model_dir is not None):
        parser.error("give MODEL_DIR or --llama-1b")
    config = LLAMA_1B if args.llama_1b else json.loads((args.model_dir / "config.json").read_text())
    name = "Llama-3.2-1B shape" if args.llama_1b else str(args.model_dir)
    full = weight_bytes(config, args.dtype, None)
    print(f"{name}, {args.dtype}, groups of {args.group_size}:")
    print(f"  {args.dtype:<9} {full:>15,} bytes")
    for label, bits in (("q8", 8), ("q4", 4)):
        size = weight_bytes(config, args.dtype, QuantSpec("affine", bits, args.group_size))
        print(f"  {label:<9} {size:>15,} bytes  ({size / full:.1%})")


if __name__ == "__main__":
    main()
