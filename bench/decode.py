"""Prefill and decode speed of mlx-pte against mlx-lm and HF eager on the CPU, on one
checkpoint, in one run of this script.

    .venv/bin/python bench/decode.py MODEL_DIR [--prompt 128 --generate 64]
    .venv/bin/python bench/decode.py --make-model /tmp/llama135m   # a 135M Llama-shaped
                                                                  # checkpoint, random weights
    # fp32 vs q8 vs q4 (group 64), mlx-pte against mlx-lm quantized the same way:
    .venv/bin/python bench/decode.py MODEL_DIR --quantize q8 --quantize q4 --group-size 64 --skip hf
    # ... reusing .pte files already exported from MODEL_DIR:
    .venv/bin/python bench/decode.py MODEL_DIR --pte fp32=fp32.pte --pte q8=q8.pte --pte q4=q4.pte
    # mlx-pte captured (compiled segments) and walked op by op:
    .venv/bin/python bench/decode.py MODEL_DIR --capture both

Every engine decodes greedily from the same random prompt ids without stopping at eos,
computing in float32. Prefill time covers the prompt's forward(s) and the first token;
decode time covers the remaining tokens. mlx-lm's q8/q4 rows quantize its float32 model
in-process with ``mlx_lm.utils.quantize_model`` (what ``mlx_lm.convert -q`` does).

Each export and each timed row runs in its own process, importing only what it needs, so
none is slowed by another's libraries (HF eager by the OpenBLAS that MLX loads: see
mlx_pte/runtime/mlx/blas.py; a process that uses torch imports it first).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from decode_table import Key, Rates, print_table
from rounds import median_rates, print_round_ratios, run_rounds
from variants import QUANTIZED, bits_of, parse_pte

FULL = "fp32"  # this bench's full-precision label
CAPTURES = {"on": [True], "off": [False], "both": [True, False]}


def make_model(out: Path, layers: int, heads: int = 9, kv_heads: int = 3) -> Path:
    """A SmolLM-135M-shaped Llama checkpoint (``layers`` layers) with random weights (no download).
    ``heads`` / ``kv_heads`` regroup the same 576 features (bench/tp_cpu.py: 12 / 4, which two
    ranks divide, with the same projection sizes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=576 // heads, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=10000.0,
    )
    LlamaForCausalLM(config).eval().save_pretrained(out)
    # Any tokenizer does for timing; the bundled model's ids all lie inside this vocab.
    bundled = Path(__file__).resolve().parents[1] / "models" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(bundled / name, out / name)
    return out


# --- jobs: each runs in a fresh process (``--engine-job``) and returns JSON --------------


def export_job(job: dict) -> str:
    import torch  # noqa: F401  (the export uses it: before the OpenBLAS loader)

    from mlx_pte.export.hf_export import export_hf
    from mlx_pte.ir.quantization import QuantSpec

    bits = job["bits"]
    spec = None if bits is None else QuantSpec("affine", bits, job["group_size"])
    return str(export_hf(Path(job["model_dir"]), Path(job["out"]), dtype="float32", max_step=256,
                         progress=False, quantize=spec))


def mlx_pte_job(job: dict) -> dict:
    from mlx_pte import Session, generate, load
    from step_split import host_device_ms

    program = load(Path(job["pte"]))
    prompt, n, capture, launch = job["prompt"], job["generate"], job["capture"], job["launch"]
    # Warm-up with the timed run's shapes: capture compiles each shape bucket once.
    generate(Session(program, capture=capture, launch=launch), prompt, max_new_tokens=4, stop_on_eos=False)
    result = generate(Session(program, capture=capture, launch=launch), prompt, max_new_tokens=n,
                      stop_on_eos=False)
    session = Session(program, capture=capture)
    host, device = host_device_ms(lambda t: session.forward(t, evaluate=False), prompt, n - 1, session.max_step)
    return asdict(Rates(result.prefill_tps, result.decode_tps, host, device))


def mlx_lm_job(job: dict) -> dict:
    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core: fast BLAS)
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from variants import load_mlx_lm

    prompt, n = job["prompt"], job["generate"]
    model = load_mlx_lm(Path(job["model_dir"]), "float32", job["bits"], job["group_size"])

    def run(ids, count):
        t0 = time.perf_counter()
        first = t0
        for i, _ in zip(range(count), generate_step(mx.array(ids), model, max_tokens=count)):
            if i == 0:
                first = time.perf_counter()
        return first - t0, time.perf_counter() - first

    run(prompt[:8], 4)
    prefill, decode = run(prompt, n)
    return asdict(Rates(len(prompt) / prefill, (n - 1) / decode))


def hf_job(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    prompt, n = job["prompt"], job["generate"]
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32, local_files_only=True).eval()

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
    return asdict(Rates(len(prompt) / prefill, (n - 1) / decode))


def device_job(job: dict) -> str:
    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core: fast BLAS)
    import mlx.core as mx

    return str(mx.default_device())


