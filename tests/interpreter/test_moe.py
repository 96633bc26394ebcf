"""Mixture-of-experts ops on MLX against HF's own experts and torch.topk (the oracles),
and the checks that refuse experts whose config does not fit their weights."""
from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from mlx_pte.export.hf_checkpoint import load_checkpoint, load_model
from mlx_pte.export.hf_errors import CheckpointError
from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.handlers import HANDLERS, RunContext
from mlx_pte.interpreter.moe_handlers import SORT_FROM_PAIRS, every_expert_pays
from mlx_pte.interpreter.program import load
from mlx_pte.interpreter.session import Session
from mlx_pte.ir.catalog import lookup
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, Instruction, SlotKind, TensorType
from tests.fixtures.tiny_models import edit_config

HIDDEN, INTER, EXPERTS = 16, 8, 6


def _hf_experts(activation: str = "silu", experts: int = EXPERTS) -> Qwen3MoeExperts:
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=experts,
                            hidden_act=activation)  # fmt: skip
    config._experts_implementation = "eager"
    module = Qwen3MoeExperts(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.nn.init.normal_(module.gate_up_proj, std=0.3)
        torch.nn.init.normal_(module.down_proj, std=0.3)
    return module


def _routed_case(module: Qwen3MoeExperts, tokens: int) -> tuple[list[torch.Tensor], np.ndarray]:
    """Seeded routing inputs (x, two distinct experts per token, their weights) with the
    module's weights appended, as the experts op takes them, and HF's output for them."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    experts = module.gate_up_proj.shape[0]
    indices = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    with torch.no_grad():
        want = module(x, indices, weights).numpy()
    return [x, indices, weights, module.gate_up_proj.detach(), module.down_proj.detach()], want


# (experts, tokens) taking each of the handler's three paths on the CPU, two picks a token:
# per (token, expert) pair; one matmul over every expert, from as many pairs as experts;
# pairs sorted by expert, from SORT_FROM_PAIRS pairs when those are fewer than the experts.
EXPERT_PATHS = {"pairs": (EXPERTS, 1), "every": (EXPERTS, 5), "every_long": (EXPERTS, SORT_FROM_PAIRS),
                "sorted": (2 * SORT_FROM_PAIRS, SORT_FROM_PAIRS // 2)}  # fmt: skip


def test_expert_paths_cover_each_path():
    taken = {name: (every_expert_pays(2 * tokens, experts), 2 * tokens >= SORT_FROM_PAIRS)
             for name, (experts, tokens) in EXPERT_PATHS.items()}  # fmt: skip
    assert taken == {"pairs": (False, False), "every": (True, False), "every_long": (True, True),
                     "sorted": (False, True)}  # fmt: skip


@pytest.mark.parametrize("path", sorted(EXPERT_PATHS))
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_experts_match_hf_experts(path: str, activation: str):
    experts, tokens = EXPERT_PATHS[path]
    inputs, want = _routed_case(_hf_experts(activation, experts), tokens)
    args = [mx.array(a.numpy()) for a in inputs]
    got = HANDLERS["experts"](args, {"activation": activation}, RunContext())
    np.testing.assert_allclose(np.array(got), want, atol=1e-5, rtol=0)


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=8, max_size=8), min_size=1, max_size=4),
    k=st.integers(1, 8),
    largest=st.booleans(),
)
def test_topk_matches_torch_and_breaks_ties_by_lower_index(rows, k, largest):
    """Few distinct values, so most rows tie. torch.topk's order among equal values is its
    kernel's (nth_element: it differs with the row length and k), so the oracle for indices
    is a stable sort by value; the values must equal torch's, and so must the chosen set
    wherever the k-th value is not tied with an unchosen one (the case HF routing can
    reproduce on any kernel)."""
    x = torch.tensor(rows, dtype=torch.float32)
    values, indices = torch.topk(x, k, dim=-1, largest=largest)
    got_values, got_indices = HANDLERS["topk"]([mx.array(x.numpy())], {"k": k, "dim": 1, "largest": largest},
                                               RunContext())  # fmt: skip
    assert got_indices.dtype == mx.int64
    assert np.array(got_values).tolist() == values.tolist()
    for row, ours, theirs in zip(rows, np.array(got_indices).tolist(), indices.tolist()):
        stable = sorted(range(len(row)), key=lambda i: (-row[i] if largest else row[i], i))
        assert ours == stable[:k]
        if k == len(row) or row[stable[k - 1]] != row[stable[k]]:
            assert sorted(ours) == sorted(theirs)


def _experts_instr(gate_up: tuple, down: tuple, k: int = 2) -> tuple[Instruction, Graph]:
    g = Graph()
    shapes = [(4, HIDDEN), (4, k), (4, k), gate_up, down]
    dtypes = ["float32", "int64", "float32", "float32", "float32"]
    inputs = tuple(g.add_slot(f"s{i}", SlotKind.INPUT, TensorType(d, s)) for i, (d, s) in enumerate(zip(dtypes, shapes)))
    out = g.add_slot("out", SlotKind.TEMP, TensorType("float32", (4, HIDDEN)))
    return Instruction("experts", inputs, (out,), (("activation", "silu"),)), g


def test_catalog_accepts_matching_experts():
    instr, graph = _experts_instr((EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER))
    lookup("experts").validate(instr, graph)


@pytest.mark.parametrize(
    "gate_up, down, k",
    [
        ((EXPERTS, 2 * INTER, HIDDEN), (EXPERTS - 1, HIDDEN, INTER), 2),  # expert counts differ
        ((EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER + 1), 2),  # gate_up is not 2 x down's I
        ((EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER), EXPERTS + 1),  # more picks than experts
    ],
)
def test_catalog_refuses_experts_that_do_not_fit(gate_up, down, k):
    instr, graph = _experts_instr(gate_up, down, k)
    with pytest.raises(FormatError, match="experts"):
        lookup("experts").validate(instr, graph)


@pytest.mark.parametrize(("edit", "says"), [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),  # top-k beyond the expert count
    (dict(num_local_experts=6), "do not load"),  # an expert count unlike the weights
])  # fmt: skip
def test_an_expert_config_unlike_the_weights_is_one_export_error(tiny_checkpoint, tmp_path, edit, says):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), path)
    edit_config(path, **edit)
    with pytest.raises(CheckpointError, match=says):
        load_model(load_checkpoint(path), "float32", "mlx_pte")


def test_long_prefill_matches_hf(tiny_checkpoint, tmp_path):
    """30 tokens x top 3 of 8 experts: past SORT_FROM_PAIRS, and on the CPU past the
    experts' count, so prefill multiplies by every expert at once."""
    path = tiny_checkpoint("qwen3_moe")
    program = load(export_hf(path, tmp_path / "m.pte", max_step=32, progress=False))
    prompt = list(range(40, 70))
    assert len(prompt) * 3 >= SORT_FROM_PAIRS and every_expert_pays(len(prompt) * 3, 8)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    for capture in (True, False):
        session = Session(program, kind="single", capacity=64, capture=capture)
        got = session.forward(prompt, seq_ids=session.cache.seq_new(), rows=range(len(prompt)))
        np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=0)


