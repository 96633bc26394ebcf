"""gpt-oss on MLX against HF's own eager code (the oracle): its experts (biased router,
interleaved gate/up, biases, clamped SwiGLU), its attention sinks over every mask the
caches build, the whole model against HF with eager experts, and the checks that refuse
what does not fit. The family's runs over every cache kind, capture on and off, chunked
prefill and quantized weights are in the every-family suites (test_hf_pipeline,
test_quantized_hf, test_hf_parity, serving/test_engine); an MXFP4 checkpoint (as gpt-oss ships) exports too."""
from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, eager_attention_forward

from mlx_pte.export.experts_layout import conversions, convert_in_place
from mlx_pte.export.hf_errors import CheckpointError
from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.handlers import HANDLERS, RunContext
from mlx_pte.interpreter.moe_handlers import SORT_FROM_PAIRS
from mlx_pte.interpreter.program import Program, load
from mlx_pte.interpreter.session import Session
from mlx_pte.ir.catalog import lookup
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, Instruction, SlotKind, TensorType
from mlx_pte.runtime.cache import AttendError, Step
from mlx_pte.runtime.mlx.attention import attend
from mlx_pte.runtime.reference.attention import lower_right_mask
from tests.fixtures.tiny_models import edit_config

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 4, 2


def _hf_experts(experts: int = EXPERTS) -> GptOssExperts:
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=experts)
    config._experts_implementation = "eager"
    module = GptOssExperts(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # Wide weights, so many projections land past the clamps (limit 7).
        for p in module.parameters():
            torch.nn.init.normal_(p, std=2.0)
    return module


# (experts, tokens) taking the handler's paths on the CPU (tests/interpreter/test_moe.py's
# EXPERT_PATHS): per pair; every expert at once (as many pairs as experts, and past
# SORT_FROM_PAIRS); sorted by expert (past SORT_FROM_PAIRS, fewer pairs than experts).
@pytest.mark.parametrize("experts, tokens", [(EXPERTS, 1), (EXPERTS, 5), (EXPERTS, SORT_FROM_PAIRS),
                                             (2 * SORT_FROM_PAIRS, SORT_FROM_PAIRS // TOP_K)])  # fmt: skip
def test_experts_match_hf_eager_experts(experts: int, tokens: int):
    module = _hf_experts(experts)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    indices = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    with torch.no_grad():
        want = module(x, indices, weights).numpy()
        projections = torch.einsum("th,ehn->ten", x, module.gate_up_proj) + module.gate_up_proj_bias
        assert (projections > module.limit).any() and (projections < -module.limit).any()  # clamps exercised
        converted = {a: c.fn(getattr(module, a).detach()) for a, c in conversions(module).items()}
    operands = (x, indices, weights, converted["gate_up_proj"], converted["down_proj"],
                converted["gate_up_proj_bias"], module.down_proj_bias.detach())  # fmt: skip
    attrs = {"activation": "clamped_swiglu", "alpha": module.alpha, "limit": module.limit}
    got = HANDLERS["experts"]([mx.array(a.numpy()) for a in operands], attrs, RunContext())
    np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=1e-6)


# (queries, keys, window, fused causal mask): decode, a continuation, a band, a prefill.
SINK_CASES = [(1, 9, 0, True), (1, 9, 0, False), (5, 9, 0, True), (5, 9, 0, False), (5, 9, 4, False),
              (6, 6, 0, True), (6, 6, 0, False), (6, 6, 3, False)]  # fmt: skip


@pytest.mark.parametrize("queries, keys, window, fused_mask", SINK_CASES)
def test_sinks_match_hf_eager_attention(queries: int, keys: int, window: int, fused_mask: bool):
    gen = torch.Generator().manual_seed(queries * 31 + keys + window)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h, n in ((4, queries), (2, keys), (2, keys)))
    sinks = 2 * torch.randn(4, generator=gen)
    mask = lower_right_mask(queries, keys, window)

    class Layer(torch.nn.Module):  # what eager_attention_forward reads of the layer
        num_key_value_groups, training = 2, False

    layer = Layer()
    layer.sinks = sinks
    additive = torch.zeros(queries, keys).masked_fill(~mask, float("-inf"))[None, None]
    want, _ = eager_attention_forward(layer, q, k, v, additive, scaling=0.25)
    mlx_mask = "causal" if fused_mask else mx.array(mask.numpy())[None, None]
    got = attend(*(mx.array(a.numpy()) for a in (q, k, v)), 0.25, 0.0, mlx_mask, mx.array(sinks.numpy()))
    np.testing.assert_allclose(np.array(got).transpose(0, 2, 1, 3), want.numpy(), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def program(tiny_checkpoint, tmp_path_factory) -> Program:
    return load(export_hf(tiny_checkpoint("gpt_oss"), tmp_path_factory.mktemp("gpt_oss") / "m.pte", max_step=16,
                          progress=False))  # fmt: skip


def test_model_matches_hf_with_eager_experts_and_attention(tiny_checkpoint, program: Program):
    """HF's default experts kernel for gpt-oss is grouped_mm; this is against its eager loop."""
    path = tiny_checkpoint("gpt_oss")
    ops = [i.op for i in program.graph.instructions]
    assert ops.count("update_and_attend") == ops.count("experts") == 2
    assert ops.count("rope") == 4 and not {"cos", "sin", "cat", "split"} & set(ops)  # q and k, chunk form fused
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                              attn_implementation="eager", experts_implementation="eager").eval()  # fmt: skip
    assert hf.config._experts_implementation == "eager"
    prompt = list(range(40, 52))
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    session = Session(program, kind="single", capacity=64)
    got = session.forward(prompt, seq_ids=session.cache.seq_new(), rows=range(len(prompt)))
    np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("edit", "says"), [
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 experts of 4"),
    (dict(num_local_experts=3), "config.json and the weights disagree"),
])  # fmt: skip
def test_an_expert_config_unlike_the_weights_is_one_export_error(tiny_checkpoint, tmp_path, edit, says):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("gpt_oss"), path)
    edit_config(path, **edit)
    with pytest.raises(CheckpointError, match=says):
        export_hf(path, tmp_path / "m.pte", max_step=16, progress=False)
    assert not (tmp_path / "m.pte").exists()


