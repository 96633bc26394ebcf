"""Decode speed of mlx-pte against mlx-lm and HF eager on an NVIDIA GPU (MLX's CUDA backend),
in one process, on a Llama-3.2-1B-shaped model in bfloat16.

Runs on the device machine, whose Python has torch (CUDA) and transformers but no MLX:

    python3 bench/gpu_decode.py --pte out/gpu/llama1b.pte.gz --wheels out/gpu/whl \
        --hf-dir /root/stash/llama1b [--prompt 128 --generate 64] [--capture on|off|both]

Each .pte is exported elsewhere (where executorch is) from a checkpoint of the same shape with
all-zero weights (``mlx-pte export DIR -o q4.pte --dtype bfloat16 --quantize q4 --group-size 64``),
gzip-compressed so it can travel; speed does not depend on weight values (zeros quantize to
zero scales, but the kernels do the same work), so mlx-lm and HF eager read a same-shaped
checkpoint made here; mlx-lm's rows for q8/q4 quantize it in-process with
``mlx_lm.utils.quantize_model`` (what ``mlx_lm.convert -q`` does) at the same group size. ``--wheels DIR`` holds MLX's
CUDA wheel (whole, or split as cuda.part.NN) and the mlx, mlx-lm wheels, installed into
``--site``. Every engine decodes greedily from the same random prompt ids without stopping
at eos; prefill time covers the prompt's forward and the first token, decode time the rest.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from variants import bits_of, parse_pte, print_table, quantize_mlx_lm

REPO = Path(__file__).resolve().parents[1]
# The project's top-level folders map into the mlx_pte namespace (pyproject's package-dir).
SUBPACKAGES = ("schemas", "ir", "export", "interpreter", "runtime")
CUDA_WHEEL = "mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
    tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)


def install_mlx(wheels: Path, target: Path) -> None:
    """Reassemble MLX's split CUDA wheel and install every wheel in ``wheels`` into ``target``."""
    parts = sorted(wheels.glob("cuda.part.*"))
    if parts:
        with open(wheels / CUDA_WHEEL, "wb") as whole:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, whole)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--upgrade", "--target", str(target), *map(str, sorted(wheels.glob("*.whl")))],
        check=True,
    )
    # libmlx.so finds the CUDA libraries through RPATH $ORIGIN/../../nvidia/*/lib, i.e. next to
    # the install; point that at the nvidia-* packages torch already brings.
    nvidia = target / "nvidia"
    if not nvidia.exists():
        found = [Path(p) / "nvidia" for p in site.getsitepackages() if (Path(p) / "nvidia").is_dir()]
        if found:
            nvidia.symlink_to(found[0], target_is_directory=True)


def project_root(dest: Path) -> Path:
    """A folder holding ``mlx_pte`` laid out as installed (symlinks into this checkout)."""
    pkg = dest / "mlx_pte"
    if not pkg.exists():
        shutil.copytree(REPO / "mlx_pte", pkg)
        for name in SUBPACKAGES:
            (pkg / name).symlink_to(REPO / name, target_is_directory=True)
    return dest


