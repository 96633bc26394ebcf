"""The parity figures of docs/upstream.md: every tiny family and export variant, exported by
upstream's exporter and run by mlx-pte on every cache kind, against its HF oracle
(``parity.hf_model``): max |logit difference| over the positions the tests check, as a
value and as a fraction of max |logit|, the positions whose argmax agrees, and (float32
activations) whether 16 greedy tokens equal HF's.

``python -m tests.upstream.parity_figures OUT_DIR [FAMILY:VARIANT ...]`` (default: all).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from mlx_pte.interpreter.program import load
from mlx_pte.runtime.cache import KINDS
from tests.fixtures.tiny_models import build_tiny_checkpoint, build_tokenizer

from .parity import PROMPT, PROMPT_LEN, compare_logits, greedy, hf_greedy, hf_model
from .test_upstream_parity import FAMILIES, NEW_TOKENS, VARIANTS


def main(out: Path, wanted: list[tuple[str, str]]) -> None:
    tokenizer = build_tokenizer()
    checkpoints = {f: build_tiny_checkpoint(f, out / "checkpoints" / f, tokenizer=tokenizer) for f, _ in wanted}
    missing = [f"{f}:{v}:{checkpoints[f]}" for f, v in wanted if not (out / f"{f}_{v}.pte").exists()]
    if missing:
        subprocess.run([sys.executable, "-m", "tests.upstream.export_upstream", str(out), *missing], check=True,
                       capture_output=True)  # fmt: skip
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)[:PROMPT_LEN]
    print("| family | variant | cache kind | max abs diff | max abs logit | relative | argmax agrees | greedy 16 |")
    print("|---|---|---|---|---|---|---|---|")
    for family, variant in wanted:
        pte = out / f"{family}_{variant}.pte"
        model = hf_model(checkpoints[family], pte, variant)
        want_tokens = hf_greedy(model, prompt, NEW_TOKENS) if variant.startswith("fp32") else None
        for kind in KINDS:
            got, want = compare_logits(pte, model, prompt, kind)
            diff, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
            agree = float((got.argmax(-1) == want.argmax(-1)).mean())
            same = "-" if want_tokens is None else str(greedy(load(pte).session(kind), prompt, NEW_TOKENS) == want_tokens)
            print(f"| {family} | {variant} | {kind} | {diff:.3g} | {scale:.3g} | {diff / scale:.2e} | {agree:.0%} | {same} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    specs = [tuple(s.split(":", 1)) for s in sys.argv[2:]] or [(f, v) for f in FAMILIES for v in VARIANTS]
    main(Path(sys.argv[1]), specs)  # type: ignore[arg-type]
