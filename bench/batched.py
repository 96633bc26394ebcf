"""Aggregate decode speed of the batching engine against mlx-lm's BatchGenerator, on one
checkpoint, in one process run.

    .venv/bin/python bench/batched.py MODEL_DIR [--prompt 64 --generate 64 --batches 1,2,4,8,16,32]
    python3 bench/batched.py MODEL_DIR --pte model.pte --dtype bfloat16 --kinds batched-sequence

For each B, B requests (distinct random prompts of --prompt tokens) arrive at once and each
generates --generate tokens greedily without stopping at eos, computing in --dtype (float32
by default, as the CPU wants; bfloat16 on a GPU), on:
mlx-pte's Engine over each of --kinds (``batched-cell`` and ``batched-sequence``), and mlx-lm's
BatchGenerator. ``--pte`` runs an already exported file instead of exporting MODEL_DIR (where
no exporter is installed, e.g. the GPU machine: see gpu_decode.py). Two rates per engine:


* decode tok/s: the engine's own decode accounting. mlx-pte: tokens of forwards that carry
  no prefill / their time; mlx-lm: ``BatchStats.generation_tps`` (generated tokens / time
  outside prompt processing).
* end-to-end tok/s: B x generate / wall time from submit to the last token (same for all).

Ratios are mlx-pte / mlx-lm (> 1: mlx-pte is faster). ``--repeat k`` keeps each rate's
best of k runs, which filters out interference on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (the export uses it: before the OpenBLAS loader, see runtime/mlx/blas.py)

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core: fast BLAS)
import mlx.core as mx
from variants import load_mlx_lm

KINDS = ("batched-cell", "batched-sequence")


@dataclass(frozen=True)
class Rates:
    decode_tps: float
    e2e_tps: float


def prompts_for(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    return rng.integers(0, vocab, (batch, length)).tolist()


def bench_engine(program, kind: str, prompts: list[list[int]], n: int, dtype: str) -> Rates:
    from mlx_pte.serving.engine import Engine, Request

    capacity = sum(len(p) + n for p in prompts)
    engine = Engine(program, kind, capacity=capacity, kv_dtype=dtype)
    t0 = time.perf_counter()
    handles = [engine.submit(Request(p, max_tokens=n, ignore_eos=True)) for p in prompts]
    engine.run()
    wall = time.perf_counter() - t0
    assert all(len(h.result(timeout=0).samples[0].tokens) == n for h in handles)
    return Rates(engine.stats.decode_tps, len(prompts) * n / wall)


def bench_mlx_lm(model, prompts: list[list[int]], n: int) -> Rates:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, completion_batch_size=max(32, len(prompts)))
    t0 = time.perf_counter()
    gen.insert(prompts, [n] * len(prompts))
    produced = 0
    with gen.stats() as stats:
        while responses := gen.next_generated():
            produced += len(responses)
    wall = time.perf_counter() - t0
    gen.close()
    assert produced == len(prompts) * n
    return Rates(stats.generation_tps, len(prompts) * n / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="local HF checkpoint directory")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    parser.add_argument("--generate", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="comma-separated request counts")
    parser.add_argument("--max-step", type=int, default=256, help="export's max step (tokens per forward)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell of the table; the best is kept")
    parser.add_argument("--pte", type=Path, help="run this exported file instead of exporting MODEL_DIR")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="compute dtype of both engines (and of the export)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated mlx-pte cache kinds")
    args = parser.parse_args()
    run(args)


def run(args: argparse.Namespace) -> None:
    """The benchmark for parsed ``args`` (gpu_decode.py calls this after installing MLX)."""
    batches = [int(b) for b in args.batches.split(",")]
    kinds = args.kinds.split(",")
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]

    from mlx_pte.interpreter.program import load

    if args.pte:
        program = load(args.pte)
    else:
        from mlx_pte.export.hf_export import export_hf

        with tempfile.TemporaryDirectory() as work:
            pte = export_hf(args.model_dir, Path(work) / "model.pte", dtype=args.dtype, max_step=args.max_step,
                            progress=False)
            program = load(pte)
    model = load_mlx_lm(args.model_dir, args.dtype)

    warm = prompts_for(2, 8, vocab)
    for kind in kinds:
        bench_engine(program, kind, warm, 4, args.dtype)
    bench_mlx_lm(model, warm, 4)

    runners = {kind: (lambda p, k=kind: bench_engine(program, k, p, args.generate, args.dtype)) for kind in kinds}
    runners["mlx-lm"] = lambda p: bench_mlx_lm(model, p, args.generate)
    rows = {}
    for b in batches:
        prompts = prompts_for(b, args.prompt, vocab)
        rows[b] = {}
        for name, run in runners.items():
            runs = [run(prompts) for _ in range(args.repeat)]
            rows[b][name] = Rates(max(r.decode_tps for r in runs), max(r.e2e_tps for r in runs))
        print(f"B={b} done", flush=True)

    print(f"\n{args.model_dir}: prompt {args.prompt}, generate {args.generate}, {args.dtype}, "
          f"device {mx.default_device()}, best of {args.repeat}")
    short = {"batched-cell": "cell", "batched-sequence": "sequence"}
    for title, pick in (("decode tok/s", lambda r: r.decode_tps), ("end-to-end tok/s", lambda r: r.e2e_tps)):
        print(f"\n{title}")
        print(f"{'B':>3} " + " ".join(f"{short[k]:>9}" for k in kinds) + f" {'mlx-lm':>9} "
              + " ".join(f"{short[k][:4] + '/lm':>8}" for k in kinds))
        for b, row in rows.items():
            lm = pick(row["mlx-lm"])
            print(f"{b:>3} " + " ".join(f"{pick(row[k]):>9.1f}" for k in kinds) + f" {lm:>9.1f} "
                  + " ".join(f"{pick(row[k]) / lm:>8.2f}" for k in kinds))


if __name__ == "__main__":
    main()
