"""Where a decode token's time goes on the GPU: CUPTI through ``torch.profiler``, which
records every CUDA kernel in the process (MLX's included), for mlx-pte and mlx-lm in one
run, on the same Llama-3.2-1B-shaped checkpoint and exports as bench/gpu_decode.py.

    python3 bench/gpu_profile.py --pte bf16=.gpu/llama1b-bf16.pte.gz --pte q4=.gpu/llama1b-q4.pte.gz \
        --wheels .whl --hf-dir /root/stash/llama1b [--prompt 128 --generate 64 --top 12]

Per decode token: kernels launched, kernel ms (sum of kernel durations), wall ms (under
the profiler, which inflates it), the busy fraction (kernel / wall) and the top kernels
by time; and the nodes of one decode step's lazy graph by primitive (what MLX's evaluation
walks and encodes: views included, which launch no kernel). Prefill is taken out by profiling a generation of 1 token and one of
``--generate + 1`` with the same prompt and dividing the difference by ``--generate``.

With ``--batch B`` (> 1), B requests of distinct prompts decode together instead: mlx-pte's
Engine over ``--kind`` (launched per ``--launch``; ``--masked-decode`` turns the CUDA decode
kernel off) against mlx-lm's BatchGenerator (bench/batched.py's runs), and the figures are per
decode step (one token of every request).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from gpu_setup import add_device_arguments, check_mlx_device, gunzip, install_mlx, make_checkpoint, project_root
from variants import bits_of, load_mlx_lm, parse_pte


@dataclass
class Profile:
    """Kernel launches and microseconds by kernel name, and wall seconds, of one run."""

    counts: Counter = field(default_factory=Counter)
    micros: Counter = field(default_factory=Counter)
    wall: float = 0.0


def profiled(run: Callable[[], None]) -> Profile:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # The kernels are the device-side events; MLX launches them, so no torch op is their parent.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    out = Profile(wall=wall)
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or event.name.startswith(("Memcpy", "Memset")):
            continue
        out.counts[event.name] += 1
        out.micros[event.name] += event.time_range.elapsed_us()
    return out


def per_token(make_run: Callable[[int], Callable[[], None]], n: int, top: int, title: str) -> None:
    """Print the decode-token figures from the difference of an (n+1)- and a 1-token run."""
    short_run, long_run = make_run(1), make_run(n + 1)
    short_run(), long_run()  # warm-up: compiles, JITs, fills MLX's graph caches
    short, long = profiled(short_run), profiled(long_run)
    counts, micros = long.counts - short.counts, long.micros - short.micros
    kernels = sum(counts.values()) / n
    kernel_ms = sum(micros.values()) / n / 1e3
    wall_ms = (long.wall - short.wall) / n * 1e3
    if not long.counts:
        print(f"warning: {title}: the profiler recorded no CUDA kernels (is CUPTI available?)", flush=True)
    print(f"\n{title}: {kernels:.0f} kernels/token, kernel {kernel_ms:.3f} ms/token, wall {wall_ms:.3f} ms/token "
          f"(profiled), busy {kernel_ms / wall_ms:.0%}", flush=True)
    print(f"  {'kernel':<72} {'per tok':>7} {'ms/tok':>7} {'share':>6}")
    for name, us in micros.most_common(top):
        print(f"  {name[:72]:<72} {counts[name] / n:>7.1f} {us / n / 1e3:>7.3f} {us / max(sum(micros.values()), 1):>6.0%}")


def graph_nodes(outputs, title: str, top: int) -> None:
    """Print the primitives of the lazy graph behind ``outputs`` (``mx.export_to_dot``)."""
    import re
    import tempfile

    import mlx.core as mx

    with tempfile.TemporaryDirectory() as work:
        dot = Path(work) / "step.dot"
        mx.export_to_dot(str(dot), outputs)
        names = Counter(re.findall(r'label ="([A-Za-z_0-9]+)', dot.read_text()))
    print(f"\n{title}: {sum(names.values())} graph nodes in one decode step; by primitive: "
          + ", ".join(f"{name} {count}" for name, count in names.most_common(top)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pte", action="append", required=True, metavar="[LABEL=]PATH",
                        help=".pte or .pte.gz; LABEL bf16 (default), q8 or q4; repeatable")
    add_device_arguments(parser)
    parser.add_argument("--generate", type=int, default=64, help="decode tokens profiled (at least 1)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per engine")
    parser.add_argument("--capture", choices=["on", "off", "both"], default="on", help="mlx-pte's capture")
    parser.add_argument("--skip", action="append", default=[], choices=["mlx-pte", "mlx-lm"])
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1: generate())")
    parser.add_argument("--kind", default="batched-sequence", choices=["batched-sequence", "batched-cell"],
                        help="with --batch: the engine's cache kind")
    parser.add_argument("--launch", choices=["inline", "thread"],
                        help="with --batch: where the engine launches its steps (default: the device's)")
    parser.add_argument("--masked-decode", action="store_true",
                        help="with --batch: decode through the masked SDPA, the CUDA decode kernel off")
    args = parser.parse_args()
    if args.generate < 1:
        parser.error("--generate must be at least 1")
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    labelled = [parse_pte(arg, "bf16") for arg in args.pte]
    args.work.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        install_mlx(args.wheels, args.site)
    sys.path[:0] = [str(args.site), str(project_root(args.work / "src"))]
    model_dir = make_checkpoint(args.hf_dir)  # imports torch before MLX
    ptes = {label: gunzip(path, args.work) for label, path in labelled}

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: the profile needs CUDA, which torch does not see")
    import mlx_pte.runtime.mlx.blas  # noqa: F401
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_pte import Session, generate, load

    device = check_mlx_device(args.wheels is not None)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()
    capacity = args.prompt + args.generate + 1
    print(f"MLX {mx.__version__} on {device}, torch {torch.__version__} on {torch.cuda.get_device_name()}; "
          f"prompt {args.prompt}, {args.generate} decode tokens profiled, batch {args.batch}")
    if args.batch > 1:
        profile_batch(args, ptes, model_dir, vocab)
        return
    for label, pte in ptes.items():
        if "mlx-pte" not in args.skip:
            program = load(pte)
            for capture in {"on": [True], "off": [False], "both": [True, False]}[args.capture]:
                def pte_run(count: int, capture=capture) -> Callable[[], None]:
                    return lambda: generate(Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture),
                                            prompt, max_new_tokens=count, stop_on_eos=False)

                per_token(pte_run, args.generate, args.top, f"mlx-pte {label} capture {'on' if capture else 'off'}")
                session = Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture, launch="inline")
                session.forward(prompt)
                graph_nodes(session.forward([prompt[0]], evaluate=False), f"mlx-pte {label} capture "
                            f"{'on' if capture else 'off'}", args.top)
            del program
        if "mlx-lm" not in args.skip:
            model = load_mlx_lm(model_dir, "bfloat16", bits_of(label), args.group_size)

            def lm_run(count: int) -> Callable[[], None]:
                def run() -> None:
                    for _ in zip(range(count), generate_step(mx.array(prompt), model, max_tokens=count)):
                        pass
                return run

            per_token(lm_run, args.generate, args.top, f"mlx-lm {label}")
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([prompt]), cache=cache))
            graph_nodes(model(mx.array([[prompt[0]]]), cache=cache), f"mlx-lm {label}", args.top)
            del model


def profile_batch(args: argparse.Namespace, ptes: dict[str, Path], model_dir: Path, vocab: int) -> None:
    """Per decode step of ``--batch`` requests: the engine against mlx-lm's BatchGenerator."""
    from batched import bench_engine, bench_mlx_lm, prompts_for, warmed_engine, without_decode_kernel
    from mlx_pte import load

    prompts = prompts_for(args.batch, args.prompt, vocab)
    masked = " masked" if args.masked_decode else ""
    for label, pte in ptes.items():
        if "mlx-pte" not in args.skip:
            engine = warmed_engine(load(pte), args.kind, args.batch * (args.prompt + args.generate + 1), "bfloat16",
                                   args.launch)

            def engine_run(count: int) -> Callable[[], None]:
                run = lambda: bench_engine(engine, prompts, count)  # noqa: E731
                return (lambda: without_decode_kernel(run)) if args.masked_decode else run

            per_token(engine_run, args.generate, args.top,
                      f"mlx-pte {label} {args.kind}{masked} launched {args.launch or 'by default'}, B={args.batch}, per step")
            del engine
        if "mlx-lm" not in args.skip:
            model = load_mlx_lm(model_dir, "bfloat16", bits_of(label), args.group_size)
            per_token(lambda count: lambda: bench_mlx_lm(model, prompts, count), args.generate, args.top,
                      f"mlx-lm {label} BatchGenerator, B={args.batch}, per step")
            del model


if __name__ == "__main__":
    main()
