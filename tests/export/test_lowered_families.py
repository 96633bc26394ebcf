"""What the lowering makes of real HF families in every dtype: the fusions fire (no
decomposed RMSNorm or rotary ops remain; one rms_norm per HF RMSNorm module), a Llama
decoder layer costs at most 20 instructions, ``mlx-pte inspect`` reports that figure,
and a bfloat16 export still matches HF run in bfloat16."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mlx_pte.cli import main
from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.program import Program, load
from mlx_pte.ir.layers import layer_counts
from tests.fixtures.tiny_models import edit_config, tiny_config

MAX_STEP = 16
DTYPES = ("float32", "bfloat16", "float16")
LAYER_BUDGET = 14
# Ops that only appear when an RMSNorm or rotary chain was left decomposed.
DECOMPOSED = {"pow", "rsqrt", "mean", "neg", "cat", "cos", "sin", "rope_half"}


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    """``exported(family, dtype) -> (path, program)``, each exported once."""
    memo: dict[tuple[str, str], tuple[Path, Program]] = {}

    def get(family: str, dtype: str) -> tuple[Path, Program]:
        if (family, dtype) not in memo:
            out = tmp_path_factory.mktemp(f"{family}_{dtype}") / "model.pte"
            path = export_hf(tiny_checkpoint(family), out, dtype=dtype, max_step=MAX_STEP, progress=False)
            memo[family, dtype] = (path, load(path))
        return memo[family, dtype]

    return get


def _hf(tiny_checkpoint, family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=dtype, local_files_only=True).eval()


def _rms_norm_modules(model: torch.nn.Module) -> int:
    return sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


# bf16 here; fp32 and fp16 (~3 s of export each) in the slow tier.
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=pytest.mark.slow) if d != "bfloat16" else d for d in DTYPES])
def test_llama_layer_is_at_most_14_instructions(exported, dtype):
    _, program = exported("llama", dtype)
    counts = layer_counts(program.graph)
    assert counts.layers == 2 and counts.spans and max(counts.spans) <= LAYER_BUDGET, counts
    ops = Counter(instr.op for instr in program.graph.instructions)
    assert not DECOMPOSED & set(ops), ops
    # The one cast left is the fp32 logits of a half-precision model.
    assert ops["cast"] == (0 if dtype == "float32" else 1), ops


FAMILY_CASES = [  # llama, gemma3 (sliding, scaled embedding) and gpt_oss (chunked halves, YaRN-scaled
    # tables) in the fast tier; the rest are slow
    ("llama", "bfloat16"), ("gemma3", "bfloat16"), ("gpt_oss", "bfloat16"),
    *[pytest.param(f, d, marks=pytest.mark.slow) for f in ("mistral", "gemma2", "qwen3", "gemma3") for d in DTYPES
      if (f, d) != ("gemma3", "bfloat16")],
]  # fmt: skip


@pytest.mark.parametrize("family,dtype", FAMILY_CASES)
def test_every_norm_and_rotary_fuses(exported, tiny_checkpoint, family, dtype):
    _, program = exported(family, dtype)
    ops = Counter(instr.op for instr in program.graph.instructions)
    assert not DECOMPOSED & set(ops), ops
    assert ops["rms_norm"] == _rms_norm_modules(_hf(tiny_checkpoint, family)), ops
    assert ops["rope"] == 2 * ops["update_and_attend"], ops  # q and k of every layer


def test_inspect_reports_instructions_per_layer(exported, capsys):
    path, program = exported("llama", "bfloat16")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("per decoder layer:"))
    figure = int(line.split()[3])
    assert figure <= LAYER_BUDGET and "1 span" in line
    attends = [i for i, instr in enumerate(program.graph.instructions) if instr.op == "update_and_attend"]
    assert figure == attends[1] - attends[0]


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_bfloat16_export_matches_hf_in_bfloat16(exported, tiny_checkpoint, family):
    """bf16 rounding differs op by op between any two implementations; the fused export must
    stay as close to HF-in-bf16 as HF-in-bf16 is to the fp32 reference."""
    _, program = exported(family, "bfloat16")
    prompt = [5, 17, 300, 42, 9, 811, 64, 3, 77, 120]
    session = program.session("single", capacity=64)
    ours = np.array(session.forward(prompt, rows=range(len(prompt))))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hf_bf16 = _hf(tiny_checkpoint, family, torch.bfloat16)(ids, use_cache=False).logits[0].float().numpy()
        hf_fp32 = _hf(tiny_checkpoint, family)(ids, use_cache=False).logits[0].numpy()
    hf_error = np.abs(hf_bf16 - hf_fp32).max()
    assert np.abs(ours - hf_bf16).max() <= 2 * hf_error, (np.abs(ours - hf_bf16).max(), hf_error)
    assert (ours.argmax(-1) == hf_bf16.argmax(-1)).mean() >= 0.9


def test_yarn_scaled_tables_fuse_and_match_hf(tiny_checkpoint, tmp_path):
    """YaRN scales HF's cos/sin tables by its attention factor (0.1 ln(factor) + 1): the
    rotary chain still fuses, with the factor as rope's ``table_scale``."""
    import shutil

    path = tmp_path / "llama_yarn"
    shutil.copytree(tiny_checkpoint("llama"), path)
    theta = tiny_config("llama").rope_parameters["rope_theta"]
    edit_config(path, rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                           rope_theta=theta))  # fmt: skip
    program = load(export_hf(path, tmp_path / "m.pte", max_step=MAX_STEP, progress=False))
    ropes = [i for i in program.graph.instructions if i.op == "rope"]
    assert len(ropes) == 4 and all(i.attr("table_scale") == pytest.approx(0.1 * np.log(4.0) + 1) for i in ropes)
    assert not DECOMPOSED & {i.op for i in program.graph.instructions}
    prompt = [5, 17, 300, 42, 9, 811, 64, 3, 77, 120]
    with torch.no_grad():
        want = _hf(lambda family: path, "llama")(torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    got = np.array(program.session("single", capacity=64).forward(prompt, rows=range(len(prompt))))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
