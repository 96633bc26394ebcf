"""What the exporter writes, the loader accepts: the special tokens of real HF checkpoints
(a pad token added past the vocabulary, eos ids from generation_config, missing ones).

The oracle is transformers itself: the checkpoint's tokenizer read back with
``AutoTokenizer`` and its JSON files, independently of the exporter.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from mlx_pte.export.hf_errors import HFExportError
from mlx_pte.export.hf_export import export_hf
from mlx_pte.interpreter.program import load
from mlx_pte.interpreter.text import TextCodec
from tests.fixtures.tiny_models import BOS, EOS, PAD, VOCAB_SIZE

MAX_STEP = 8
ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A template that shows every special token HF passes it, so rendering checks the pad text too.
TEMPLATE = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def qwen2_weights(tmp_path_factory) -> Path:
    """A 1-layer Qwen2 model's config and weights (the tokenizer is added per case)."""
    out = tmp_path_factory.mktemp("qwen2_weights")
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _checkpoint(weights: Path, tokenizer, out: Path, config: dict[str, Any],
                generation_eos: Optional[list[int]]) -> Path:
    """``weights`` with ``tokenizer`` saved beside them and ``config``'s fields written into
    config.json (and generation_config.json's eos ids), as a hand-edited checkpoint has them."""
    shutil.copytree(weights, out)
    tokenizer.save_pretrained(out)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    generation = out / "generation_config.json"
    fields = json.loads(generation.read_text()) if generation.exists() else {}
    fields.pop("eos_token_id", None)
    if generation_eos is not None:
        fields["eos_token_id"] = generation_eos
    generation.write_text(json.dumps(fields))
    return out


def _first(*values: Optional[int]) -> Optional[int]:
    return next((v for v in values if v is not None), None)


def _export_and_load(source: Path, out: Path):
    """The exported file loaded into a session, or the export's refusal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            path = export_hf(source, out, max_step=MAX_STEP, progress=False)
        except HFExportError as exc:
            assert not out.exists()
            return exc
    return load(path).session("single", capture=False)


def test_a_pad_token_added_past_the_vocabulary_is_kept(tiny_tokenizer, qwen2_weights, tmp_path: Path):
    """The checkpoint the issue reported: Qwen2's tokenizer adds ``<|endoftext|>`` as its pad
    token, at id = vocab size. HF never embeds a pad id, so the file keeps it, loads, and its
    template renders the pad token's text as HF's does."""
    tokenizer = AutoTokenizer.from_pretrained(_save(tiny_tokenizer, tmp_path / "tok"))
    tokenizer.add_special_tokens({"pad_token": "<|endoftext|>"})
    tokenizer.chat_template = TEMPLATE
    source = _checkpoint(qwen2_weights, tokenizer, tmp_path / "ckpt", {}, None)
    hf = AutoTokenizer.from_pretrained(source)
    assert hf.pad_token_id == VOCAB_SIZE

    session = _export_and_load(source, tmp_path / "qwen2.pte")
    assert session.manifest.pad_token_id == VOCAB_SIZE
    messages = [{"role": "user", "content": "hi"}]
    assert TextCodec(session.manifest).render_chat(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert session.forward([hf.bos_token_id, 5]).shape == (1, VOCAB_SIZE)


def _save(tokenizer, out: Path) -> Path:
    tokenizer.save_pretrained(out)
    return out


# A special token given as text: one of the fixture's own, an ordinary in-vocabulary token,
# or a token the tokenizer adds past the vocabulary.
_TOKEN = st.one_of(st.none(), st.sampled_from((PAD, BOS, EOS, "Ġthe", *ADDED)))
_CONFIG_ID = st.one_of(st.none(), st.integers(-1, VOCAB_SIZE + 2))


@st.composite
def special_tokens(draw) -> dict[str, Any]:
    return {
        "tokens": {role: draw(_TOKEN) for role in ("bos_token", "eos_token", "pad_token")},
        "config": {f"{role}_token_id": draw(_CONFIG_ID) for role in ("bos", "eos", "pad")},
        "generation_eos": draw(st.one_of(st.none(), st.lists(st.integers(0, VOCAB_SIZE + 2), max_size=3))),
    }


def _check_export_agrees(tiny_tokenizer, weights: Path, case: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = AutoTokenizer.from_pretrained(_save(tiny_tokenizer, root / "tok"))
        for role, text in case["tokens"].items():
            setattr(tokenizer, role, text)  # an added text gets the next id past the vocabulary
            if text in ADDED:
                tokenizer.add_special_tokens({role: text})
        source = _checkpoint(weights, tokenizer, root / "ckpt", case["config"], case["generation_eos"])
        hf = AutoTokenizer.from_pretrained(source)
        config = case["config"]
        bos = _first(hf.bos_token_id, config["bos_token_id"])
        pad = _first(hf.pad_token_id, config["pad_token_id"])
        result = _export_and_load(source, root / "model.pte")

        # HF itself refuses a config pad id past the embedding (nn.Embedding's padding_idx);
        # a bos id past it would be embedded. Every other configuration exports and loads.
        config_pad = config["pad_token_id"]
        if (config_pad is not None and config_pad >= VOCAB_SIZE) or not (bos is None or 0 <= bos < VOCAB_SIZE):
            assert isinstance(result, HFExportError), result
            return
        assert not isinstance(result, Exception), f"{case}: {result}"
        manifest = result.manifest
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        eos = list(dict.fromkeys(eos + (case["generation_eos"] or [])))
        assert manifest.bos_token_id == bos
        assert manifest.eos_token_ids == tuple(i for i in eos if i < VOCAB_SIZE)
        assert manifest.pad_token_id == (None if pad is not None and pad < 0 else pad)
        assert result.forward([5]).shape == (1, VOCAB_SIZE)


_PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=3, **_PROPERTY)
@given(case=special_tokens())
def test_every_exported_file_loads(tiny_tokenizer, qwen2_weights, case):
    _check_export_agrees(tiny_tokenizer, qwen2_weights, case)


@pytest.mark.slow
@settings(max_examples=30, **_PROPERTY)
@given(case=special_tokens())
def test_every_exported_file_loads_many_cases(tiny_tokenizer, qwen2_weights, case):
    _check_export_agrees(tiny_tokenizer, qwen2_weights, case)
