"""Model level, every family: a checkpoint exported with quantized weights (``export_hf(...,
quantize=...)``) and run on MLX's quantized kernels matches eager HF whose linear and
embedding weights are replaced by their dequantized values (MLX's own ``mx.dequantize``
of the stored parts): logits at every prompt position over every cache kind, and 24
greedy tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mlx_pte.export.hf_export import export_hf
from mlx_pte.serving.generation import generate
from mlx_pte.interpreter.program import Program, load
from mlx_pte.interpreter.session import Session
from mlx_pte.ir.quantization import QuantSpec, full_precision_weights, quantized_constants
from mlx_pte.runtime.cache import KINDS
from tests.fixtures.dequantized import dequantized_weights, load_into
from tests.fixtures.tiny_models import family_params

SPEC = QuantSpec("affine", 4, 32)
MAX_STEP = 16
PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
PROMPT_LEN = 12
NEW_TOKENS = 24
ATOL = 1e-4  # as for full precision: both sides compute in fp32 from the same weight values


@dataclass
class Quantized:
    program: Program
    hf: torch.nn.Module  # with the dequantized weights
    prompt: list[int]


@pytest.fixture(scope="module")
def quantized_family(tiny_checkpoint, tmp_path_factory):
    memo: dict[str, Quantized] = {}

    def build(family: str) -> Quantized:
        if family not in memo:
            path = tiny_checkpoint(family)
            pte = export_hf(path, tmp_path_factory.mktemp(family) / "q4.pte", max_step=MAX_STEP, progress=False,
                            quantize=SPEC)  # fmt: skip
            program = load(pte)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
            load_into(dequantized_weights(program), {"body": hf.base_model, "head": hf.get_output_embeddings()})
            ids = AutoTokenizer.from_pretrained(path).encode(PROMPT, add_special_tokens=False)[:PROMPT_LEN]
            memo[family] = Quantized(program, hf, ids)
        return memo[family]

    return build


# One q4 export per family (~5 s each): a dense family, the sliding-window one, and two
# with experts (packed per expert, gpt-oss's with biases) in the fast tier; the rest slow.
FAST_FAMILIES = ("llama", "gemma3", "qwen3_moe", "gpt_oss")


@pytest.fixture(params=family_params(fast=FAST_FAMILIES))
def quantized(request, quantized_family) -> Quantized:
    return quantized_family(request.param)


def test_every_linear_and_embedding_that_divides_is_quantized(quantized: Quantized):
    graph = quantized.program.graph
    # Per layer: the fused qkv, o, the fused gate_up and down (dense), or attention's
    # linears and the 2 expert weights (MoE); plus the embedding and the head.
    assert len(quantized_constants(graph)) >= 10
    kept = full_precision_weights(graph, SPEC)
    assert all("do not divide into groups of 32" in reason for reason in kept.values()), kept


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf_with_dequantized_weights(quantized: Quantized, kind: str):
    session = Session(quantized.program, kind=kind, capacity=128)
    seq = session.cache.seq_new()
    logits = session.forward(quantized.prompt, seq_ids=seq, rows=range(PROMPT_LEN))
    with torch.no_grad():
        expected = quantized.hf(torch.tensor([quantized.prompt]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(np.array(logits), expected, atol=ATOL, rtol=0)


def test_greedy_tokens_equal_hf_generate_with_dequantized_weights(quantized: Quantized):
    ours = generate(Session(quantized.program, kind="single", capacity=128), quantized.prompt,
                    max_new_tokens=NEW_TOKENS).tokens  # fmt: skip
    with torch.no_grad():
        out = quantized.hf.generate(torch.tensor([quantized.prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours == out[0, PROMPT_LEN:].tolist()
    assert len(set(ours)) > 3
