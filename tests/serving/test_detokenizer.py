"""Incremental detokenization against the oracle ``decode(all tokens)``.

Random token sequences (weighted towards tokens that carry parts of multi-byte
characters) and random unicode text, through the tiny byte-level tokenizer, the bundled
model's tokenizer and a sentencepiece-style byte-fallback tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mlx_pte.interpreter.text import TextCodec
from mlx_pte.serving.text.detokenizer import IncrementalDecoder
from tests.fixtures.tiny_models import build_tokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "default" / "tokenizer.json"
TRAINING = ["héllo wörld ünïcode", "日本語のテキスト", "emoji 😀🎉 and ₿", "plain ascii text " * 3, "ÅÄÖ åäö ß"]


def sentencepiece_style() -> Tokenizer:
    """Metaspace words, byte-fallback tokens for unknown characters (llama-2/gemma style)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + bytes_, show_progress=False)
    tok.train_from_iterator(TRAINING * 20, trainer)
    # The trainer puts the byte tokens in the vocabulary as special tokens; they are
    # ordinary ones (decoded, not skipped).
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {
    "tiny": lambda: build_tokenizer().backend_tokenizer,
    "bundled": lambda: Tokenizer.from_file(str(BUNDLED)),
    "sentencepiece": sentencepiece_style,
}
_built: dict[str, tuple[TextCodec, list[int]]] = {}


def codec_for(name: str) -> tuple[TextCodec, list[int]]:
    """The real TextCodec over that tokenizer, and the ids of its non-ASCII tokens."""
    if name not in _built:
        tok = TOKENIZERS[name]()
        manifest = SimpleNamespace(tokenizer=tok.to_str(), chat_template=None, bos_token_id=None, eos_token_ids=[], pad_token_id=None)
        codec = TextCodec(manifest)
        wide = [i for i in range(tok.get_vocab_size()) if not codec.decode([i]).isascii()]
        _built[name] = (codec, wide)
    return _built[name]


def stream(codec: TextCodec, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(codec)
    return [decoder.push(t) for t in ids] + [decoder.flush()]


def assert_streams_the_whole_decode(codec: TextCodec, ids: list[int]) -> None:
    whole = codec.decode(ids)
    released = ""
    for piece in stream(codec, ids):
        released += piece
        assert whole.startswith(released), "released text that the whole decode does not start with"
    assert released == whole


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_token_sequences_stream_the_whole_decode(name, data):
    codec, wide = codec_for(name)
    vocab = codec._tokenizer.get_vocab_size()
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(wide))
    assert_streams_the_whole_decode(codec, data.draw(st.lists(token, max_size=40)))


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_encoded_text_streams_back(name, text):
    codec, _ = codec_for(name)
    assert_streams_the_whole_decode(codec, codec.encode(text))


def test_a_character_split_across_tokens_is_held_until_complete():
    codec, _ = codec_for("tiny")
    ids = codec.encode("😀")
    assert len(ids) > 1  # the tiny vocabulary has no emoji: its bytes are separate tokens
    assert stream(codec, ids) == [""] * (len(ids) - 1) + ["😀", ""]


def test_a_byte_fallback_run_is_held_until_it_ends():
    # The decoder joins a run of <0xNN> tokens: valid UTF-8 as a whole, else U+FFFD per byte.
    codec, _ = codec_for("sentencepiece")
    byte = [codec._tokenizer.token_to_id(f"<0x{b:02X}>") for b in b"A\x80"]
    word = codec.encode("hello")[:1]
    assert stream(codec, byte + word) == ["", "", codec.decode(byte + word), ""]
    assert codec.decode(byte).count("\ufffd") == 2
