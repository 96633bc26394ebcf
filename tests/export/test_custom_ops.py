"""``llm::update_and_attend`` in an exported program, run eagerly against reference caches.

A tiny attention model (per layer: q/k/v projections with RoPE, the op, an output
projection; then an LM head over selected rows) is exported once. Every case runs the
exported program with a real cache and checks each row against a cacheless baseline
written here: full attention over each sequence's whole token history, recomputed.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

import mlx_pte.runtime.reference  # noqa: F401  (registers the "reference" caches)
from mlx_pte.export.custom_ops import NoCacheBound, bind_cache
from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    CacheConfig,
    CacheError,
    CacheGeometry,
    CacheRefused,
    KINDS,
    LayerGeometry,
    LayerPolicy,
    Step,
    StepStateError,
)


VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, V_HEAD_DIM = 40, 32, 4, 2, 8, 6
WINDOWS = (0, 3, 0)  # the middle layer slides
SOFTCAPS = (0.0, 0.0, 4.0)
ATOL = 1e-4

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = 1.0 / (100.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = positions.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, KV_HEADS * V_HEAD_DIM)
        self.o = nn.Linear(HEADS * V_HEAD_DIM, HIDDEN)


class TinyAttentionModel(nn.Module):
    """forward(tokens int64[1, T], positions int64[T], rows int64[R]) -> logits [R, VOCAB]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in WINDOWS)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        return self.run(tokens, positions, rows, self.op_attention)

    @staticmethod
    def op_attention(layer, q, k, v, positions):
        return torch.ops.llm.update_and_attend(
            q, k, v, positions, layer, HEAD_DIM**-0.5, SOFTCAPS[layer]
        )

    def run(self, tokens, positions, rows, attention: Attention) -> torch.Tensor:
        x = self.embed(tokens)
        T = tokens.shape[1]
        for layer, block in enumerate(self.blocks):
            q = block.q(x).view(1, T, HEADS, HEAD_DIM).transpose(1, 2)
            k = block.k(x).view(1, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = block.v(x).view(1, T, KV_HEADS, V_HEAD_DIM).transpose(1, 2)
            out = attention(layer, rope(q, positions), rope(k, positions), v, positions)
            x = x + block.o(out.transpose(1, 2).reshape(1, T, HEADS * V_HEAD_DIM))
        return self.lm_head(x[0, rows])


def full_attention(layer, q, k, v, positions):
    """Cacheless: every token of one whole sequence over the same sequence, windowed."""
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * HEAD_DIM**-0.5
    if SOFTCAPS[layer]:
        scores = SOFTCAPS[layer] * torch.tanh(scores / SOFTCAPS[layer])
    i, j = positions[:, None], positions[None, :]
    visible = j <= i
    if WINDOWS[layer]:
        visible &= j > i - WINDOWS[layer]
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def baseline(model: TinyAttentionModel, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), VOCAB] of one sequence from position 0, every row."""
    n = len(tokens)
    with torch.no_grad():
        return model.run(torch.tensor([tokens]), torch.arange(n), torch.arange(n), full_attention)


@pytest.fixture(scope="module")
def model() -> TinyAttentionModel:
    return TinyAttentionModel().eval()


@pytest.fixture(scope="module")
def exported(model) -> torch.export.ExportedProgram:
    """Exported with no cache bound: tracing sees only the fake kernel."""
    T, R = torch.export.Dim("T", min=1, max=32), torch.export.Dim("R", min=1, max=32)
    example = (torch.zeros(1, 4, dtype=torch.long), torch.arange(4), torch.tensor([2, 3]))
    dynamic = ({1: T}, {0: T}, {0: R})
    return torch.export.export(model, example, dynamic_shapes=dynamic, strict=False)


@pytest.fixture(scope="module")
def program(exported) -> torch.nn.Module:
    return exported.module()


def geometry() -> CacheGeometry:
    policies = [LayerPolicy.from_window(w) for w in WINDOWS]
    return CacheGeometry(tuple(LayerGeometry(p, KV_HEADS, HEAD_DIM, V_HEAD_DIM) for p in policies))


def make_cache(kind: str, capacity: int = 32, **config):
    config.setdefault("max_write", 8)
    config = CacheConfig(capacity=capacity, **config)
    return CACHE_FACTORY.build("reference", kind, geometry(), config)


def forward(program, cache, step: Step, tokens: list[int]) -> torch.Tensor:
    """Declare ``step``, run the program over every row, finish the step."""
    cache.declare_step(step)
    with bind_cache(cache), torch.no_grad():
        inputs = torch.tensor([tokens]), torch.tensor(step.positions), torch.arange(len(tokens))
        logits = program(*inputs)
    cache.finish_step()
    return logits


class Transcript:
    """Each sequence's tokens so far; checks every row of a step against the baseline."""

    def __init__(self, model, program, cache) -> None:
        self.model, self.program, self.cache = model, program, cache
        self.tokens: dict[int, list[int]] = {}

    def new(self) -> int:
        seq = self.cache.seq_new()
        self.tokens[seq] = []
        return seq

    def step(self, seq_ids: list[int], tokens: list[int]) -> torch.Tensor:
        running = {s: list(self.tokens[s]) for s in set(seq_ids)}
        positions = []
        for s, t in zip(seq_ids, tokens):
            positions.append(len(running[s]))
            running[s].append(t)
        logits = forward(self.program, self.cache, Step(seq_ids, positions), tokens)
        # Causal: a row of the whole sequence's baseline is that prefix's logits.
        full = {s: baseline(self.model, running[s]) for s in running}
        want = torch.stack([full[s][p] for s, p in zip(seq_ids, positions)])
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
        self.tokens.update(running)
        return logits

    def run(self, seq: int, tokens: list[int]) -> torch.Tensor:
        return self.step([seq] * len(tokens), tokens)

    def clone(self, src: int, upto: int) -> int:
        dst = self.cache.seq_clone(src, upto)
        self.tokens[dst] = self.tokens[src][:upto]
        return dst

    def rewind(self, seq: int, position: int) -> None:
        self.cache.rewind(seq, position)
        self.tokens[seq] = self.tokens[seq][:position]


