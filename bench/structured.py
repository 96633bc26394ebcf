"""The per-token cost of structured output: the engine's tok/s with and without a JSON
schema, same prompt, same number of tokens, on SmolLM2-135M.

    .venv/bin/python bench/structured.py [--batches 1,4,16 --generate 64 --repeat 3]
    python3 bench/structured.py --pte smollm2.pte --dtype bfloat16     # e.g. on a GPU

For each B, B requests of one chat prompt arrive at once and each generates exactly
--generate tokens greedily, three ways: free text (eos ignored), every request constrained
by a schema that cannot end sooner (an object holding an array of at least 1000 integers,
so both runs stop at the length limit), and half of them constrained (a mixed batch).
Reported: end-to-end tok/s (B x generate / wall time from submit to the last token, best
of --repeat) and the constrained / free ratio. The checkpoint is exported once (float32 by
default) unless ``--pte`` names an exported file; the model directory defaults to the one
``tests/fixtures/smollm2.py`` builds.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

SMOLLM2 = Path(os.environ.get("MLX_PTE_CACHE", Path.home() / ".cache" / "mlx-pte")) / "smollm2-135m"
PROMPT = [{"role": "user", "content": "List some prime numbers as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"primes": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}},
    "required": ["primes"],
}


def run_batch(engine, prompt: list[int], batch: int, constrained: int, generate: int) -> float:
    """tok/s of ``batch`` requests, the first ``constrained`` of them under SCHEMA."""
    from mlx_pte.serving.engine import Request
    from mlx_pte.serving.sampling.grammar import Grammar

    grammar = Grammar.json_schema(SCHEMA)
    t0 = time.perf_counter()
    handles = [
        engine.submit(Request(prompt, max_tokens=generate, ignore_eos=True, grammar=grammar if i < constrained else None))
        for i in range(batch)
    ]
    engine.run()
    wall = time.perf_counter() - t0
    for h in handles:
        (sample,) = h.result(timeout=0).samples
        assert len(sample.tokens) == generate and sample.finish_reason == "length", sample
    return batch * generate / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=SMOLLM2)
    parser.add_argument("--pte", type=Path, help="run this exported file instead of exporting --model-dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from mlx_pte.interpreter.program import load

    if args.pte:
        program = load(args.pte)
    else:
        import torch  # noqa: F401  (the export uses it: before the OpenBLAS loader, see runtime/mlx/blas.py)

        from mlx_pte.export.hf_export import export_hf

        with tempfile.TemporaryDirectory() as work:
            program = load(export_hf(args.model_dir, Path(work) / "model.pte", dtype=args.dtype, progress=False))

    import mlx.core as mx

    from mlx_pte.serving.engine import Engine

    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(program, "batched-sequence", capacity=max(batches) * 512, kv_dtype=args.dtype)
    prompt = engine.encode(engine.codec.render_chat(PROMPT))
    run_batch(engine, prompt, 2, 1, 8)  # warm both paths
    print(f"{args.pte or args.model_dir}: prompt {len(prompt)} tokens, generate {args.generate}, {args.dtype}, "
          f"device {mx.default_device()}, best of {args.repeat}")
    print(f"{'B':>3} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6} {'mixed tok/s':>12}")
    for b in batches:
        best = {}
        for name, constrained in (("free", 0), ("schema", b), ("mixed", b // 2)):
            best[name] = max(run_batch(engine, prompt, b, constrained, args.generate) for _ in range(args.repeat))
        print(f"{b:3d} {best['free']:11.1f} {best['schema']:13.1f} {best['schema'] / best['free']:6.2f} "
              f"{best['mixed']:12.1f}", flush=True)


if __name__ == "__main__":
    main()