def make_checkpoint(out: Path) -> Path:
    """A Llama-3.2-1B-shaped bf16 checkpoint with zero weights (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if (out / "config.json").exists():
        return out
    config = LlamaConfig(**LLAMA_1B)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffer was left empty
    model.eval().save_pretrained(out)
    tokenizer = REPO / "models" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


def gunzip(path: Path, work: Path) -> Path:
    if path.suffix != ".gz":
        return path
    out = work / path.stem
    with gzip.open(path, "rb") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    return out


def bench_mlx_pte(pte: Path, prompt: list[int], n: int, capacity: int, capture: bool) -> tuple[float, float]:
    from mlx_pte.interpreter import Session, generate, load

    program = load(pte)

    def run(ids, count):
        session = Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture)
        r = generate(session, ids, max_new_tokens=count, stop_on_eos=False)
        return r.prefill_tps, r.decode_tps

    run(prompt, n)  # warm-up: same shapes as the timed run (compiles every bucket once)
    before = program.compilations
    result = run(prompt, n)
    if program.compilations != before:
        print(f"warning: the timed run compiled {program.compilations - before} segments", flush=True)
    return result


def bench_mlx_pte_whole(pte: Path, prompt: list[int], n: int, capacity: int) -> tuple[float, float]:
    """The whole-step prototype (``bench/capture_modes.py``): one compiled function per step,
    fixed-size K/V buffers written at an array offset and read whole through an array mask."""
    from capture_modes import generate_whole  # bench/ is on sys.path: it holds this script

    from mlx_pte.interpreter import load

    program = load(pte)
    generate_whole(program, prompt, n, capacity)  # warm-up: compiles prefill and decode
    return generate_whole(program, prompt, n, capacity)


def profile_mlx_pte(pte: Path, prompt: list[int], n: int, capacity: int, top: int, capture: bool) -> None:
    """Where mlx-pte's decode time goes: building the lazy graph on the host versus inside
    ``mx.eval`` (kernel launches and the GPU's work), then cProfile's top entries."""
    import cProfile
    import pstats

    import mlx.core as mx
    from mlx_pte.interpreter import Session, generate, load

    program = load(pte)
    generate(Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture), prompt, max_new_tokens=n, stop_on_eos=False)
    in_eval = [0.0]
    real_eval = mx.eval

    def timed_eval(*arrays):
        t0 = time.perf_counter()
        real_eval(*arrays)
        in_eval[0] += time.perf_counter() - t0

    mx.eval = timed_eval
    try:
        r = generate(Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture), prompt, max_new_tokens=n,
                     stop_on_eos=False)
        # The prefill's eval is in in_eval too: take it out by timing a prefill alone.
        in_eval[0] = 0.0
        session = Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture)
        session.forward(prompt, rows=[len(prompt) - 1])
        prefill_eval = in_eval[0]
        in_eval[0] = 0.0
        r = generate(Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture), prompt, max_new_tokens=n,
                     stop_on_eos=False)
        decode_eval = in_eval[0] - prefill_eval
    finally:
        mx.eval = real_eval
    steps = len(r.tokens) - 1
    # Host time per decode step: building the step's graph (Session.forward, lazy) while
    # the device runs the previous one.
    in_forward = [0.0]
    real_forward = Session.forward

    def timed_forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_forward(self, *args, **kwargs)
        finally:
            in_forward[0] += time.perf_counter() - t0

    Session.forward = timed_forward
    try:
        session = Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture)
        session.forward(prompt, rows=[len(prompt) - 1])
        in_forward[0] = 0.0
        timed = generate(session, [1], max_new_tokens=n, stop_on_eos=False)
    finally:
        Session.forward = real_forward
    host = 1e3 * in_forward[0] / max(1, len(timed.tokens))
    print(f"\nmlx-pte (capture {'on' if capture else 'off'}): {len(program.steps)} graph steps per forward; "
          f"decode {1e3 * r.decode_seconds / steps:.2f} ms/token, of which ~{1e3 * decode_eval / steps:.2f} ms "
          f"in mx.eval; host {host:.2f} ms/step building the graph")
    profiler = cProfile.Profile()
    profiler.runcall(generate, Session(program, capacity=capacity, kv_dtype="bfloat16", capture=capture), prompt,
                     max_new_tokens=n, stop_on_eos=False)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def bench_mlx_lm(model_dir: Path, prompt: list[int], n: int, bits=None, group_size: int = 64) -> tuple[float, float]:
    import mlx.core as mx
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm_load(str(model_dir))
    model = quantize_mlx_lm(model, json.loads((model_dir / "config.json").read_text()), bits, group_size)

    def run(ids, count):
        t0 = time.perf_counter()
        first = t0
        for i, _ in zip(range(count), generate_step(mx.array(ids), model, max_tokens=count)):
            if i == 0:
                first = time.perf_counter()
        return len(ids) / (first - t0), (count - 1) / (time.perf_counter() - first)

    run(prompt, n)
    return run(prompt, n)


def bench_hf(model_dir: Path, prompt: list[int], n: int) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, local_files_only=True
    ).to("cuda").eval()

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
        return len(ids) / (t1 - t0), (count - 1) / (time.perf_counter() - t1)

    run(prompt, n)
    return run(prompt, n)


def bench_hf_static(model_dir: Path, prompt: list[int], n: int) -> tuple[float, float]:
    """HF ``generate`` with a static cache, which transformers compiles; decode rate from the
    difference between an n-token and a 1-token generation (prefill is not separable)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, local_files_only=True
    ).to("cuda").eval()
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
    return len(prompt) / one, (n - 1) / (full - one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pte", action="append", required=True, metavar="[LABEL=]PATH",
                        help=".pte or .pte.gz (all-zero weights do); LABEL bf16 (default), q8 or q4; repeatable")
    parser.add_argument("--group-size", type=int, default=64, help="mlx-lm's group size for q8/q4 (default 64)")
    parser.add_argument("--hf-dir", type=Path, required=True, help="same-shaped HF checkpoint; made if missing")
    parser.add_argument("--wheels", type=Path, help="MLX CUDA, mlx and mlx-lm wheels to install first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where wheels are installed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_decode"), help="scratch folder")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    parser.add_argument("--generate", type=int, default=64, help="tokens to generate")
    parser.add_argument("--capacity", type=int, default=1024, help="mlx-pte cache capacity")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print cProfile's top N entries of one mlx-pte generate")
    parser.add_argument("--skip", action="append", default=[], choices=["mlx-pte", "mlx-lm", "hf"])
    parser.add_argument("--capture", choices=["on", "off", "both"], default="both",
                        help="mlx-pte with capture (compiled segments), without (the walk), or both rows")
    parser.add_argument("--whole-step", action="store_true",
                        help="add a row for the whole-step capture prototype (bench/capture_modes.py)")
    args = parser.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        install_mlx(args.wheels, args.site)
    sys.path[:0] = [str(args.site), str(project_root(args.work / "src"))]
    model_dir = make_checkpoint(args.hf_dir)
    ptes = dict(parse_pte(arg, "bf16") for arg in args.pte)
    ptes = {label: gunzip(path, args.work) for label, path in ptes.items()}

    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core; a missing OpenBLAS only warns)
    import mlx.core as mx

    if args.batches:
        import batched  # bench/batched.py, beside this script

        batched.run(argparse.Namespace(
            model_dir=model_dir, pte=pte, dtype="bfloat16", kinds="batched-sequence", batches=args.batches,
            prompt=args.prompt, generate=args.generate, max_step=None, repeat=1,
        ))
        return
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()
    captures = {"on": [True], "off": [False], "both": [True, False]}[args.capture]
    engines = {("mlx-pte" if c else "mlx-pte-walk"): (lambda c=c: bench_mlx_pte(pte, prompt, args.generate,
                                                                                args.capacity, c))
               for c in captures}
    if args.whole_step:
        engines["mlx-pte-whole"] = lambda: bench_mlx_pte_whole(pte, prompt, args.generate, args.capacity)
    engines |= {"mlx-lm": lambda: bench_mlx_lm(model_dir, prompt, args.generate),
               "hf": lambda: bench_hf(model_dir, prompt, args.generate)}
    rows = {}
    for name, bench in engines.items():
        if not name.startswith(tuple(args.skip)):
            rows[name] = bench()
            print(f"{name}: prefill {rows[name][0]:.1f} tok/s, decode {rows[name][1]:.2f} tok/s", flush=True)

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(f"\n{model_dir.name}: prompt {args.prompt}, generate {args.generate}, bfloat16, "
          f"MLX {mx.__version__} on {mx.default_device()}, torch {torch.__version__} on {gpu}")
    print(f"{'engine':<12} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill x':>10} {'decode x':>9}")
    base = rows.get("mlx-pte", rows.get("mlx-pte-walk"))
    for name, (p, d) in rows.items():
        ratio = f"{base[0] / p:>10.2f} {base[1] / d:>9.2f}" if base else ""
        print(f"{name:<12} {p:>14.1f} {d:>13.2f} {ratio}")
    print("(x = mlx-pte speed, captured where it ran, / engine speed)")
    if args.profile:
        for capture in captures:
            print(f"\n-- profile, capture {'on' if capture else 'off'}")
            profile_mlx_pte(pte, prompt, args.generate, args.capacity, args.profile, capture)


if __name__ == "__main__":
    main()
