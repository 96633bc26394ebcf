"""Programs exported by upstream ExecuTorch's own exporter (``export_llm_hf
--use-offgraph-cache``), run by mlx-pte, against eager HF: logits at every position and
greedy tokens, on every cache kind, past gemma3's (shrunk) sliding window; and the same
checkpoint exported by mlx-pte gives the same greedy tokens.

Quantized exports (``--qlinear/--qembedding 4w|8w|nvfp4``) are compared with the HF model
whose weights are replaced by upstream's quantized weights as its quantizer (torchao)
dequantizes them, recorded at export (``export_upstream.dequantized_path``)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.program import load
from mlx_pte.runtime.cache import KIND_SINGLE, KINDS
from tests.upstream.conftest import FAST_EXPORTS
from tests.fixtures.dequantized import load_into
from tests.fixtures.tiny_models import SLIDING_WINDOW

from .export_upstream import dequantized_path

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
PROMPT_LEN = 12
NEW_TOKENS = 16
# Max |error| as a fraction of max |logit|: fp32 is exact up to summation order; half
# precision stores weights and activations rounded (bf16 keeps 8 mantissa bits).
# (Measured on these checkpoints: ~1e-6 fp32, ~6e-3 fp16, ~2.5e-2 bf16.)
RELATIVE_TOLERANCE = {"fp32": 2e-5, "fp16": 1.5e-2, "bf16": 5e-2}
# Fraction of positions whose greedy choice must equal HF's: rounding may flip near-ties.
ARGMAX_AGREEMENT = {"fp32": 1.0, "fp16": 0.9, "bf16": 0.9}
FAMILIES = ("llama", "qwen3", "gemma3")
FAST = list(FAST_EXPORTS)
QUANTIZED = [f"{dtype}-{q}" for dtype in ("fp32", "bf16") for q in ("4w", "8w", "nvfp4")] + ["fp16-4w"]
SLOW = [(f, v) for f in FAMILIES for v in ("fp32", "fp16", "bf16", *QUANTIZED) if (f, v) not in FAST]
CASES = FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW]
# Greedy tokens are compared exactly: float32 activations only.
GREEDY = [("llama", "fp32"), ("gemma3", "fp32"), ("llama", "fp32-4w"), ("gemma3", "fp32-8w")] + [
    pytest.param(f, v, marks=pytest.mark.slow)
    for f in FAMILIES for v in ("fp32", *QUANTIZED) if v.startswith("fp32") and (f, v) not in FAST
]  # fmt: skip


@pytest.fixture(scope="module")
def hf(tiny_checkpoint, upstream_pte):
    """``hf(family, variant)``: the float32 HF model, with a quantized variant's weights
    dequantized by upstream's quantizer."""
    memo: dict = {}

    def get(family: str, variant: str = "fp32"):
        key = (family, variant if "-" in variant else "fp32")
        if key not in memo:
            model = AutoModelForCausalLM.from_pretrained(
                tiny_checkpoint(family), dtype=torch.float32, local_files_only=True
            ).eval()
            if "-" in variant:
                load_into(torch.load(dequantized_path(upstream_pte(family, variant))), {"": model})
            memo[key] = model
        return memo[key]

    return get


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer) -> list[int]:
    ids = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)[:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN
    return ids


def run_all_rows(session, ids: Sequence[int]) -> np.ndarray:
    """Logits of every position: prefill in max-step chunks, all rows selected."""
    seq = session.cache.seq_new() if session.batched else None
    out = []
    for start in range(0, len(ids), session.max_step):
        piece = ids[start : start + session.max_step]
        out.append(np.array(session.forward(piece, seq_ids=seq, rows=range(len(piece)))))
    return np.concatenate(out)


def greedy(session, ids: Sequence[int], new_tokens: int) -> list[int]:
    seq = session.cache.seq_new() if session.batched else None
    for start in range(0, len(ids), session.max_step):
        logits = session.forward(ids[start : start + session.max_step], seq_ids=seq)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(np.array(logits).argmax(-1)[0]))
        logits = session.forward([tokens[-1]], seq_ids=seq)
    return tokens


@torch.no_grad()
def hf_greedy(model, ids: Sequence[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([list(ids)]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("family", "variant"), CASES)
def test_logits_match_hf_at_every_position(upstream_pte, hf, prompt, family, variant, kind):
    program = load(upstream_pte(family, variant))
    session = program.session(kind)
    model = hf(family, variant)
    ids = prompt + hf_greedy(model, prompt, 8)  # 20 positions: past gemma3's window of 4
    assert len(ids) > 4 * SLIDING_WINDOW
    with torch.no_grad():
        want = model(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    got = run_all_rows(session, ids)
    dtype = variant.partition("-")[0]
    tolerance = RELATIVE_TOLERANCE[dtype] * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= ARGMAX_AGREEMENT[dtype]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("family", "variant"), GREEDY)
def test_greedy_tokens_match_hf_generate(upstream_pte, hf, prompt, family, variant, kind):
    session = load(upstream_pte(family, variant)).session(kind)
    want = hf_greedy(hf(family, variant), prompt, NEW_TOKENS)
    assert len(set(want)) > NEW_TOKENS // 2  # a model repeating one token would hide cache bugs
    assert greedy(session, prompt, NEW_TOKENS) == want


@pytest.mark.parametrize("family", ["gemma3", pytest.param("llama", marks=pytest.mark.slow)])
def test_upstream_and_mlx_pte_exports_generate_the_same_tokens(
    upstream_pte, tiny_checkpoint, tmp_path, prompt, family
):
    ours = load(export_hf(tiny_checkpoint(family), tmp_path / "ours.pte", max_step=8, progress=False))
    theirs = load(upstream_pte(family, "fp32"))
    assert greedy(theirs.session(KIND_SINGLE), prompt, NEW_TOKENS) == greedy(
        ours.session(KIND_SINGLE), prompt, NEW_TOKENS
    )
    assert [c["window"] for c in theirs.manifest["cache"]] == [c["window"] for c in ours.manifest["cache"]]


def test_cache_geometry_comes_from_the_constant_methods(upstream_pte):
    manifest = load(upstream_pte("gemma3", "fp32")).manifest
    assert [(c["window"], c["n_kv_heads"], c["head_dim"]) for c in manifest["cache"]] == [
        (SLIDING_WINDOW, 2, 16),
        (0, 2, 16),
    ]
    assert (manifest["max_step"], manifest["max_context"]) == (4, 64)
    assert manifest["extra"]["source"] == "executorch-mlx" and manifest["tokenizer"] is None