def test_a_gate_other_than_the_clamped_swiglu_is_refused(monkeypatch):
    experts = _hf_experts()
    monkeypatch.setattr(GptOssExperts, "_apply_gate", lambda self, gu: gu[..., ::2] * gu[..., 1::2])
    with pytest.raises(CheckpointError, match="not gpt-oss's clamped SwiGLU"):
        convert_in_place(experts, lambda old, c: old)
    assert not hasattr(experts, "mlx_pte_clamped")


def _experts_instr(bias_shapes: tuple, attrs: dict) -> tuple[Instruction, Graph]:
    g = Graph()
    shapes = [(3, HIDDEN), (3, TOP_K), (3, TOP_K), (EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER),
              *bias_shapes]  # fmt: skip
    dtypes = ["float32", "int64"] + ["float32"] * (len(shapes) - 2)
    inputs = tuple(g.add_slot(f"s{i}", SlotKind.INPUT, TensorType(d, s)) for i, (d, s) in enumerate(zip(dtypes, shapes)))
    out = g.add_slot("out", SlotKind.TEMP, TensorType("float32", (3, HIDDEN)))
    return Instruction("experts", inputs, (out,), tuple(attrs.items())), g


CLAMPED = {"activation": "clamped_swiglu", "alpha": 1.702, "limit": 7.0}
BIASES = ((EXPERTS, 2 * INTER), (EXPERTS, HIDDEN))


def test_catalog_accepts_biased_clamped_experts():
    lookup("experts").validate(*_experts_instr(BIASES, CLAMPED))


