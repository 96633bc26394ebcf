"""The exported HF wrapper, run eagerly against each reference cache kind, matches eager HF.

The oracle is the same checkpoint loaded with transformers' default attention and run
without our op (``use_cache=False`` for logits, ``generate`` for greedy tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pytest
import torch

import mlx_pte.runtime.reference  # noqa: F401  (registers backend "reference")
from mlx_pte.export.custom_ops import bind_cache
from mlx_pte.export.hf_attention import ATTN_IMPLEMENTATION
from mlx_pte.export.hf_checkpoint import load_checkpoint, load_model
from mlx_pte.export.hf_geometry import HFCacheLayout, cache_layout
from mlx_pte.export.hf_wrapper import HFWrapper, trace
from mlx_pte.runtime.cache import CACHE_FACTORY, KIND_SINGLE, KINDS, CacheConfig, Step
from tests.fixtures.tiny_models import FAMILIES, SLIDING_WINDOW
from transformers import AutoModelForCausalLM

MAX_STEP = 32
ATOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
OTHER_PROMPT = "Return the value of a keyword argument."
PROMPT_LEN = 12
OTHER_LEN = 7
NEW_TOKENS = 24
SLIDING_FAMILIES = ("mistral", "gemma3", "gemma2", "gemma3n", "gpt_oss")


@dataclass
class Exported:
    family: str
    run: torch.nn.Module  # the exported program's module
    layout: HFCacheLayout
    hf: torch.nn.Module  # the oracle: default attention
    prompt: list[int]
    other: list[int]


@pytest.fixture(scope="module")
def export_family(tiny_checkpoint):
    """``export_family(family) -> Exported``, traced once per family."""
    memo: dict[str, Exported] = {}

    def build(family: str) -> Exported:
        if family not in memo:
            path = tiny_checkpoint(family)
            checkpoint = load_checkpoint(path)
            layout = cache_layout(checkpoint.config)
            model = load_model(checkpoint, "float32", ATTN_IMPLEMENTATION)
            program = trace(HFWrapper(model, layout), MAX_STEP)
            hf = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, local_files_only=True
            ).eval()
            assert hf.config._attn_implementation != ATTN_IMPLEMENTATION
            tok = checkpoint.tokenizer
            prompt = tok.encode(PROMPT, add_special_tokens=False)[:PROMPT_LEN]
            other = tok.encode(OTHER_PROMPT, add_special_tokens=False)[:OTHER_LEN]
            assert (len(prompt), len(other)) == (PROMPT_LEN, OTHER_LEN)
            memo[family] = Exported(family, program.module(), layout, hf, prompt, other)
        return memo[family]

    return build


@pytest.fixture(params=FAMILIES)
def exported(request, export_family) -> Exported:
    return export_family(request.param)


def new_cache(ex: Exported, kind: str, capacity: int = 128):
    config = CacheConfig(capacity=capacity, max_write=MAX_STEP)
    return CACHE_FACTORY.build("reference", kind, ex.layout.geometry, config)


def new_seq(cache) -> int:
    return cache.seq_new()


def forward(
    ex: Exported,
    cache,
    tokens: Sequence[int],
    seq_ids: Sequence[int],
    positions: Sequence[int],
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """One declared step through the exported program; logits of ``rows`` (default: all)."""
    cache.declare_step(Step(tuple(seq_ids), tuple(positions)))
    rows = range(len(tokens)) if rows is None else rows
    with bind_cache(cache), torch.no_grad():
        logits = ex.run(
            torch.tensor([list(tokens)], dtype=torch.long),
            torch.tensor(list(positions), dtype=torch.long),
            torch.tensor(list(rows), dtype=torch.long),
        )
    cache.finish_step()
    return logits


@torch.no_grad()
def hf_logits(ex: Exported, ids: Sequence[int]) -> torch.Tensor:
    return ex.hf(torch.tensor([list(ids)]), use_cache=False).logits[0]


def prefill(ex: Exported, cache, seq: int, ids: Sequence[int], chunk: int) -> torch.Tensor:
    """All rows of ``ids`` fed ``chunk`` tokens a step, from position 0."""
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        out.append(forward(ex, cache, piece, [seq] * len(piece), range(start, start + len(piece))))
    return torch.cat(out)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_hf_at_every_position(exported: Exported, kind: str):
    cache = new_cache(exported, kind)
    seq = new_seq(cache)
    logits = prefill(exported, cache, seq, exported.prompt, PROMPT_LEN)
    assert logits.dtype == torch.float32
    assert logits.shape == (PROMPT_LEN, exported.hf.config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(exported, exported.prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_equals_unchunked(exported: Exported, kind: str):
    whole_cache = new_cache(exported, kind)
    whole = prefill(exported, whole_cache, new_seq(whole_cache), exported.prompt, PROMPT_LEN)
    chunked_cache = new_cache(exported, kind)
    chunked = prefill(exported, chunked_cache, new_seq(chunked_cache), exported.prompt, 4)
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked, hf_logits(exported, exported.prompt), atol=ATOL, rtol=0)


def test_rows_pick_logit_rows(exported: Exported):
    full_cache = new_cache(exported, KIND_SINGLE)
    every = forward(exported, full_cache, exported.prompt, [0] * PROMPT_LEN, range(PROMPT_LEN))
    rows = [PROMPT_LEN - 1, 3, 0, 3]
    cache = new_cache(exported, KIND_SINGLE)
    picked = forward(exported, cache, exported.prompt, [0] * PROMPT_LEN, range(PROMPT_LEN), rows)
    assert picked.shape == (len(rows), every.shape[1])
    torch.testing.assert_close(picked, every[rows], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != KIND_SINGLE])
def test_two_sequences_in_one_step_match_hf_separately(exported: Exported, kind: str):
    """Both prompts prefilled in one step, then one decode step for both."""
    cache = new_cache(exported, kind)
    a, b = cache.seq_new(), cache.seq_new()
    p, o = exported.prompt, exported.other
    logits = forward(
        exported,
        cache,
        p + o,
        [a] * len(p) + [b] * len(o),
        list(range(len(p))) + list(range(len(o))),
        [len(p) - 1, len(p) + len(o) - 1],
    )
    want_a, want_b = hf_logits(exported, p)[-1], hf_logits(exported, o)[-1]
    torch.testing.assert_close(logits, torch.stack([want_a, want_b]), atol=ATOL, rtol=0)
    next_a, next_b = int(want_a.argmax()), int(want_b.argmax())
    decoded = forward(exported, cache, [next_b, next_a], [b, a], [len(o), len(p)])
    want = torch.stack([hf_logits(exported, o + [next_b])[-1], hf_logits(exported, p + [next_a])[-1]])
    torch.testing.assert_close(decoded, want, atol=ATOL, rtol=0)


def greedy_through_program(ex: Exported, kind: str, prompt: list[int], n: int) -> list[int]:
    cache = new_cache(ex, kind)
    seq = new_seq(cache)
    last = prefill(ex, cache, seq, prompt, 4)[-1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(last.argmax()))
        position = len(prompt) + len(out) - 1
        last = forward(ex, cache, [out[-1]], [seq], [position])[-1]
    return out


@pytest.fixture(scope="module")
def hf_greedy_tokens():
    """HF's greedy continuation of each family's prompt, computed once per family."""
    memo: dict[str, list[int]] = {}

    @torch.no_grad()
    def generate(ex: Exported) -> list[int]:
        if ex.family not in memo:
            ids = torch.tensor([ex.prompt])
            runs = [
                ex.hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    use_cache=use_cache,
                )[0, len(ex.prompt) :].tolist()
                for use_cache in (True, False)
            ]
            # HF with its own KV cache and HF recomputing everything agree.
            assert runs[0] == runs[1]
            memo[ex.family] = runs[0]
        return memo[ex.family]

    return generate


# Every kind on the mixed sliding + full family; the single kind on the others (gemma3n:
# decode steps where shared layers read their donor's cache).
GENERATION_CASES = [("gemma3", kind) for kind in KINDS] + [
    (family, KIND_SINGLE) for family in SLIDING_FAMILIES if family != "gemma3"
]


@pytest.mark.parametrize(("family", "kind"), GENERATION_CASES)
def test_greedy_generation_past_the_window_matches_hf_generate(
    family: str, kind: str, export_family, hf_greedy_tokens
):
    exported = export_family(family)
    assert PROMPT_LEN + NEW_TOKENS > 4 * SLIDING_WINDOW
    want = hf_greedy_tokens(exported)
    assert len(want) == NEW_TOKENS
    # A degenerate model repeating one token would hide window bugs.
    assert len(set(want)) > NEW_TOKENS // 2
    assert greedy_through_program(exported, kind, exported.prompt, NEW_TOKENS) == want
