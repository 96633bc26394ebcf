"""Tensor parallelism on this CPU: the 135M Llama shape on 1 rank and on 2 ranks (two local
processes over MLX's ring backend, ``mlx-pte bench --tp 2``), prefill and decode tok/s and
the bytes each rank hands to ``all_sum`` per token.

    .venv/bin/python bench/tp_cpu.py --make-model /tmp/llama135m_tp   # build + export once
    .venv/bin/python bench/tp_cpu.py --pte /tmp/llama135m_tp.pte       # reuse the export

SmolLM-135M's 9 query / 3 KV heads do not split over 2 ranks, so the checkpoint regroups
the same 576 features as 12 query / 4 KV heads of 48: every projection keeps its size
(q, o 576x576; k, v 576x192; gate, up, down 576x1536), random weights, 30 layers, fp32.
Two ranks on a 2-core machine share the cores one rank already uses, so expect no speedup
here: the figure states what splitting costs (two all_sums of 576 floats per layer per
token) on one host; multi-GPU runs are a separate measurement.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from decode import make_model

ROOT = Path(__file__).resolve().parents[1]
_RATES = re.compile(r"prefill ([\d.]+) tok/s \| decode ([\d.]+) tok/s")
_BYTES = re.compile(r"all-sums ([\d,]+) bytes per token")


def bench(pte: Path, ranks: int, prompt: int, generate: int, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "mlx_pte", "bench", str(pte), "--prompt-tokens", str(prompt),
           "--generate", str(generate), "--repeats", str(repeats)]
    if ranks > 1:
        cmd += ["--tp", str(ranks)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rates = _RATES.search(done.stdout)
    if rates is None:
        raise SystemExit(f"no rates in the output of {' '.join(cmd)}:\n{done.stdout}")
    sent = _BYTES.search(done.stdout)
    return {"prefill": float(rates[1]), "decode": float(rates[2]),
            "bytes": int(sent[1].replace(",", "")) if sent else 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--make-model", type=Path, metavar="DIR", help="write the checkpoint here, export DIR.pte")
    source.add_argument("--pte", type=Path, help="an exported .pte to run")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    pte = args.pte
    if args.make_model is not None:
        import torch  # noqa: F401  (before MLX loads its BLAS)

        from mlx_pte.export.hf_export import export_hf

        make_model(args.make_model, args.layers, heads=12, kv_heads=4)
        pte = export_hf(args.make_model, args.make_model.with_suffix(".pte"), dtype="float32", max_step=256)
    rows = {n: bench(pte, n, args.prompt, args.generate, args.repeats) for n in args.ranks}
    print(f"{pte}: prompt {args.prompt}, generate {args.generate}, median of {args.repeats}, CPU, fp32")
    print(f"{'ranks':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'all_sum bytes/token/rank':>25}")
    for n, r in rows.items():
        print(f"{n:>5} {r['prefill']:>14.1f} {r['decode']:>13.2f} {r['bytes']:>25,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
