"""Fused projections through the whole pipeline (HF checkpoint -> export_hf -> MLX): a
default export runs one matmul for q/k/v and one for gate/up, and generates the same
tokens as an export with ``fused_projections=False``; a model with q/k/v and MLP biases
matches eager HF (the oracle) at every prompt position."""
from __future__ import annotations

import re
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter import handlers
from mlx_pte.interpreter.program import Program, load
from mlx_pte.interpreter.session import Session
from mlx_pte.ir.layers import layer_counts
from mlx_pte.ir.quantization import QuantSpec
from mlx_pte.runtime.cache import KINDS
from mlx_pte.serving.generation import generate
from tests.fixtures.tiny_models import build_tiny_checkpoint

MAX_STEP = 16
PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
PROMPT_LEN = 12
NEW_TOKENS = 24
# "llama+bias": q/k/v and gate/up/down with biases (as Qwen2's q/k/v have).
# Exports dominate these cases (gemma3n's alone takes ~30 s here, qwen3's ~8 s): llama covers
# fusion in the fast tier, and test_biased_projections_match_hf fused biases; the rest are slow.
MODELS = ("llama", *(pytest.param(m, marks=pytest.mark.slow) for m in ("llama+bias", "qwen3", "gemma3n")))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tiny_tokenizer, tmp_path_factory):
    def get(model: str):
        if model == "llama+bias":
            out = tmp_path_factory.getbasetemp() / "llama_bias_checkpoint"
            if not out.exists():
                build_tiny_checkpoint("llama", out, tokenizer=tiny_tokenizer, attention_bias=True, mlp_bias=True)
            return out
        return tiny_checkpoint(model)

    return get


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    """``exported(model, fused, dtype="float32", quantize=None) -> Program``, each once."""
    memo: dict[tuple, Program] = {}

    def get(model: str, fused: bool, dtype: str = "float32", quantize=None) -> Program:
        key = (model, fused, dtype, quantize)
        if key not in memo:
            out = tmp_path_factory.mktemp(model.replace("+", "_")) / "model.pte"
            export_hf(checkpoint(model), out, dtype=dtype, max_step=MAX_STEP, progress=False, quantize=quantize,
                      fused_projections=fused)  # fmt: skip
            memo[key] = load(out)
        return memo[key]

    return get


def _prompt(path) -> list[int]:
    return AutoTokenizer.from_pretrained(path).encode(PROMPT, add_special_tokens=False)[:PROMPT_LEN]


@pytest.mark.parametrize(
    "dtype,quantize",
    # bf16 in the fast tier; the other dtypes' exports (~4 s each) in the slow tier.
    [pytest.param("float32", None, marks=pytest.mark.slow), ("bfloat16", None),
     pytest.param("float16", None, marks=pytest.mark.slow),
     pytest.param("float32", QuantSpec("affine", 4, 32), marks=pytest.mark.slow),
     pytest.param("bfloat16", QuantSpec("mxfp4", 4, 32), marks=pytest.mark.slow)],
    ids=["f32", "bf16", "f16", "q4", "mxfp4"],
)  # fmt: skip
def test_a_llama_layer_runs_four_matmuls(exported, dtype, quantize):
    assert layer_counts(exported("llama", True, dtype, quantize).graph).matmuls == (4,)
    assert layer_counts(exported("llama", False).graph).matmuls == (7,)


@pytest.mark.parametrize("tokens,device", [(1, "gpu"), (5, "cpu"), (5, "gpu")])
def test_a_batch_one_linear_is_one_matmul_node(exported, monkeypatch, tmp_path, tokens, device):
    """A GPU step's host time grows with its graph nodes; every linear of one sequence is
    one matmul node (not a transpose, flatten and unflatten around it), equal to x @ W.T.
    (One row on the CPU stays a BLAS gemv, which is faster there.)"""
    program = exported("llama", True)
    monkeypatch.setattr(handlers.mx, "default_device", lambda: SimpleNamespace(type=getattr(mx.DeviceType, device)))
    linears = [step for step in program.steps if step.op == "linear" and step.inputs[1] in program.weights]
    # The other projections join their norm or GLU at load (test_norm_linears.py,
    # test_glu_linears.py): each layer's o_proj is left.
    assert len(linears) == [step.op for step in program.steps].count("update_and_attend") >= 2
    rng = np.random.default_rng(0)
    for step in linears:
        weight = program.weights[step.inputs[1]]
        x = mx.array(rng.standard_normal((1, tokens, weight.shape[1]), dtype=np.float32))
        out = step.handler([x, weight, None], step.attrs, None)
        path = tmp_path / "linear.dot"
        mx.export_to_dot(str(path), out)
        assert re.findall(r'label ="(\w+)"', path.read_text()) == ["Matmul"]
        expected = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("capture", [True, False], ids=["captured", "walked"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_fused_and_separate_projections_generate_the_same_tokens(exported, checkpoint, model, kind, capture):
    prompt = _prompt(checkpoint(model))
    tokens = []
    for fused in (True, False):
        session = Session(exported(model, fused), kind=kind, capacity=128, capture=capture)
        tokens.append(generate(session, prompt, max_new_tokens=NEW_TOKENS).tokens)
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0])) > 3  # a varied continuation, not one repeated token


@pytest.mark.parametrize("capture", [True, False], ids=["captured", "walked"])
def test_biased_projections_match_hf(exported, checkpoint, capture):
    path = checkpoint("llama+bias")
    prompt = _prompt(path)
    session = Session(exported("llama+bias", True), kind="single", capacity=128, capture=capture)
    seq = session.cache.seq_new()
    ours = np.array(session.forward(prompt, seq_ids=seq, rows=range(PROMPT_LEN)))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    assert hf.model.layers[0].self_attn.q_proj.bias is not None and hf.model.layers[0].mlp.up_proj.bias is not None
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
