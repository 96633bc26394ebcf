"""What the upstream parity tests and their figures share: the HF oracle of an upstream
export, and running a session over a prompt (every row, or greedy decoding)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from mlx_pte.interpreter.program import load
from tests.fixtures.dequantized import load_into

from .export_upstream import dequantized_path

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
PROMPT_LEN = 12
EXTRA_POSITIONS = 8  # HF's greedy continuation appended: 20 positions, past gemma3's window of 4
# Max |error| as a fraction of max |logit|: fp32 is exact up to summation order; half
# precision stores weights and activations rounded (bf16 keeps 8 mantissa bits). MLX's CPU
# quantized_matmul accumulates a bfloat16 product in bfloat16 (its error grows with the
# width: ~1% of the largest output at 64 inputs, ~7% at 1024, against ~0.2% for a bf16
# matmul), so bf16 quantized programs get their own bound.
# (Measured on these checkpoints: docs/upstream.md, `python -m tests.upstream.parity_figures`.)
RELATIVE_TOLERANCE = {"fp32": 2e-5, "fp16": 1.5e-2, "bf16": 5e-2, "bf16-quantized": 0.2}
# Fraction of positions whose greedy choice must equal HF's: rounding may flip near-ties.
ARGMAX_AGREEMENT = {"fp32": 1.0, "fp16": 0.9, "bf16": 0.9, "bf16-quantized": 0.7}


def precision(variant: str) -> str:
    """The key of a variant (``bf16``, ``fp32-4w``...) in the tolerance tables."""
    dtype, _, quantization = variant.partition("-")
    return "bf16-quantized" if dtype == "bf16" and quantization else dtype


def hf_model(checkpoint: Path, pte: Path, variant: str) -> torch.nn.Module:
    """The float32 HF model; for a quantized variant, with upstream's quantized weights as
    its quantizer (torchao) dequantizes them."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True).eval()
    if "-" in variant:
        load_into(torch.load(dequantized_path(pte)), {"": model})
    return model


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: Sequence[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([list(ids)]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False)  # fmt: skip
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: Sequence[int]) -> np.ndarray:
    return model(torch.tensor([list(ids)]), use_cache=False).logits[0].numpy()


def run_all_rows(session, ids: Sequence[int]) -> np.ndarray:
    """Logits of every position: prefill in max-step chunks, all rows selected."""
    seq = session.cache.seq_new()
    out = []
    for start in range(0, len(ids), session.max_step):
        piece = ids[start : start + session.max_step]
        out.append(np.array(session.forward(piece, seq_ids=seq, rows=range(len(piece)))))
    return np.concatenate(out)


def greedy(session, ids: Sequence[int], new_tokens: int) -> list[int]:
    seq = session.cache.seq_new()
    for start in range(0, len(ids), session.max_step):
        logits = session.forward(ids[start : start + session.max_step], seq_ids=seq)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(np.array(logits).argmax(-1)[0]))
        logits = session.forward([tokens[-1]], seq_ids=seq)
    return tokens


def compare_logits(pte: Path, model: torch.nn.Module, prompt: Sequence[int], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(mlx-pte's logits, HF's) at every position of the prompt and HF's greedy continuation."""
    ids = list(prompt) + hf_greedy(model, prompt, EXTRA_POSITIONS)
    return run_all_rows(load(pte).session(kind), ids), hf_logits(model, ids)
