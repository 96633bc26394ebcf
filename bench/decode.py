"""Prefill and decode speed of mlx-pte against mlx-lm and HF eager, on one checkpoint, in
one run of this script.

    .venv/bin/python bench/decode.py MODEL_DIR [--prompt 128 --generate 64]
    .venv/bin/python bench/decode.py --make-model /tmp/llama135m   # a 135M Llama-shaped
                                                                  # checkpoint, random weights
    # fp32 vs q8 vs q4 (group 64), mlx-pte against mlx-lm quantized the same way:
    .venv/bin/python bench/decode.py MODEL_DIR --quantize q8 --quantize q4 --group-size 64 --skip hf
    # ... reusing .pte files already exported from MODEL_DIR:
    .venv/bin/python bench/decode.py MODEL_DIR --pte fp32=fp32.pte --pte q8=q8.pte --pte q4=q4.pte

Every engine decodes greedily from the same random prompt ids without stopping at eos,
computing in float32. Prefill time covers the prompt's forward(s) and the first token;
decode time covers the remaining tokens. mlx-lm's q8/q4 rows quantize its float32 model
in-process with ``mlx_lm.utils.quantize_model`` (what ``mlx_lm.convert -q`` does).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core: fast BLAS)
import mlx.core as mx
from variants import QUANTIZED, bits_of, parse_pte, print_table, quantize_mlx_lm


def make_model(out: Path) -> Path:
    """A SmolLM-135M-shaped Llama checkpoint with random weights (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import shutil

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=10000.0,
    )
    LlamaForCausalLM(config).eval().save_pretrained(out)
    # Any tokenizer does for timing; the bundled model's ids all lie inside this vocab.
    bundled = Path(__file__).resolve().parents[1] / "models" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(bundled / name, out / name)
    return out


def bench_mlx_pte(model_dir: Path, prompt: list[int], n: int, work: Path, captures: list[bool]) -> dict:
    from mlx_pte.export.hf_export import export_hf
    from mlx_pte.ir.quantization import QuantSpec

    spec = None if bits is None else QuantSpec("affine", bits, group_size)
    return export_hf(model_dir, out, dtype="float32", max_step=256, progress=False, quantize=spec)


def bench_mlx_pte(pte: Path, prompt: list[int], n: int) -> tuple[float, float]:
    from mlx_pte.interpreter import load
    from mlx_pte.interpreter.generation import generate
    from mlx_pte.interpreter.session import Session

    program = load(pte)
    rows = {}
    for capture in captures:
        # Warm-up with the timed run's shapes: capture compiles each shape bucket once.
        generate(Session(program, capture=capture), prompt, max_new_tokens=4, stop_on_eos=False)
        result = generate(Session(program, capture=capture), prompt, max_new_tokens=n, stop_on_eos=False)
        rows["mlx-pte" if capture else "mlx-pte-walk"] = (result.prefill_tps, result.decode_tps)
    return rows


def bench_mlx_lm(model_dir: Path, prompt: list[int], n: int, bits=None, group_size: int = 64) -> tuple[float, float]:
    import json

    from mlx.utils import tree_map
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm_load(str(model_dir))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    model = quantize_mlx_lm(model, json.loads((model_dir / "config.json").read_text()), bits, group_size)

    def run(ids, count):
        t0 = time.perf_counter()
        first = None
        for i, (token, _) in zip(range(count), generate_step(mx.array(ids), model, max_tokens=count)):
            if i == 0:
                first = time.perf_counter()
        return first - t0, time.perf_counter() - first

    run(prompt[:8], 4)
    prefill, decode = run(prompt, n)
    return len(prompt) / prefill, (n - 1) / decode


def bench_hf(model_dir: Path, prompt: list[int], n: int) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()

    @torch.no_grad()
    def run(ids, count):
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        token = int(out.logits[0, -1].argmax())
        t1 = time.perf_counter()
        past = out.past_key_values
        for _ in range(count - 1):
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        return t1 - t0, time.perf_counter() - t1

    run(prompt[:8], 4)
    prefill, decode = run(prompt, n)
    return len(prompt) / prefill, (n - 1) / decode


ENGINES = {"mlx-pte": bench_mlx_pte, "mlx-lm": bench_mlx_lm, "hf-eager": bench_hf}


def run_engine(name: str, model_dir: Path, prompt: list[int], n: int) -> tuple[float, float]:
    """(prefill, decode) tok/s of one engine, measured in a fresh process."""
    job = json.dumps({"engine": name, "model_dir": str(model_dir), "prompt": prompt, "generate": n})
    out = subprocess.run([sys.executable, __file__, "--engine-job", job], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: {name} failed:\n{out.stderr[-3000:]}")
    prefill, decode = json.loads(out.stdout.strip().splitlines()[-1])
    return prefill, decode


def engine_job(spec: str) -> None:
    job = json.loads(spec)
    rates = ENGINES[job["engine"]](Path(job["model_dir"]), job["prompt"], job["generate"])
    print(json.dumps(rates))


def mlx_device() -> str:
    code = "import mlx_pte.runtime.mlx.blas, mlx.core as mx; print(mx.default_device())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--engine-job":
        engine_job(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", type=Path, help="local HF checkpoint directory")
    parser.add_argument("--make-model", type=Path, help="write a 135M Llama-shaped checkpoint here and use it")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    parser.add_argument("--generate", type=int, default=64, help="tokens to generate")
    parser.add_argument("--skip", action="append", default=[], choices=["mlx-lm", "hf"], help="leave a peer out")
    parser.add_argument("--capture", choices=["on", "off", "both"], default="on",
                        help="mlx-pte with capture (compiled segments), without (the walk), or both rows")
    args = parser.parse_args()
    model_dir = make_model(args.make_model) if args.make_model else args.model_dir
    if model_dir is None:
        parser.error("give MODEL_DIR or --make-model DIR")

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()

    given = dict(parse_pte(arg, "fp32") for arg in args.pte)
    labels = list(dict.fromkeys(["fp32", *given, *args.quantize]))
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        captures = {"on": [True], "off": [False], "both": [True, False]}[args.capture]
        rows.update(bench_mlx_pte(model_dir, prompt, args.generate, Path(work), captures))
    if "mlx-lm" not in args.skip:
        rows["mlx-lm"] = bench_mlx_lm(model_dir, prompt, args.generate)
    if "hf" not in args.skip:
        rows["hf-eager"] = bench_hf(model_dir, prompt, args.generate)

    print(f"\n{model_dir}: prompt {args.prompt}, generate {args.generate}, float32, device {mx.default_device()}")
    print(f"{'engine':<12} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill x':>10} {'decode x':>9}")
    base_p, base_d = next(iter(rows.values()))
    for name, (p, d) in rows.items():
        print(f"{name:<12} {p:>14.1f} {d:>13.2f} {base_p / p:>10.2f} {base_d / d:>9.2f}")
    print("(x = the first mlx-pte row's speed / engine speed)")


if __name__ == "__main__":
    main()