TOKENS = [5, 17, 3, 29, 11, 8, 36, 2, 21, 14]


# -- the graph ------------------------------------------------------------------------


def op_calls(exported) -> list[torch.fx.Node]:
    target = torch.ops.llm.update_and_attend.default
    return [n for n in exported.graph.nodes if n.op == "call_function" and n.target == target]


def test_graph_is_functional_with_one_op_per_layer(exported) -> None:
    signature = exported.graph_signature
    assert {spec.kind.name for spec in signature.input_specs} == {"PARAMETER", "USER_INPUT"}
    assert {spec.kind.name for spec in signature.output_specs} == {"USER_OUTPUT"}
    calls = op_calls(exported)
    assert [n.args[4] for n in calls] == [0, 1, 2]
    assert [n.args[5] for n in calls] == [HEAD_DIM**-0.5] * 3
    softcaps = [n.args[6] if len(n.args) > 6 else n.kwargs.get("softcap", 0.0) for n in calls]
    assert softcaps == list(SOFTCAPS)


def test_the_op_output_takes_the_value_head_dim(exported) -> None:
    for call in op_calls(exported):
        batch, heads, tokens, dim = call.meta["val"].shape
        assert (batch, heads, dim) == (1, HEADS, V_HEAD_DIM)
        assert str(tokens) == str(call.args[0].meta["val"].shape[2])  # the dynamic T


def test_the_eager_op_needs_a_bound_cache(program) -> None:
    with pytest.raises(NoCacheBound, match="bind_cache"):
        program(torch.tensor([[1, 2]]), torch.arange(2), torch.tensor([1]))


def test_the_forward_must_carry_the_declared_positions(model, program) -> None:
    cache = make_cache("single")
    cache.declare_step(Step.run(0, 3))
    with bind_cache(cache), pytest.raises(CacheError, match="differ from the declared step"):
        program(torch.tensor([TOKENS[:2]]), torch.arange(2), torch.tensor([1]))
    cache.abort_step()
    transcript = Transcript(model, program, cache)
    transcript.run(transcript.new(), TOKENS[:3])


def test_rows_select_which_tokens_reach_the_head(model, program) -> None:
    cache = make_cache("single")
    cache.declare_step(Step.run(0, 4))
    with bind_cache(cache), torch.no_grad():
        logits = program(torch.tensor([TOKENS[:4]]), torch.arange(4), torch.tensor([3, 0]))
    cache.finish_step()
    torch.testing.assert_close(logits, baseline(model, TOKENS[:4])[[3, 0]], atol=ATOL, rtol=0)


def test_a_forward_without_a_declared_step_is_refused(model, program) -> None:
    cache = make_cache("batched-sequence")
    transcript = Transcript(model, program, cache)
    transcript.run(transcript.new(), TOKENS[:2])
    with bind_cache(cache), pytest.raises(StepStateError, match="declare_step"):
        program(torch.tensor([[4]]), torch.tensor([2]), torch.tensor([0]))


