"""Programs exported by upstream ExecuTorch's own exporter (``export_llm_hf
--use-offgraph-cache``), run by mlx-pte, against eager HF: logits at every position and
greedy tokens, on every cache kind, past gemma3's (shrunk) sliding window; and the same
checkpoint exported by mlx-pte gives the same greedy tokens.

Quantized exports (``--qlinear/--qembedding 4w|8w|nvfp4``) are compared with the HF model
whose weights are replaced by upstream's quantized weights as its quantizer (torchao)
dequantizes them, recorded at export (``export_upstream.dequantized_path``)."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.program import load
from mlx_pte.ir.layers import layer_counts
from mlx_pte.runtime.cache import KIND_SINGLE, KINDS
from tests.fixtures.tiny_models import SLIDING_WINDOW

from .conftest import FAST_EXPORTS
from .parity import (
    ARGMAX_AGREEMENT, PROMPT, PROMPT_LEN, RELATIVE_TOLERANCE, compare_logits, greedy, hf_greedy, hf_model, precision,
)  # fmt: skip

NEW_TOKENS = 16
FAMILIES = ("llama", "qwen3", "gemma3")
QUANTIZED = [f"{dtype}-{q}" for dtype in ("fp32", "bf16") for q in ("4w", "8w", "nvfp4")] + ["fp16-4w"]
VARIANTS = ("fp32", "fp16", "bf16", *QUANTIZED)
FAST = list(FAST_EXPORTS)
SLOW = [(f, v) for f in FAMILIES for v in VARIANTS if (f, v) not in FAST]
CASES = FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW]
# Greedy tokens are compared exactly: float32 activations only.
GREEDY = [case for case in FAST if case[1].startswith("fp32")] + [
    pytest.param(f, v, marks=pytest.mark.slow) for f, v in SLOW if v.startswith("fp32")
]  # fmt: skip


@pytest.fixture(scope="module")
def hf(tiny_checkpoint, upstream_pte):
    """``hf(family, variant)``: the HF oracle of that export (``parity.hf_model``)."""
    memo: dict = {}

    def get(family: str, variant: str):
        key = (family, variant if "-" in variant else "fp32")
        if key not in memo:
            memo[key] = hf_model(tiny_checkpoint(family), upstream_pte(family, variant), variant)
        return memo[key]

    return get


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer) -> list[int]:
    ids = tiny_tokenizer.encode(PROMPT, add_special_tokens=False)[:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN
    return ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("family", "variant"), CASES)
def test_logits_match_hf_at_every_position(upstream_pte, hf, prompt, family, variant, kind):
    got, want = compare_logits(upstream_pte(family, variant), hf(family, variant), prompt, kind)
    assert len(got) > 4 * SLIDING_WINDOW
    key = precision(variant)
    np.testing.assert_allclose(got, want, rtol=0, atol=RELATIVE_TOLERANCE[key] * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= ARGMAX_AGREEMENT[key]


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


@pytest.mark.parametrize("variant", ["fp32", "fp32-4w"])
def test_imported_projections_are_fused(upstream_pte, variant):
    """Upstream multiplies q, k, v and gate, up separately; the import fuses them
    (``ir.fuse_projections``), and the logits tests above run the fused program."""
    separate = 7  # q, k, v, o, gate, up, down
    assert layer_counts(load(upstream_pte("llama", variant)).graph).matmuls == (separate - 3,)
