"""Aggregate decode speed of the batching engine against mlx-lm's BatchGenerator, on one
checkpoint, in one process run.

    .venv/bin/python bench/batched.py MODEL_DIR [--prompt 64 --generate 64 --batches 1,2,4,8,16,32]
    python3 bench/batched.py MODEL_DIR --pte model.pte --dtype bfloat16 --kinds batched-sequence

For each B, B requests (distinct random prompts of --prompt tokens, new ones each round)
arrive at once and each generates --generate tokens greedily without stopping at eos,
computing in --dtype (float32 by default, as the CPU wants; bfloat16 on a GPU), on:
mlx-pte's Engine over each of --kinds (``batched-cell`` and ``batched-sequence``), and mlx-lm's
BatchGenerator. ``--pte`` runs an already exported file instead of exporting MODEL_DIR (where
no exporter is installed, e.g. the GPU machine: see gpu_decode.py).

One Engine per kind serves every B (its capacity fits the largest), warmed up
(``Engine.warm_up``, as ``serve`` does; the seconds are printed) before anything is timed, so
no compile bucket is traced inside a timed run. The engines run interleaved, ``--rounds``
times: each round runs every engine once, in turn, so drift in the machine's speed hits a
round's engines alike. Rates are medians over rounds; ratios are medians of the per-round
ratios (bench/rounds.py). Two rates per engine:

* decode tok/s: the engine's own decode accounting. mlx-pte: tokens of forwards that carry
  no prefill / their time; mlx-lm: ``BatchStats.generation_tps`` (generated tokens / time
  outside prompt processing).
* end-to-end tok/s: B x generate / wall time from submit to the last token (same for all).

Ratios are mlx-pte / mlx-lm (> 1: mlx-pte is faster), and sequence / cell when both kinds
run. ``--masked-decode`` adds, for each batched-sequence row, a twin whose decode steps
attend through the masked SDPA instead of the CUDA decode kernel
(``runtime/mlx/decode_attention.py``), and the ratio of the two. The engine overhead table
gives, per decode-only step, the host's time in ``Engine.step`` outside waiting for token
ids, the part of it spent launching the step (the forward's graph building and dispatch,
and the draws), and the step's time from dispatch to its tokens being read (the forward's).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (the export uses it: before the OpenBLAS loader, see runtime/mlx/blas.py)

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core: fast BLAS)
import mlx.core as mx
from rounds import median_ratio
from variants import load_mlx_lm

KINDS = ("batched-cell", "batched-sequence")


@dataclass(frozen=True)
class Rates:
    decode_tps: float
    e2e_tps: float
    # mlx-pte only: ms per decode-only step of host work, of its launch, and of the forward
    host_ms: Optional[float] = None
    launch_ms: Optional[float] = None
    forward_ms: Optional[float] = None


def prompts_for(batch: int, length: int, vocab: int, round_number: int = 0) -> list[list[int]]:
    rng = np.random.default_rng([batch, round_number])
    return rng.integers(0, vocab, (batch, length)).tolist()


def warmed_engine(program, kind: str, capacity: int, dtype: str, launch: Optional[str] = None):
    """An Engine of ``kind`` whose compile buckets are traced; prints the seconds it took."""
    from mlx_pte.serving.engine import Engine

    engine = Engine(program, kind, capacity=capacity, kv_dtype=dtype, launch=launch)
    print(f"{name_of(kind, launch)}: warmed up in {engine.warm_up():.1f} s", flush=True)
    return engine


def bench_engine(engine, prompts: list[list[int]], n: int) -> Rates:
    """One run of ``prompts`` on an idle ``engine``; rates from its stats over this run only."""
    from mlx_pte.serving.engine import Request

    before = dataclasses.replace(engine.stats)
    t0 = time.perf_counter()
    handles = [engine.submit(Request(p, max_tokens=n, ignore_eos=True)) for p in prompts]
    engine.run()
    wall = time.perf_counter() - t0
    assert all(len(h.result(timeout=0).samples[0].tokens) == n for h in handles)
    after = engine.stats
    steps = after.decode_steps - before.decode_steps
    seconds = after.decode_seconds - before.decode_seconds
    per_step = (lambda total: 1000 * total / steps) if steps else (lambda total: None)
    return Rates((after.decode_tokens - before.decode_tokens) / seconds if seconds else 0.0,
                 len(prompts) * n / wall,
                 per_step(after.decode_host_seconds - before.decode_host_seconds),
                 per_step(after.decode_launch_seconds - before.decode_launch_seconds),
                 per_step(seconds))


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
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds: each runs every engine once, in turn (default 5)")
    parser.add_argument("--pte", type=Path, help="run this exported file instead of exporting MODEL_DIR")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="compute dtype of both engines (and of the export)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated mlx-pte cache kinds")
    parser.add_argument("--launch", default=None, metavar="MODE,MODE",
                        help="mlx-pte launch modes (inline, thread), each a row of every kind; "
                             "default: the session's default for the device")
    parser.add_argument("--masked-decode", action="store_true",
                        help="also each batched-sequence row with the CUDA decode kernel off (masked SDPA)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown --kinds {', '.join(sorted(unknown))}; choose from {', '.join(KINDS)}")
    run(args)


def run(args: argparse.Namespace) -> None:
    """The benchmark for parsed ``args`` (gpu_decode.py calls this after installing MLX)."""
    batches = [int(b) for b in args.batches.split(",")]
    launches = args.launch.split(",") if args.launch else [None]
    variants = [(kind, launch) for kind in args.kinds.split(",") for launch in launches]
    kinds = [name_of(kind, launch) for kind, launch in variants]
    masked = [k + MASKED for k in kinds if args.masked_decode and k.startswith("batched-sequence")]
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

    capacity = max(batches) * (args.prompt + args.generate)
    engines = {name_of(kind, launch): warmed_engine(program, kind, capacity, args.dtype, launch)
               for kind, launch in variants}
    bench_mlx_lm(model, prompts_for(2, 8, vocab), 4)  # loads its kernels

    runners: dict[str, Callable[[list[list[int]]], Rates]] = {
        kind: (lambda p, e=engine: bench_engine(e, p, args.generate)) for kind, engine in engines.items()}
    for name in masked:
        runners[name] = lambda p, e=engines[name.removesuffix(MASKED)]: without_decode_kernel(
            lambda: bench_engine(e, p, args.generate))
    runners["mlx-lm"] = lambda p: bench_mlx_lm(model, p, args.generate)
    rows: dict[int, dict[str, list[Rates]]] = {}
    for b in batches:
        rows[b] = {name: [] for name in runners}
        for number in range(args.rounds):
            prompts = prompts_for(b, args.prompt, vocab, number)
            for name, bench in runners.items():
                rows[b][name].append(bench(prompts))
        print(f"B={b} done", flush=True)
    print_tables(args, kinds + masked, rows)


MASKED = "+masked"


def without_decode_kernel(bench: Callable[[], Rates]) -> Rates:
    """``bench()`` with batched decode attending through the masked SDPA."""
    from mlx_pte.runtime.mlx import decode_attention

    decode_attention.enabled = False
    try:
        return bench()
    finally:
        decode_attention.enabled = True


def short(name: str) -> str:
    """A row's column heading."""
    for long, brief in (("batched-sequence", "seq"), ("batched-cell", "cell"), ("+thread", "+t"), (MASKED, "+m")):
        name = name.replace(long, brief)
    return name


