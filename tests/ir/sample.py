"""A small valid graph with weights and a manifest, built by hand, for the ir tests."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlx_pte.ir.graph import Graph, Instruction, ScalarType, SlotKind, SymDim, TensorType

T = SymDim("T", 1, 16)
R = SymDim("R", 1, None)
HIDDEN, HEADS, HEAD_DIM = 8, 2, 4
TOKENIZER = '{"model": {"type": "BPE", "vocab": {}}}' * 50


@dataclass
class Sample:
    graph: Graph
    constants: dict[int, np.ndarray]
    manifest: dict
    # Instruction counts, written out by hand (not derived from the graph).
    op_counts: dict[str, int]


def sample() -> Sample:
    """x -> linear(w1, b1) -> q,k,v = x * scale each -> update_and_attend -> + x -> out."""
    g = Graph()
    rng = np.random.default_rng(0)
    x = g.add_slot("x", SlotKind.INPUT, TensorType("float32", (1, HEADS, T, HEAD_DIM)))
    pos = g.add_slot("positions", SlotKind.INPUT, TensorType("int64", (T,)))
    n = g.add_slot("n", SlotKind.INPUT, ScalarType("int"))
    rows = g.add_slot("rows", SlotKind.INPUT, TensorType("int64", (R,)))
    w = g.add_slot("w", SlotKind.CONSTANT, TensorType("float32", (HEAD_DIM, HEAD_DIM)))
    b = g.add_slot("b", SlotKind.CONSTANT, TensorType("float32", (HEAD_DIM,)))
    s = g.add_slot("s", SlotKind.CONSTANT, TensorType("float16", (1,)))
    shape = TensorType("float32", (1, HEADS, T, HEAD_DIM))
    h = g.add_slot("h", SlotKind.TEMP, shape)
    q = g.add_slot("q", SlotKind.TEMP, shape)
    k = g.add_slot("k", SlotKind.TEMP, shape)
    a = g.add_slot("a", SlotKind.TEMP, shape)
    out = g.add_slot("out", SlotKind.TEMP, shape)
    g.instructions = [
        Instruction("linear", (x, w, b), (h,)),
        Instruction("mul", (h, s), (q,)),
        Instruction("linear", (h, w, None), (k,)),
        Instruction("update_and_attend", (q, k, h, pos), (a,),
                    (("cache_id", 0), ("scale", 0.5), ("softcap", 0.0))),
        Instruction("add", (a, x), (out,)),
    ]
    g.inputs = [x, pos, n, rows]
    g.outputs = [out]
    constants = {
        w: rng.standard_normal((HEAD_DIM, HEAD_DIM)).astype(np.float32),
        b: rng.standard_normal(HEAD_DIM).astype(np.float32),
        s: np.array([0.25], dtype=np.float16),
    }
    manifest = {
        "format_version": 1,
        "config": {"model_type": "llama", "hidden_size": HIDDEN},
        "dtype": "float32",
        "vocab_size": 32,
        "cache": [{"window": 0, "n_kv_heads": HEADS, "head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM}],
        "max_step": 16,
        "max_context": 64,
        "tokenizer": TOKENIZER,
        "eos_token_ids": [2],
    }
    return Sample(g, constants, manifest, {"linear": 2, "mul": 1, "update_and_attend": 1, "add": 1})
