"""A model with ``update_and_attend`` layers (neutral_cache.md §11.8's TinyAttentionModel,
plus an embedding and per-layer windows), and the check that a loaded program of it
matches its eager exported program step by step, over the MLX and reference caches of
one kind."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.export import Dim, ExportedProgram

import mlx_pte.runtime.mlx  # noqa: F401  (registers the "mlx" cache kinds)
import mlx_pte.runtime.reference  # noqa: F401  (registers the "reference" cache kinds)
from mlx_pte.export.custom_ops import bind_cache
from mlx_pte.interpreter.program import Program
from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    KIND_SINGLE,
    CacheConfig,
    CacheGeometry,
    LayerGeometry,
    LayerPolicy,
    Step,
)

from .roundtrip import to_numpy

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 40, 32, 4, 2, 8
WINDOWS = (0, 4, 0)  # flat, a ring narrower than the prefill, flat
MAX_STEP = 8
TOL = 1e-5  # measured worst: 2.4e-7


class TinyAttentionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.ModuleDict({
                "q": nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False),
                "k": nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False),
                "v": nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False),
                "o": nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False),
            })
            for _ in WINDOWS
        )  # fmt: skip
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # [1, T, hidden]
        t = tokens.shape[1]
        for i, layer in enumerate(self.layers):
            q = layer["q"](x).view(1, t, HEADS, HEAD_DIM).transpose(1, 2)
            k = layer["k"](x).view(1, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = layer["v"](x).view(1, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
            softcap = 1.0 if i == 2 else 0.0
            attn = torch.ops.llm.update_and_attend(q, k, v, positions, i, HEAD_DIM**-0.5, softcap)
            x = x + layer["o"](attn.transpose(1, 2).reshape(1, t, HEADS * HEAD_DIM))
        return self.lm_head(torch.index_select(x[0], 0, rows))


def export_tiny_attention(model: nn.Module) -> ExportedProgram:
    """``model`` exported with a dynamic token count T and row count R (up to MAX_STEP)."""
    t, r = Dim("T", min=1, max=MAX_STEP), Dim("R", min=1, max=MAX_STEP)
    example = (torch.zeros(1, 5, dtype=torch.int64), torch.arange(5), torch.tensor([3, 4]))
    return torch.export.export(model.eval(), example, dynamic_shapes=({1: t}, {0: t}, {0: r}), strict=False)


def new_cache(backend: str, kind: str):
    geometry = CacheGeometry(tuple(LayerGeometry(LayerPolicy.from_window(w), KV_HEADS, HEAD_DIM) for w in WINDOWS))
    config = CacheConfig(capacity=64, max_write=MAX_STEP, initial_capacity=4, max_seqs=4)
    return CACHE_FACTORY.build(backend, kind, geometry, config)


def steps(kind: str, a: int, b: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(seq_ids, positions, rows) per step: prefill past the ring's window, decodes, a chunk."""
    if kind == KIND_SINGLE:
        return [
            ([0] * 6, list(range(6)), [5]),
            ([0], [6], [0]),
            ([0], [7], [0]),
            ([0] * 3, [8, 9, 10], [0, 1, 2]),
        ]
    return [
        ([a] * 5 + [b] * 3, list(range(5)) + list(range(3)), [4, 7]),
        ([a, b], [5, 3], [0, 1]),
        ([b] * 3 + [a], [4, 5, 6, 6], [0, 1, 2, 3]),
        ([a] * 6, list(range(7, 13)), [2, 5]),
    ]


def assert_program_matches_eager(program: Program, eager: torch.nn.Module, kind: str, tol: float = TOL) -> None:
    """Run ``program`` over an MLX cache of ``kind`` and ``eager`` over a reference cache of
    ``kind`` through the same steps; every step's logits agree within ``tol``."""
    mlx_cache, ref_cache = new_cache("mlx", kind), new_cache("reference", kind)
    a = b = 0
    if kind != KIND_SINGLE:
        a, b = mlx_cache.seq_new(), mlx_cache.seq_new()
        assert (ref_cache.seq_new(), ref_cache.seq_new()) == (a, b)
    gen = torch.Generator().manual_seed(1)
    for seq_ids, positions, rows in steps(kind, a, b):
        tokens = torch.randint(0, VOCAB, (1, len(seq_ids)), generator=gen)
        inputs = (tokens, torch.tensor(positions), torch.tensor(rows))
        step = Step(tuple(seq_ids), tuple(positions))
        for cache in (mlx_cache, ref_cache):
            cache.declare_step(step)
        (logits,) = program.run([x.numpy() for x in inputs], cache=mlx_cache)
        with bind_cache(ref_cache), torch.no_grad():
            expected = eager(*inputs)
        for cache in (mlx_cache, ref_cache):
            cache.finish_step()
        assert tuple(logits.shape) == (len(rows), VOCAB)
        np.testing.assert_allclose(to_numpy(logits), expected.numpy(), rtol=tol, atol=tol)