@pytest.mark.parametrize(
    "bias_shapes, attrs, message",
    [
        (BIASES[:1], CLAMPED, "both expert biases"),
        (((EXPERTS, INTER), (EXPERTS, HIDDEN)), CLAMPED, r"expert biases must be \[E, 2I\]"),
        (BIASES, {"activation": "clamped_swiglu", "alpha": 1.702}, "alpha and limit"),
        (BIASES, {"activation": "silu", "alpha": 1.702, "limit": 7.0}, "alpha and limit"),
    ],
)
def test_catalog_refuses_experts_biases_or_gates_that_do_not_fit(bias_shapes, attrs, message):
    with pytest.raises(FormatError, match=message):
        lookup("experts").validate(*_experts_instr(bias_shapes, attrs))


def test_sinks_of_another_head_count_are_one_attend_error(program: Program):
    session = Session(program, kind="single", capacity=64)
    cache = session.cache
    cache.declare_step(Step((cache.seq_new(),), (0,)))
    q, kv = mx.zeros((1, 4, 1, 16)), mx.zeros((1, 2, 1, 16))
    with pytest.raises(AttendError, match=r"sinks must hold one logit per query head, \[4\]"):
        cache.attend(0, q, kv, kv, 0.25, 0.0, mx.zeros((2,)))


def _attend_instr(sinks_shape: tuple | None) -> tuple[Instruction, Graph]:
    g = Graph()
    shapes = [(1, 4, 3, 16), (1, 2, 3, 16), (1, 2, 3, 16), (3,)] + ([sinks_shape] if sinks_shape else [])
    dtypes = ["float32"] * 3 + ["int64"] + ["float32"] * bool(sinks_shape)
    inputs = tuple(g.add_slot(f"s{i}", SlotKind.INPUT, TensorType(d, s)) for i, (d, s) in enumerate(zip(dtypes, shapes)))
    out = g.add_slot("out", SlotKind.TEMP, TensorType("float32", (1, 4, 3, 16)))
    attrs = (("cache_id", 0), ("scale", 0.25), ("softcap", 0.0))
    return Instruction("update_and_attend", inputs, (out,), attrs), g


@pytest.mark.parametrize("sinks_shape", [None, (4,)], ids=["without", "with"])
def test_catalog_accepts_attention_with_or_without_sinks(sinks_shape):
    lookup("update_and_attend").validate(*_attend_instr(sinks_shape))


@pytest.mark.parametrize("sinks_shape", [(2,), (1, 4)])
def test_catalog_refuses_sinks_not_one_per_query_head(sinks_shape):
    with pytest.raises(FormatError, match=r"sinks must be \[Hq\]"):
        lookup("update_and_attend").validate(*_attend_instr(sinks_shape))


def _mxfp4_checkpoint(dense: Path, out: Path) -> Path:
    """``dense`` with its experts' weights replaced by random MXFP4 packs, stored as gpt-oss's
    release does: ``*_blocks [E, N, K/32, 16]`` (two 4-bit values a byte) and ``*_scales
    [E, N, K/32]`` (power-of-two exponents biased by 127), N the output features."""
    shutil.copytree(dense, out)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, k, n = tensors.pop(name).shape  # gpt-oss's [E, in, out]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(124, 128, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    save_file(tensors, weights, metadata={"format": "pt"})
    edit_config(out, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return out


def test_an_mxfp4_checkpoint_exports_its_experts_dequantized(tiny_checkpoint, tmp_path):
    """The oracle is HF's own dequantization of the packs on load."""
    path = _mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    program = load(export_hf(path, tmp_path / "m.pte", max_step=16, progress=False))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()  # fmt: skip
    assert type(hf.model.layers[0].mlp.experts) is GptOssExperts
    prompt = list(range(40, 52))
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    session = Session(program, kind="single", capacity=64)
    got = session.forward(prompt, seq_ids=session.cache.seq_new(), rows=range(len(prompt)))
    np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=0)
