"""Decode speed of mlx-pte against mlx-lm and HF on an NVIDIA GPU (MLX's CUDA backend), in
one process, on a Llama-3.2-1B-shaped model in bfloat16.

Runs on the device machine, whose Python has torch (CUDA) and transformers but no MLX:

    python3 bench/gpu_decode.py --pte .gpu/llama1b-bf16.pte.gz --wheels .whl \
        --hf-dir /root/stash/llama1b [--prompt 128 --generate 64] [--capture on|off|both]
    # bf16 vs q8 vs q4 (group 64), mlx-pte against mlx-lm quantized the same way:
    python3 bench/gpu_decode.py --pte bf16=.gpu/llama1b-bf16.pte.gz --pte q8=.gpu/llama1b-q8.pte.gz \
        --pte q4=.gpu/llama1b-q4.pte.gz --group-size 64 --skip hf --skip hf-static --wheels .whl \
        --hf-dir /root/stash/llama1b
    # aggregate decode of B concurrent requests (bench/batched.py), batched-sequence (and with
    # --kinds batched-sequence,batched-cell also batched-cell) vs mlx-lm, --rounds interleaved:
    python3 bench/gpu_decode.py --pte .gpu/llama1b-bf16.pte.gz --wheels .whl --hf-dir /root/stash/llama1b \
        --batches 1,8,32,64

Each .pte is exported elsewhere (where executorch is) from a checkpoint of the same shape with
all-zero weights (``mlx-pte export DIR -o q4.pte --dtype bfloat16 --quantize q4 --group-size 64``),
gzip-compressed so it can travel; speed does not depend on weight values (zeros quantize to
zero scales, but the kernels do the same work), so mlx-lm and HF read a same-shaped
checkpoint made here; mlx-lm's rows for q8/q4 quantize it in-process with
``mlx_lm.utils.quantize_model`` (what ``mlx_lm.convert -q`` does) at the same group size.
``--wheels DIR`` holds MLX's CUDA wheel (whole, or split as cuda.part.NN) and the mlx, mlx-lm
wheels, installed into ``--site``; with it, MLX must then run on the GPU or the script stops.

Rows: mlx-pte captured (``mlx-pte``) and walked (``mlx-pte-walk``) per ``--capture``, both
launched inline (a GPU's default is the launcher thread: ``--threaded``'s ``mlx-pte-thread``), the
whole-step prototype (``--whole-step``), mlx-lm, HF eager (a loop of forwards with its
dynamic cache) and HF static (``generate`` with a static cache, which transformers
compiles). Every engine decodes greedily from the same random prompt ids without stopping
at eos; prefill time covers the prompt's forward and the first token, decode time the rest.
The mlx-pte and mlx-lm rows run interleaved, ``--rounds`` times (default 5; each round runs
every engine once, in turn): the table gives the medians of their rates and, below it, the
median of the per-round ratios, the figure that survives the device's drift (bench/rounds.py).
HF rows run once, after the rounds. mlx-pte rows also give the decode step's host ms (building its lazy graph) and device ms
(``mx.eval`` of it with nothing else in flight): see bench/step_split.py.

``--pte-env KEY=VALUE`` times mlx-pte under an MLX setting read once per process (say
``MLX_USE_CUDA_GRAPHS=0``): it is set in this process before MLX loads, and the mlx-lm rows
then run in a process of their own (bench/peer_process.py) with the environment as it was,
still interleaved round by round.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from decode_table import Key, Rates, print_table
from gpu_setup import add_device_arguments, check_mlx_device, gunzip, install_mlx, make_checkpoint, project_root
from peer_process import PeerProcess, serve
from rounds import median_rates, print_round_ratios, run_rounds
from step_split import host_device_ms
from variants import FULL_PRECISION, bits_of, load_mlx_lm, parse_pte

Runner = Callable[[], Rates]  # one timed run of an engine, warmed up already


def mlx_pte_runner(program, prompt: list[int], n: int, capacity: int, capture: bool,
                   launch: str = "inline") -> Runner:
    from mlx_pte import Session, generate

    def session():
        return Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture, launch=launch)

    generate(session(), prompt, max_new_tokens=n, stop_on_eos=False)  # warm-up: compiles every bucket once

    def run() -> Rates:
        before = program.compilations
        r = generate(session(), prompt, max_new_tokens=n, stop_on_eos=False)
        timing = session()
        host, device = host_device_ms(lambda t: timing.forward(t, evaluate=False), prompt, n - 1, timing.max_step)
        if program.compilations != before:
            print(f"warning: the timed run compiled {program.compilations - before} segments", flush=True)
        return Rates(r.prefill_tps, r.decode_tps, host, device)

    return run


def mlx_pte_whole_runner(program, prompt: list[int], n: int, capacity: int) -> Runner:
    """The whole-step prototype (``bench/capture_modes.py``): one compiled function per step,
    fixed-size K/V buffers written at an array offset and read whole through an array mask."""
    from capture_modes import WholeStep, generate_whole

    generate_whole(program, prompt, n, capacity)  # warm-up: compiles prefill and decode

    def run() -> Rates:
        prefill, decode = generate_whole(program, prompt, n, capacity)
        host, device = host_device_ms(WholeStep(program, capacity).forward, prompt, n - 1, len(prompt))
        return Rates(prefill, decode, host, device)

    return run


def profile_mlx_pte(program, prompt: list[int], n: int, capacity: int, top: int, capture: bool) -> None:
    """cProfile's top ``top`` entries (by own time) of one mlx-pte generate."""
    import cProfile
    import pstats

    from mlx_pte import Session, generate

    def run():
        session = Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture)
        generate(session, prompt, max_new_tokens=n, stop_on_eos=False)

    run()  # warm-up: compiles
    profiler = cProfile.Profile()
    profiler.runcall(run)
    print(f"\n-- cProfile of one mlx-pte generate, capture {'on' if capture else 'off'} "
          f"({len(program.steps)} graph steps per forward)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def mlx_lm_runner(model_dir: Path, prompt: list[int], n: int, bits, group_size: int) -> Runner:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model = load_mlx_lm(model_dir, "bfloat16", bits, group_size)

    def run() -> Rates:
        t0 = time.perf_counter()
        first = t0
        for i, _ in zip(range(n), generate_step(mx.array(prompt), model, max_tokens=n)):
            if i == 0:
                first = time.perf_counter()
        return Rates(len(prompt) / (first - t0), (n - 1) / (time.perf_counter() - first))

    run()  # warm-up
    return run


def load_hf_cuda(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        raise SystemExit("error: the HF rows need CUDA, which torch does not see; leave them out with "
                         "--skip hf --skip hf-static")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).to("cuda").eval()


def bench_hf(model_dir: Path, prompt: list[int], n: int) -> Rates:
    import torch

    model = load_hf_cuda(model_dir)

    @torch.no_grad()
    def run(ids, count):
        t0 = time.perf_counter()
        out = model(torch.tensor([ids], device="cuda"), use_cache=True)
        token = int(out.logits[0, -1].argmax())  # int() waits for the GPU
        t1 = time.perf_counter()
        past = out.past_key_values
        for _ in range(count - 1):
            out = model(torch.tensor([[token]], device="cuda"), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        return Rates(len(ids) / (t1 - t0), (count - 1) / (time.perf_counter() - t1))

    run(prompt, n)
    return run(prompt, n)


def bench_hf_static(model_dir: Path, prompt: list[int], n: int) -> Rates:
    """HF ``generate`` with a static cache, which transformers compiles; decode rate from the
    difference between an n-token and a 1-token generation (prefill is not separable)."""
    import torch

    model = load_hf_cuda(model_dir)
    ids = torch.tensor([prompt], device="cuda")

    def timed(count: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False,
                       cache_implementation="static")
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for count in (n, 1):  # warm-up: compiles both shapes
        timed(count)
    one, full = timed(1), timed(n)
    return Rates(len(prompt) / one, (n - 1) / (full - one))


def run_batched(args: argparse.Namespace, model_dir: Path, ptes: dict[str, Path]) -> None:
    """bench/batched.py's tables on the bf16 .pte and this checkpoint: ``--kinds`` vs mlx-lm's
    BatchGenerator, both in bfloat16, interleaved ``--rounds`` times."""
    import batched  # bench/batched.py, beside this script

    if "bf16" not in ptes:
        raise SystemExit(f"error: --batches runs the bf16 export; give it as --pte bf16=PATH "
                         f"(given: {', '.join(ptes)})")
    batched.run(argparse.Namespace(
        model_dir=model_dir, pte=ptes["bf16"], dtype="bfloat16", kinds=args.kinds, batches=args.batches,
        prompt=args.prompt, generate=args.generate, max_step=None, rounds=args.rounds, launch=args.launch,
        masked_decode=args.masked_decode,
    ))


def load_without_rotary_pairs(pte: Path):
    """The program as loaded before ``ir/rotary_pairs.py``: q and k rotated by a rope each."""
    from mlx_pte.interpreter import program as program_module

    rewrite = program_module.rotate_heads_together
    program_module.rotate_heads_together = lambda graph: graph
    try:
        return program_module.load(pte)
    finally:
        program_module.rotate_heads_together = rewrite


def load_with_vector_linears(pte: Path):
    """The program with ``linear`` as it ran before its one-node GPU form: one row as
    ``weight @ x`` (MLX wraps the vector in an expand_dims and a squeeze) between two
    reshapes, more rows as ``x @ weight.T``."""
    from mlx_pte.interpreter import handlers, program as program_module

    def vector_linear(args, attrs, ctx):
        x, weight, bias = args
        if x.ndim and x.size == x.shape[-1]:
            out = (weight @ x.reshape(-1)).reshape(*x.shape[:-1], weight.shape[0])
        else:
            out = x @ weight.T
        return out if bias is None else out + bias

    handler = handlers.HANDLERS["linear"]
    handlers.HANDLERS["linear"] = vector_linear
    try:
        return program_module.load(pte)
    finally:
        handlers.HANDLERS["linear"] = handler


def gemv_settings_runner(pte: Path, prompt: list[int], n: int, capacity: int, **settings) -> Runner:
    """mlx-pte on a launcher thread with ``runtime/mlx/gemv.py``'s module settings changed
    while it loads and warms up (``enabled=False``: MLX's ops for one-row linears and the
    norms and GLUs before them; ``norm_enabled=False``: the fused norms only;
    ``glu_enabled=False``: the fused GLUs only; ``tiling=Tiling(...)``):
    a program of its own, whose segments are compiled (at warm-up) that way."""
    from mlx_pte import load
    from mlx_pte.runtime.mlx import gemv

    were = {name: getattr(gemv, name) for name in settings}
    for name, value in settings.items():
        setattr(gemv, name, value)
    try:
        return mlx_pte_runner(load(pte), prompt, n, capacity, True, "thread")
    finally:
        for name, value in were.items():
            setattr(gemv, name, value)


def parse_tiling(text: str) -> tuple[int, ...]:
    """``WARPS,ROWS,UNROLL[,SPLIT]`` (say ``4,2,4`` or ``16,1,4,4``) as positive integers."""
    parts = text.split(",")
    if len(parts) not in (3, 4) or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"a tiling is WARPS,ROWS,UNROLL[,SPLIT] (positive integers), got {text!r}")
    return tuple(int(part) for part in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pte", action="append", required=True, metavar="[LABEL=]PATH",
                        help=".pte or .pte.gz (all-zero weights do); LABEL bf16 (default), q8 or q4; repeatable")
    add_device_arguments(parser)
    parser.add_argument("--generate", type=int, default=64, help="tokens to generate (at least 2)")
    parser.add_argument("--capacity", type=int, help="mlx-pte cache capacity and the whole step's buffer size "
                                                     "(default: prompt + generate)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds: each runs every engine once, in turn (default 5)")
    parser.add_argument("--capture", choices=["on", "off", "both"], default="both",
                        help="mlx-pte with capture (compiled segments), without (the walk), or both rows")
    parser.add_argument("--whole-step", action="store_true",
                        help="add a row for the whole-step capture prototype (bench/capture_modes.py)")
    parser.add_argument("--threaded", action="store_true",
                        help="add a row for mlx-pte captured with launch='thread' (mlx-pte-thread)")
    parser.add_argument("--separate-rope", action="store_true",
                        help="add a row for mlx-pte captured with q and k rotated by a rope each (mlx-pte-rope2), "
                             "as before ir/rotary_pairs.py")
    parser.add_argument("--vector-linear", action="store_true",
                        help="add a row for mlx-pte on a launcher thread with linear as it ran before its "
                             "one-node GPU form (mlx-pte-vec; load_with_vector_linears)")
    parser.add_argument("--mlx-gemv", action="store_true",
                        help="with MLX_PTE_GEMV=1 (runtime/mlx/gemv.py's kernels on): add rows for mlx-pte on a "
                             "launcher thread with MLX's ops for one-row linears and the norms before them "
                             "(mlx-pte-mlxgemv), and with the kernels but not their fused norm (mlx-pte-nonorm) or "
                             "their fused GLU (mlx-pte-noglu)")
    parser.add_argument("--gemv-tiling", action="append", default=[], type=parse_tiling, metavar="W,R,U[,S]",
                        help="with MLX_PTE_GEMV=1: add a row for mlx-pte on a launcher thread with the kernels laid "
                             "out W warps a block, R rows a group of S warps (default 1), U loads unrolled "
                             "(mlx-pte-tWxRxU[xS]; repeatable)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print cProfile's top N entries of one mlx-pte generate (first --pte), per capture")
    parser.add_argument("--skip", action="append", default=[], choices=["mlx-pte", "mlx-lm", "hf", "hf-static"])
    parser.add_argument("--batches", metavar="B,B,...",
                        help="instead: aggregate decode of B concurrent requests, batched-sequence vs mlx-lm's "
                             "BatchGenerator (bench/batched.py on the bf16 .pte and the checkpoint)")
    parser.add_argument("--launch", default=None, metavar="MODE,MODE",
                        help="with --batches: mlx-pte launch modes (inline, thread), a row each")
    parser.add_argument("--masked-decode", action="store_true",
                        help="with --batches: also each batched-sequence row with the CUDA decode kernel off")
    parser.add_argument("--pte-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an MLX setting for mlx-pte only (repeatable): mlx-lm then runs in a process of its "
                             "own, without it")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="add a row for mlx-pte from another checkout (e.g. before a change; mlx-pte-base), "
                             "captured on a launcher thread, in a process of its own, interleaved with the rest")
    parser.add_argument("--serve-mlx-lm", metavar="LABEL", help=argparse.SUPPRESS)  # a --pte-env run's child
    parser.add_argument("--serve-baseline", metavar="LABEL", help=argparse.SUPPRESS)  # a --baseline run's child
    parser.add_argument("--kinds", default="batched-sequence", metavar="KIND,KIND",
                        help="with --batches: mlx-pte cache kinds (batched-sequence, batched-cell; both also "
                             "print sequence / cell ratios)")
    args = parser.parse_args()
    if args.generate < 2:
        parser.error("--generate must be at least 2 (decode speed needs a token after the first)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if (args.mlx_gemv or args.gemv_tiling) and os.environ.get("MLX_PTE_GEMV") != "1":
        parser.error("--mlx-gemv and --gemv-tiling time runtime/mlx/gemv.py's kernels: run with MLX_PTE_GEMV=1")
    labelled = [parse_pte(arg, "bf16") for arg in args.pte]
    if len({label for label, _ in labelled}) != len(labelled):
        parser.error("each --pte needs its own LABEL")
    capacity = args.capacity or args.prompt + args.generate
    settings = dict(setting.partition("=")[::2] for setting in args.pte_env)
    if any(not key or not value for key, value in settings.items()):
        parser.error(f"--pte-env takes KEY=VALUE, got {' '.join(args.pte_env)}")
    if settings and args.batches:
        parser.error("--pte-env times generate() against mlx-lm's generate_step; it does not apply to --batches")
    environment = dict(os.environ)  # the mlx-lm process's, without the settings
    if not args.serve_mlx_lm:
        os.environ.update(settings)  # before MLX loads: it reads them once

    args.work.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        install_mlx(args.wheels, args.site)
    source = project_root(args.work / "baseline", args.baseline) if args.serve_baseline else project_root(
        args.work / "src")
    sys.path[:0] = [str(args.site), str(source)]
    model_dir = make_checkpoint(args.hf_dir)  # imports torch, before MLX (as this script always ran)
    ptes = {label: gunzip(path, args.work) for label, path in labelled}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()
    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core; a missing OpenBLAS only warns)
    import mlx.core as mx

    if args.serve_mlx_lm:  # the BLAS aside, nothing of mlx-pte's runs in this process
        check_mlx_device(args.wheels is not None)
        serve(lambda: mlx_lm_runner(model_dir, prompt, args.generate, bits_of(args.serve_mlx_lm), args.group_size))
        return

    device = check_mlx_device(args.wheels is not None)
    if args.batches:
        run_batched(args, model_dir, ptes)
        return
    from mlx_pte import load

    if args.serve_baseline:  # this process imported the other checkout's mlx_pte
        serve(lambda: mlx_pte_runner(load(ptes[args.serve_baseline]), prompt, args.generate, capacity, True,
                                     "thread"))
        return

    captures = {"on": [True], "off": [False], "both": [True, False]}[args.capture]
    runners: dict[Key, Runner] = {}
    for label, pte in ptes.items():
        if "mlx-pte" not in args.skip:
            program = load(pte)
            for capture in captures:
                runners["mlx-pte" if capture else "mlx-pte-walk", label] = mlx_pte_runner(
                    program, prompt, args.generate, capacity, capture)
            if args.threaded:
                runners["mlx-pte-thread", label] = mlx_pte_runner(
                    program, prompt, args.generate, capacity, True, "thread")
            if args.whole_step:
                runners["mlx-pte-whole", label] = mlx_pte_whole_runner(program, prompt, args.generate, capacity)
            if args.vector_linear:
                runners["mlx-pte-vec", label] = mlx_pte_runner(
                    load_with_vector_linears(pte), prompt, args.generate, capacity, True, "thread")
            if args.mlx_gemv:  # bf16 and 4-bit affine linears alike
                for row, switch in (("mlx-pte-mlxgemv", "enabled"), ("mlx-pte-nonorm", "norm_enabled"),
                                    ("mlx-pte-noglu", "glu_enabled")):
                    runners[row, label] = gemv_settings_runner(pte, prompt, args.generate, capacity,
                                                               **{switch: False})
            for sizes in args.gemv_tiling:
                from mlx_pte.runtime.mlx.gemv import Tiling

                runners[f"mlx-pte-t{'x'.join(map(str, sizes))}", label] = gemv_settings_runner(
                    pte, prompt, args.generate, capacity, tiling=Tiling(*sizes))
            if args.baseline:
                runners["mlx-pte-base", label] = PeerProcess(
                    [__file__, *sys.argv[1:], "--serve-baseline", label], os.environ)
            if args.separate_rope:
                runners["mlx-pte-rope2", label] = mlx_pte_runner(
                    load_without_rotary_pairs(pte), prompt, args.generate, capacity, True)
        if "mlx-lm" not in args.skip and settings:
            runners["mlx-lm", label] = PeerProcess([__file__, *sys.argv[1:], "--serve-mlx-lm", label], environment)
        elif "mlx-lm" not in args.skip:
            runners["mlx-lm", label] = mlx_lm_runner(model_dir, prompt, args.generate, bits_of(label),
                                                     args.group_size)
    rounds = run_rounds(runners, args.rounds)
    for runner in runners.values():
        if isinstance(runner, PeerProcess):
            runner.close()
    rows = {key: median_rates(per_round) for key, per_round in rounds.items()}
    full = next((label for label in ptes if label in FULL_PRECISION), "bf16")
    if "hf" not in args.skip:
        rows["hf-eager", full] = bench_hf(model_dir, prompt, args.generate)
    if "hf-static" not in args.skip:
        rows["hf-static", full] = bench_hf_static(model_dir, prompt, args.generate)

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    if settings:
        print(f"mlx-pte rows under {' '.join(args.pte_env)}; mlx-lm in a process of its own without")
    print_table(f"{model_dir.name}: prompt {args.prompt}, generate {args.generate}, bfloat16 activations, "
                f"groups of {args.group_size}, mlx-pte capacity {capacity}, MLX {mx.__version__} on {device}, "
                f"torch {torch.__version__} on {gpu}; medians of {args.rounds} interleaved rounds", rows)
    print_round_ratios(rounds)
    if args.profile and "mlx-pte" not in args.skip:
        program = load(next(iter(ptes.values())))
        for capture in captures:
            profile_mlx_pte(program, prompt, args.generate, capacity, args.profile, capture)


if __name__ == "__main__":
    main()