# -- every kind ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "chunks",
    [(6,), (4, 1, 1, 1), (3, 3), (3, 1, 1, 1, 1, 1, 1, 1)],
    ids=["prefill", "decode", "chunked", "past-window"],
)
def test_steps_match_the_baseline(model, program, kind: str, chunks) -> None:
    transcript = Transcript(model, program, make_cache(kind, initial_capacity=2))
    seq = transcript.new()
    at = 0
    for n in chunks:
        transcript.run(seq, TOKENS[at : at + n])
        at += n


@pytest.mark.parametrize("kind", KINDS)
def test_rewinding_then_continuing_matches_an_unbroken_run(model, program, kind: str) -> None:
    transcript = Transcript(model, program, make_cache(kind))
    seq = transcript.new()
    transcript.run(seq, TOKENS[:5])
    transcript.rewind(seq, 3)
    transcript.run(seq, [7, 7, 1])


# -- batched-sequence -----------------------------------------------------------------


def test_multiple_spans_match_separate_runs(model, program) -> None:
    transcript = Transcript(model, program, make_cache("batched-sequence", capacity=16))
    seqs = [transcript.new() for _ in range(4)]
    transcript.step([seqs[3]] * 5, TOKENS[:5])
    transcript.step([seqs[2]] * 4 + [seqs[1]] * 3, TOKENS[:4] + TOKENS[5:8])


@pytest.mark.parametrize("kind", ["batched-cell", "batched-sequence"])
def test_repeated_spans_preserve_token_order(model, program, kind: str) -> None:
    transcript = Transcript(model, program, make_cache(kind, capacity=16))
    a, b = transcript.new(), transcript.new()
    transcript.step([a, a, b, a], [4, 9, 4, 13])
    transcript.step([b, a, b], [1, 2, 3])


@pytest.mark.parametrize("kind", ["batched-cell", "batched-sequence"])
def test_decode_continues_each_private_sequence(model, program, kind: str) -> None:
    transcript = Transcript(model, program, make_cache(kind, capacity=16))
    a, b = transcript.new(), transcript.new()
    transcript.step([a] * 3 + [b] * 2, TOKENS[:3] + TOKENS[3:5])
    for token in TOKENS[5:9]:
        transcript.step([a, b], [token, token + 1])


def test_a_span_must_continue_its_sequence_and_the_declaration_stands(model, program) -> None:
    cache = make_cache("batched-sequence", capacity=16)
    transcript = Transcript(model, program, cache)
    seq = transcript.new()
    cache.declare_step(Step((seq, seq), (0, 1)))
    for positions in [(1, 2), (0, 2)]:
        with pytest.raises(CacheRefused, match=r"continues at position 0"):
            cache.declare_step(Step((seq, seq), positions))
    assert cache.pos(seq) == 0 and cache.step_plan.step.positions == (0, 1)
    with bind_cache(cache), torch.no_grad():
        logits = program(torch.tensor([TOKENS[:2]]), torch.arange(2), torch.arange(2))
    cache.finish_step()
    torch.testing.assert_close(logits, baseline(model, TOKENS[:2]), atol=ATOL, rtol=0)


def test_a_sequence_spanned_twice_continues_across_both(model, program) -> None:
    cache = make_cache("batched-sequence", capacity=16)
    transcript = Transcript(model, program, cache)
    a, b = transcript.new(), transcript.new()
    transcript.step([a, b, a], [1, 2, 3])
    with pytest.raises(CacheRefused, match=rf"sequence {a} continues at position 3"):
        cache.declare_step(Step((a, b, a), (2, 1, 4)))
    assert (cache.pos(a), cache.pos(b), cache.is_declared) == (2, 1, False)
    transcript.step([a, b, a], [4, 5, 6])


def test_capacity_is_the_pool_total_and_a_refusal_changes_nothing(model, program) -> None:
    cache = make_cache("batched-sequence", capacity=4)
    transcript = Transcript(model, program, cache)
    a, b = transcript.new(), transcript.new()
    with pytest.raises(CacheRefused, match="needs 5 positions, 4 of 4 are free"):
        cache.declare_step(Step((a,) * 5, tuple(range(5))))
    assert cache.held() == 0
    transcript.step([a, a, b, b], TOKENS[:4])
    for seq in (a, b):
        with pytest.raises(CacheRefused, match="0 of 4 are free"):
            cache.declare_step(Step((seq,), (2,)))
    with pytest.raises(CacheRefused, match="does not fit"):
        cache.seq_clone(a, 1)
    cache.seq_rm(b)
    transcript.step([a, a], TOKENS[4:6])