def test_quantize_packs_every_experts_weight(tiny_checkpoint, tmp_path):
    from mlx_pte.ir.quantization import QuantSpec, quantized_constants

    spec = QuantSpec("affine", 4, 32)
    program = load(export_hf(tiny_checkpoint("qwen3_moe"), tmp_path / "q.pte", max_step=16, progress=False,
                             quantize=spec))  # fmt: skip
    ops = [i.op for i in program.graph.instructions]
    assert ops.count("quantized_experts") == 2 and "experts" not in ops
    packed = {program.graph.slots[s].name for s in quantized_constants(program.graph)}
    assert {f"body.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")} <= packed


@pytest.mark.slow  # the export traces the whole model before it quantizes (~5 s)
def test_group_size_dividing_one_experts_width_is_one_export_error(tiny_checkpoint, tmp_path):
    from mlx_pte.export.errors import ExportError
    from mlx_pte.ir.quantization import QuantSpec

    # hidden 64 divides into groups of 64, the experts' intermediate 32 does not
    with pytest.raises(ExportError, match="--group-size that divides both"):
        export_hf(tiny_checkpoint("qwen3_moe"), tmp_path / "q.pte", max_step=16, progress=False,
                  quantize=QuantSpec("affine", 4, 64))  # fmt: skip
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("path", sorted(EXPERT_PATHS))
def test_bfloat16_experts_run_on_the_cpu_within_bfloat16_rounding_of_hf(path: str):
    """MLX's CPU gather_mm takes float32 only; half-precision experts compute in float32 there
    (on a GPU the kernel takes bfloat16 itself)."""
    experts, tokens = EXPERT_PATHS[path]
    inputs, want = _routed_case(_hf_experts(experts=experts), tokens)
    as_bf16 = [mx.array(a.numpy()).astype(mx.bfloat16) if a.is_floating_point() else mx.array(a.numpy())
               for a in inputs]  # fmt: skip
    got = HANDLERS["experts"](as_bf16, {"activation": "silu"}, RunContext())
    assert got.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=0.05 * np.abs(want).max(), rtol=0)