JOBS = {"export": export_job, "mlx-pte": mlx_pte_job, "mlx-lm": mlx_lm_job, "hf-eager": hf_job,
        "device": device_job}


def run_job(kind: str, **job: Any) -> Any:
    """The result of job ``kind``, run in a fresh process of this script."""
    spec = json.dumps({"kind": kind, **job})
    out = subprocess.run([sys.executable, __file__, "--engine-job", spec], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: the {kind} job failed ({job.get('label', '')}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_job(spec: str) -> None:
    job = json.loads(spec)
    print(json.dumps(JOBS[job["kind"]](job)))


# --- the run ------------------------------------------------------------------------------


def timed(row: str, kind: str, label: str, **job: Any) -> Rates:
    rates = Rates(**run_job(kind, label=label, **job))
    print(f"{row} {label}: prefill {rates.prefill_tps:.1f} tok/s, decode {rates.decode_tps:.2f} tok/s", flush=True)
    return rates


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--engine-job":
        engine_job(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", type=Path, help="local HF checkpoint directory")
    parser.add_argument("--make-model", type=Path, metavar="DIR",
                        help="write a 135M Llama-shaped checkpoint (random weights) here and use it")
    parser.add_argument("--layers", type=int, default=30, help="layers of --make-model's checkpoint (default 30)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    parser.add_argument("--generate", type=int, default=64, help="tokens to generate (at least 2)")
    parser.add_argument("--skip", action="append", default=[], choices=["mlx-lm", "hf"], help="leave a peer out")
    parser.add_argument("--quantize", action="append", default=[], choices=tuple(QUANTIZED),
                        help="also run this quantized variant (repeatable); fp32 always runs")
    parser.add_argument("--group-size", type=int, default=64, help="group size of --quantize (default 64)")
    parser.add_argument("--pte", action="append", default=[], metavar="[LABEL=]PATH",
                        help="use this .pte (exported from MODEL_DIR) for variant LABEL (default fp32) "
                             "instead of exporting")
    parser.add_argument("--capture", choices=tuple(CAPTURES), default="on",
                        help="mlx-pte with capture (compiled segments), without (the walk), or both rows")
    parser.add_argument("--launch", default="inline", metavar="MODE[,MODE]",
                        help="mlx-pte launch modes (inline, thread), a row each (default inline)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds, each timing every row once in turn; medians and per-round ratios")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if (args.model_dir is None) == (args.make_model is None):
        parser.error("give MODEL_DIR or --make-model DIR")
    if args.generate < 2:
        parser.error("--generate must be at least 2 (decode speed needs a token after the first)")
    given = dict(parse_pte(arg, FULL) for arg in args.pte)
    for label, path in given.items():
        if not path.is_file():
            parser.error(f"--pte {label}={path}: no such file")
    model_dir = make_model(args.make_model, args.layers) if args.make_model else args.model_dir
    if not (model_dir / "config.json").is_file():
        parser.error(f"{model_dir} has no config.json: give a Hugging Face checkpoint directory")

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()
    common = dict(prompt=prompt, generate=args.generate)
    labels = list(dict.fromkeys([FULL, *given, *args.quantize]))
    runners: dict[Key, Callable[[], Rates]] = {}
    with tempfile.TemporaryDirectory() as work:
        for label in labels:
            bits: Optional[int] = bits_of(label)
            pte = given.get(label) or Path(run_job("export", label=label, model_dir=str(model_dir), bits=bits,
                                                   group_size=args.group_size, out=f"{work}/{label}.pte"))
            print(f"mlx-pte {label}: {pte.stat().st_size:,} bytes", flush=True)
            for capture in CAPTURES[args.capture]:
                for launch in args.launch.split(","):
                    engine = ("mlx-pte" if capture else "mlx-pte-walk") + ("-thread" if launch == "thread" else "")
                    runners[engine, label] = partial(timed, engine, "mlx-pte", label, pte=str(pte), capture=capture,
                                                     launch=launch, **common)
            if "mlx-lm" not in args.skip:
                runners["mlx-lm", label] = partial(timed, "mlx-lm", "mlx-lm", label, model_dir=str(model_dir),
                                                   bits=bits, group_size=args.group_size, **common)
        if "hf" not in args.skip:
            runners["hf-eager", FULL] = partial(timed, "hf-eager", "hf-eager", FULL, model_dir=str(model_dir),
                                                **common)
        rounds = run_rounds(runners, args.rounds)
    rows = {key: median_rates(per_round) for key, per_round in rounds.items()}
    print_table(f"{model_dir}: prompt {args.prompt}, generate {args.generate}, float32 activations, "
                f"groups of {args.group_size}, device {run_job('device')}, one process per row"
                + (f", medians of {args.rounds} interleaved rounds" if args.rounds > 1 else ""), rows)
    if args.rounds > 1:
        print_round_ratios(rounds)


if __name__ == "__main__":
    main()