def name_of(kind: str, launch: Optional[str]) -> str:
    """An engine's row: its kind, marked when it launches on a thread."""
    return f"{kind}+thread" if launch == "thread" else kind


def print_tables(args: argparse.Namespace, kinds: list[str], rows: dict[int, dict[str, list[Rates]]]) -> None:
    print(f"\n{args.model_dir}: prompt {args.prompt}, generate {args.generate}, {args.dtype}, "
          f"device {mx.default_device()}; medians of {args.rounds} interleaved rounds, "
          f"ratios the medians of per-round ratios")
    pairs = [(k, "mlx-lm") for k in kinds]
    for mark in ("", "+thread"):  # the layouts against each other, launched alike
        if {"batched-sequence" + mark, "batched-cell" + mark} <= set(kinds):
            pairs.append(("batched-sequence" + mark, "batched-cell" + mark))
    pairs += [(k, k.removesuffix("+thread")) for k in kinds if k.endswith("+thread") and k.removesuffix("+thread") in kinds]
    pairs += [(k.removesuffix(MASKED), k) for k in kinds if k.endswith(MASKED)]
    label = {"mlx-lm": "lm", **{k: short(k) for k in kinds}}
    for title, pick in (("decode tok/s", lambda r: r.decode_tps), ("end-to-end tok/s", lambda r: r.e2e_tps)):
        print(f"\n{title}")
        print(f"{'B':>3} " + " ".join(f"{short(k):>9}" for k in kinds) + f" {'mlx-lm':>9} "
              + " ".join(f"{label[a] + '/' + label[b]:>11}" for a, b in pairs))
        for b, row in rows.items():
            print(f"{b:>3} " + " ".join(f"{statistics.median(map(pick, row[k])):>9.1f}" for k in kinds)
                  + f" {statistics.median(map(pick, row['mlx-lm'])):>9.1f} "
                  + " ".join(f"{median_ratio(row[a], row[b], pick):>11.2f}" for a, b in pairs))
    print("\nengine overhead, ms per decode-only step: host (step() outside waiting for tokens), "
          "of it launch, and forward (dispatch to tokens read)")
    print(f"{'B':>3} {'kind':>9} {'host':>8} {'launch':>8} {'forward':>8}")
    for b, row in rows.items():
        for k in kinds:
            cells = [[getattr(r, field) for r in row[k] if getattr(r, field) is not None]
                     for field in ("host_ms", "launch_ms", "forward_ms")]
            print(f"{b:>3} {short(k):>9} " + " ".join(
                f"{statistics.median(c):>8.2f}" if c else f"{'-':>8}" for c in cells))

if __name__ == "__main__":
    main()
