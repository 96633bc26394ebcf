"""Whole models through the real pipeline: HF checkpoint → export_hf → .pte → MLX
interpreter, for every family and every cache kind, against eager HF (the oracle).

Together with tests/export/test_hf_parity.py (the exported program run eagerly with the
reference cache matches HF) this closes the parity chain: HF = eager program = MLX.
Every test runs with capture on (compiled segments, shapes bucketed) and off (the walk).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mlx_pte.serving.generation import generate
from mlx_pte.interpreter.program import Program
from mlx_pte.interpreter.session import DEFAULT_MAX_STEP, Session, SessionError
from mlx_pte.runtime.cache import KINDS
from tests.fixtures.exported import MAX_STEP
from tests.fixtures.tiny_models import family_params

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
PROMPT_LEN = 12
NEW_TOKENS = 24
ATOL = 1e-4


@dataclass
class Exported:
    program: Program
    hf: torch.nn.Module
    prompt: list[int]
    hf_greedy: list[int] = field(default_factory=list)  # HF's greedy continuation, once


@pytest.fixture(scope="module")
def exported_family(tiny_checkpoint, programs):
    """The family's export (shared with the other folders' tests: ``programs``) and its HF oracle."""
    memo: dict[str, Exported] = {}

    def build(family: str) -> Exported:
        if family not in memo:
            path = tiny_checkpoint(family)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
            from transformers import AutoTokenizer

            ids = AutoTokenizer.from_pretrained(path).encode(PROMPT, add_special_tokens=False)[:PROMPT_LEN]
            memo[family] = Exported(programs(family), hf, ids)
        return memo[family]

    return build


@pytest.fixture(params=family_params())
def exported(request, exported_family) -> Exported:
    return exported_family(request.param)


CAPTURE = pytest.mark.parametrize("capture", [True, False], ids=["captured", "walked"])


def new_session(ex: Exported, kind: str, capture: bool) -> tuple[Session, int | None]:
    session = Session(ex.program, kind=kind, capacity=128, capture=capture)
    return session, (session.cache.seq_new())


@torch.no_grad()
def hf_logits(ex: Exported) -> np.ndarray:
    return ex.hf(torch.tensor([ex.prompt]), use_cache=False).logits[0].numpy()


@CAPTURE
@pytest.mark.parametrize("kind", KINDS)
def test_every_prompt_position_matches_hf(exported: Exported, kind: str, capture: bool):
    session, seq = new_session(exported, kind, capture)
    logits = session.forward(exported.prompt, seq_ids=seq, rows=range(PROMPT_LEN))
    np.testing.assert_allclose(np.array(logits), hf_logits(exported), atol=ATOL, rtol=0)


@CAPTURE
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_equals_unchunked(exported: Exported, kind: str, capture: bool):
    session, seq = new_session(exported, kind, capture)
    chunks = [
        np.array(session.forward(exported.prompt[i : i + 4], seq_ids=seq, rows=range(4)))
        for i in range(0, PROMPT_LEN, 4)
    ]
    whole_session, whole_seq = new_session(exported, kind, capture)
    whole = np.array(whole_session.forward(exported.prompt, seq_ids=whole_seq, rows=range(PROMPT_LEN)))
    # Chunks are matmuls of other row counts, which BLAS may block differently: fp32's last bits.
    # fp32 summation order differs between chunk sizes (the experts op sorts tokens by expert
    # from 64 pairs up), so a few logits move by ~1.5e-5.
    np.testing.assert_allclose(np.concatenate(chunks), whole, atol=3e-5, rtol=1e-5)


@CAPTURE
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_hf_generate(exported: Exported, kind: str, capture: bool):
    """Sliding-window families (window 4) generate far past their window here."""
    session, _ = new_session(exported, kind, capture)
    ours = generate(session, exported.prompt, max_new_tokens=NEW_TOKENS).tokens
    if not exported.hf_greedy:
        with torch.no_grad():
            out = exported.hf.generate(
                torch.tensor([exported.prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        exported.hf_greedy = out[0, PROMPT_LEN:].tolist()
    theirs = exported.hf_greedy
    assert ours == theirs
    assert len(set(ours)) > 3  # a decisive, varied continuation, not one repeated token


@CAPTURE
@pytest.mark.parametrize("kind", KINDS)
def test_run_time_chunk_within_the_export_bound_matches_hf(exported: Exported, kind: str, capture: bool):
    """A session's max_step below the export's bound: rings sized for 3-token writes (window 4
    families keep 4 + 3 - 1 slots), the prompt in chunks of 3, every position against HF."""
    session = Session(exported.program, kind=kind, capacity=128, capture=capture, max_step=3)
    seq = session.cache.seq_new()
    assert session.max_step == 3
    with pytest.raises(SessionError, match="max step of 3"):
        session.forward(exported.prompt[:4], seq_ids=seq)
    chunks = [np.array(session.forward(exported.prompt[i : i + 3], seq_ids=seq, rows=range(3)))
              for i in range(0, PROMPT_LEN, 3)]
    np.testing.assert_allclose(np.concatenate(chunks), hf_logits(exported), atol=ATOL, rtol=0)


@pytest.mark.parametrize("bad", [0, MAX_STEP + 1, 2.0, True])
def test_run_time_chunk_outside_the_export_bound_is_refused(exported_family, bad):
    with pytest.raises(SessionError, match=rf"max_step must be an integer in \[1, {MAX_STEP}\]"):
        Session(exported_family("llama").program, max_step=bad)


def test_default_run_time_chunk_is_the_devices_within_the_bound(exported_family):
    import mlx.core as mx

    program = exported_family("llama").program
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    assert Session(program).max_step == min(MAX_STEP, DEFAULT_MAX_STEP[device])
