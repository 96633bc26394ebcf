"""The bundled checkpoint in models/default loads offline and has learned its corpus.

The oracle for "learned" is an untrained model of the same config and seed, scored here
on the pydoc topics that scripts/train_default_model.py lists as held out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydoc_data.topics import topics
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "default"
MAX_BYTES = 10 * 1024 * 1024
WINDOW = 256


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads((MODEL_DIR / "metrics.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True, dtype=torch.float32).eval()


@torch.no_grad()
def mean_loss(model: torch.nn.Module, documents: list[list[int]]) -> float:
    """Token-weighted next-token cross-entropy over each document in WINDOW-sized chunks."""
    total, count = 0.0, 0
    for ids in documents:
        for start in range(0, len(ids) - 1, WINDOW):
            chunk = torch.tensor(ids[start : start + WINDOW + 1])
            logits = model(chunk[None, :-1]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += len(chunk) - 1
    return total / count


def test_checkpoint_fits_the_size_budget_with_half_precision_weights() -> None:
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert size <= MAX_BYTES, f"models/default is {size} bytes"
    with safe_open(MODEL_DIR / "model.safetensors", framework="pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"BF16"}


def test_tokenizer_and_config_agree_on_special_tokens(tokenizer, model) -> None:
    ids = tokenizer("The for statement")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The for statement"
    assert tokenizer.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    assert model.config.vocab_size == len(tokenizer)
    turns = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert chat == f"{tokenizer.bos_token}user: hi\nassistant: "


def test_held_out_loss_is_far_below_an_untrained_model(tokenizer, model, metrics) -> None:
    held_out = [name for name in metrics["held_out_topics"] if name in topics]
    assert held_out, "none of the held-out topics exist in this Python's pydoc_data"
    eos = [tokenizer.eos_token_id]
    documents = [tokenizer(topics[name], verbose=False)["input_ids"] + eos for name in held_out]

    torch.manual_seed(metrics["seed"])
    untrained = LlamaForCausalLM(AutoConfig.from_pretrained(MODEL_DIR, local_files_only=True)).float().eval()
    baseline = mean_loss(untrained, documents)
    trained = mean_loss(model, documents)

    # An untrained model is near-uniform over the vocabulary.
    assert baseline == pytest.approx(torch.log(torch.tensor(float(len(tokenizer)))).item(), abs=0.3)
    assert trained < 0.6 * baseline, f"held-out loss {trained:.3f} vs untrained {baseline:.3f}"


def test_exported_pte_generates_hf_greedy_tokens(model, tokenizer, tmp_path):
    """The bundled model through the real pipeline (export → .pte → MLX) decodes like HF."""
    from mlx_pte.export.hf_export import export_hf
    from mlx_pte import Session, generate, load

    prompt = tokenizer.encode("The for statement")
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
    program = load(export_hf(MODEL_DIR, tmp_path / "default.pte", progress=False))
    ours = generate(Session(program), "The for statement", max_new_tokens=32)
    assert ours.tokens == theirs.tolist()
    assert "statement" in ours.text or "the" in ours.text  # English, not byte noise
