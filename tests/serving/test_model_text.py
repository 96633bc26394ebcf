"""Request parsing and /tokenize over the model's text alone (``ModelText``), no engine.

The oracle is the program's tokenizer itself (``tokenizers`` through ``TextCodec``, the
same bytes HF's tokenizer.json builds) and the manifest's own limits.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import Manifest
from mlx_pte.serving.openai.request import ApiError, parse_request
from mlx_pte.serving.openai.tokenize_api import detokenize, tokenize
from mlx_pte.serving.text.model_text import ModelText, TextError


@pytest.fixture(scope="module")
def text(program) -> ModelText:
    return ModelText.of(Manifest.from_dict(program.manifest))


@pytest.fixture(scope="module")
def codec(program) -> TextCodec:
    return TextCodec(Manifest.from_dict(program.manifest))


def test_a_completion_parses_against_the_text_alone(text, codec, program):
    parsed = parse_request({"prompt": "The cat", "max_tokens": 3}, text, chat=False)
    assert list(parsed.request.prompt) == codec.encode("The cat")
    assert parsed.request.max_tokens == 3
    context = program.manifest["max_context"]
    with pytest.raises(ApiError, match="maximum context length"):
        parse_request({"prompt": "The cat", "max_tokens": context}, text, chat=False)


def test_tokenize_and_detokenize_take_the_text(text, codec, program):
    reply = tokenize({"prompt": "a b c"}, text)
    assert reply == {"tokens": codec.encode("a b c"), "count": len(codec.encode("a b c")),
                     "max_model_len": program.manifest["max_context"]}
    assert detokenize({"tokens": reply["tokens"]}, text) == {"prompt": codec.decode(reply["tokens"])}


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(-5, 600), max_size=8))
def test_prompt_ids_are_checked_against_the_vocabulary(program, ids):
    text = ModelText.of(Manifest.from_dict(program.manifest))
    vocab = program.manifest["vocab_size"]
    if not ids or any(not 0 <= t < vocab for t in ids):
        with pytest.raises(TextError):
            text.prompt_ids(ids)
    else:
        assert text.prompt_ids(ids) == ids


def test_request_parsing_loads_no_mlx():
    """The server parses bodies before anything touches the device."""
    code = (
        "import sys\n"
        "from mlx_pte.serving.openai.request import parse_request\n"
        "from mlx_pte.serving.openai.tokenize_api import tokenize\n"
        "from mlx_pte.serving.text.model_text import ModelText\n"
        "assert 'mlx.core' not in sys.modules, 'request parsing loaded MLX'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
