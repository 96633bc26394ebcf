"""``export_hf`` end to end on disk: a genuine .pte whose payload carries the manifest and
one ``update_and_attend`` per attention layer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_pte.export.hf_errors import ExportOptionError
from mlx_pte.export.hf_export import export_hf
from mlx_pte.ir.graph import SymDim
from mlx_pte.ir.manifest import Manifest
from mlx_pte.ir.pte import read_pte
from tests.fixtures.tiny_models import BOS_ID, EOS_ID, SLIDING_WINDOW, VOCAB_SIZE

MAX_STEP = 8


def test_bfloat16_export_writes_manifest_and_attention_calls(tiny_checkpoint, tmp_path: Path, capfd):
    """One export (lowering is the slow part): gemma2 has sliding + full layers and softcaps."""
    source = tiny_checkpoint("gemma2")
    out = export_hf(source, tmp_path / "gemma2.pte", dtype="bfloat16", max_step=MAX_STEP, progress=True)
    assert out == tmp_path / "gemma2.pte" and out.stat().st_size > 0
    assert "export: 100%" in capfd.readouterr().err

    payload = read_pte(out)
    manifest = Manifest.from_dict(payload.manifest)
    assert manifest.config == json.loads((source / "config.json").read_text())
    assert manifest.tokenizer == (source / "tokenizer.json").read_text()
    assert (manifest.dtype, manifest.max_step, manifest.vocab_size) == ("bfloat16", MAX_STEP, VOCAB_SIZE)
    assert (manifest.bos_token_id, manifest.eos_token_ids) == (BOS_ID, (EOS_ID,))
    assert [c.window for c in manifest.cache] == [SLIDING_WINDOW, 0]

    # The fixture sets query_pre_attn_scalar=16 (scale 16**-0.5) and attention softcap 5.
    attend = [dict(i.attrs) for i in payload.graph.instructions if i.op == "update_and_attend"]
    assert attend == [
        {"cache_id": 0, "scale": 0.25, "softcap": 5.0},
        {"cache_id": 1, "scale": 0.25, "softcap": 5.0},
    ]
    tokens, positions, rows = (payload.graph.slots[s].type for s in payload.graph.inputs)
    assert tokens.dtype == positions.dtype == rows.dtype == "int64"
    t, r = tokens.shape[1], rows.shape[0]
    assert tokens.shape[0] == 1 and positions.shape == (t,)
    assert isinstance(t, SymDim) and isinstance(r, SymDim) and t.name != r.name
    assert (t.min, t.max, r.min, r.max) == (1, MAX_STEP, 1, MAX_STEP)

    # Every parameter is bf16 (HF keeps buffers such as RoPE's inv_freq in fp32); Gemma's
    # norm weights are folded to 1 + w in fp32, as HF computes them.
    constants = [payload.graph.slots[s] for s in payload.constants]
    assert {c.type.dtype for c in constants if c.name.endswith(".weight")} == {"bfloat16"}
    folded = [c for c in constants if c.name.endswith("norm.weight.folded")]
    assert len(folded) == 9 and {c.type.dtype for c in folded} == {"float32"}  # 4 per layer + the final norm


def test_max_step_beyond_the_context_is_refused_quietly(tiny_checkpoint, tmp_path: Path, capfd):
    with pytest.raises(ExportOptionError, match="exceeds the model's context of 256"):
        export_hf(tiny_checkpoint("llama"), tmp_path / "x.pte", max_step=257, progress=False)
    assert not (tmp_path / "x.pte").exists()
    assert "export:" not in capfd.readouterr().err


@pytest.mark.slow  # an export at the full context bound (~4 s)
def test_default_max_step_is_the_context(tiny_checkpoint, tmp_path: Path):
    """No max_step: the traced token bound is the model's context (the tiny config's 256,
    under DEFAULT_MAX_STEP); the run-time chunk is the session's choice within it."""
    source = tiny_checkpoint("llama")
    context = json.loads((source / "config.json").read_text())["max_position_embeddings"]
    payload = read_pte(export_hf(source, tmp_path / "llama.pte", progress=False))
    assert Manifest.from_dict(payload.manifest).max_step == context
    tokens, _, rows = (payload.graph.slots[s].type for s in payload.graph.inputs)
    assert tokens.shape[1].max == rows.shape[0].max == context