def test_removing_a_sequence_invalidates_the_declared_step(program) -> None:
    cache = make_cache("batched-sequence")
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step(Step((a,), (0,)))
    cache.seq_rm(b)
    with bind_cache(cache), pytest.raises(StepStateError):
        program(torch.tensor([[3]]), torch.tensor([0]), torch.tensor([0]))


def test_rewind_refuses_to_grow_or_pass_the_window(model, program) -> None:
    # The ring layer (window 3, max_write 3) keeps 5 slots: after 6 tokens, 3 is the floor.
    cache = make_cache("batched-sequence", max_write=3)
    transcript = Transcript(model, program, cache)
    seq = transcript.new()
    transcript.run(seq, TOKENS[:3])
    transcript.run(seq, TOKENS[3:6])
    with pytest.raises(CacheRefused, match="holds 6 positions"):
        cache.rewind(seq, 7)
    with pytest.raises(CacheRefused, match="from 3 on"):
        cache.rewind(seq, 2)
    transcript.rewind(seq, 3)
    transcript.run(seq, [1, 2])


def test_forks_continue_independently(model, program) -> None:
    transcript = Transcript(model, program, make_cache("batched-sequence"))
    a = transcript.new()
    transcript.run(a, TOKENS[:6])
    b = transcript.clone(a, 4)
    transcript.step([b, a, b], [30, 31, 32])
    transcript.step([a, b], [1, 1])


# -- batched-cell ---------------------------------------------------------------------------


def test_a_fork_shares_cells_and_history(model, program) -> None:
    cache = make_cache("batched-cell")
    transcript = Transcript(model, program, cache)
    a = transcript.new()
    transcript.run(a, TOKENS[:4])
    free = cache.free_cells()
    b = transcript.clone(a, 4)
    assert (cache.free_cells(), cache.seq_len(b)) == (free, 4)
    transcript.step([b, a], [33, 34])


def test_a_fork_at_a_position_shares_only_the_prefix(model, program) -> None:
    cache = make_cache("batched-cell")
    transcript = Transcript(model, program, cache)
    a = transcript.new()
    transcript.run(a, TOKENS[:4])
    b = transcript.clone(a, 2)
    assert (cache.free_cells(), cache.seq_len(b)) == (28, 2)
    transcript.step([b, b, a], [12, 13, 14])


def test_freed_cells_refill_without_leaking_history(model, program) -> None:
    cache = make_cache("batched-cell", capacity=8)
    transcript = Transcript(model, program, cache)
    a, b = transcript.new(), transcript.new()
    transcript.step([a, b, a, b, a], TOKENS[:5])
    b_fork = transcript.clone(b, 2)
    cache.seq_rm(b)
    assert cache.free_cells() == 8 - 5  # b's cells are still owned by its fork
    cache.seq_rm(a)
    assert cache.free_cells() == 8 - 2
    c = transcript.new()
    transcript.step([c, c, c, b_fork], TOKENS[5:9])


def test_rewind_frees_only_the_tail(model, program) -> None:
    cache = make_cache("batched-cell")
    transcript = Transcript(model, program, cache)
    a, b = transcript.new(), transcript.new()
    transcript.step([a] * 5 + [b] * 2, TOKENS[:7])
    transcript.rewind(a, 2)
    assert cache.free_cells() == 32 - 4
    transcript.step([a, b, a], [9, 8, 7])


def test_the_window_narrows_each_query_without_crossing_sequences(model, program) -> None:
    transcript = Transcript(model, program, make_cache("batched-cell"))
    a, b = transcript.new(), transcript.new()
    # Interleaved so each sequence's window spans the other's cells.
    transcript.step([a, b, a, b, a, b, a, b], TOKENS[:8])
    for token in TOKENS[:4]:
        transcript.step([b, a], [token, token + 2])


def test_admission_fails_before_the_forward(program) -> None:
    cache = make_cache("batched-cell", capacity=4)
    a = cache.seq_new()
    with pytest.raises(CacheRefused, match="needs 5 cells, 4 of 4 are free"):
        cache.declare_step(Step((a,) * 5, tuple(range(5))))
    assert not cache.is_declared and cache.free_cells() == 4
