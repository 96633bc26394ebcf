"""Peak memory and time of ``mlx-pte export`` (and of loading what it wrote), measured from
outside the process, on zero-weight checkpoints of real models' shapes.

    .venv/bin/python bench/export_memory.py                      # 1.2B bf16 and q4 (Llama-3.2-1B shape)
    .venv/bin/python bench/export_memory.py --shapes 1b 8b       # adds Llama-3.1-8B bf16 (16 GB of weights)
    .venv/bin/python bench/export_memory.py --shapes 135m --q4 135m --layers 2   # a quick smoke run
    .venv/bin/python bench/export_memory.py --baseline-python /other/checkout/.venv/bin/python

Each checkpoint is written on the fly into a temporary directory as a sparse safetensors
file (zeros cost no disk) and deleted afterwards; the export writes a real file of the
weights' size (twice that while it runs: its temporary weights file and the .pte), so the
8B case needs ~32 GB free. The export runs as a child process (``python -m mlx_pte
export``) whose resident set, children included, is polled with psutil every 20 ms;
``load`` is measured the same way in a child that loads the file, notes its RSS, runs one
forward and notes it again. With ``--baseline-python``, every case also runs under that
interpreter (another checkout's venv), for a before/after table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

GB = 1e9
_POLL_S = 0.02

SHAPES: dict[str, dict] = {
    # SmolLM2-135M (tied embeddings): the memory regression test's shape
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    # Llama-3.2-1B (1.24B parameters, tied embeddings)
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    # Llama-3.1-8B (8.03B parameters, untied head)
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip
_LLAMA_COMMON = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", bos_token_id=1, eos_token_id=2,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    torch_dtype="bfloat16",
)  # fmt: skip


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint of config ``c``, by its HF name."""
    hidden, ffn = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        }  # fmt: skip
    shapes["model.norm.weight"] = (hidden,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    return shapes


def write_zero_checkpoint(root: Path, shape: str, **overrides: object) -> dict[str, tuple[int, ...]]:
    """A bf16 checkpoint of ``shape`` (config fields ``overrides`` replaced) whose weights
    are all zero (a sparse file); returns its tensors' shapes."""
    config = {**_LLAMA_COMMON, **SHAPES[shape], **overrides}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    header, offset = {}, 0
    for name, dims in sorted(tensor_shapes(config).items()):
        size = 2 * _prod(dims)
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with (root / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # zeros, never written: no disk used
    _write_tokenizer(root)
    return tensor_shapes(config)


def weight_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(2 * _prod(d) for d in shapes.values())


def _prod(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _write_tokenizer(root: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 94 for c in range(97, 123)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(root)


@dataclass
class Measured:
    peak_rss: float  # bytes, the child and its children
    seconds: float
    output: str


def run_measured(cmd: list[str]) -> Measured:
    """Run ``cmd``; poll its resident set (children included) until it exits."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watched = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            procs = [watched, *watched.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in procs))
        except psutil.Error:
            pass
        time.sleep(_POLL_S)
    seconds = time.perf_counter() - start
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return Measured(peak, seconds, output)


_LOAD_SCRIPT = """
import sys, json, psutil
me = psutil.Process()
base = me.memory_info().rss
from mlx_pte.interpreter.program import load
import mlx.core as mx
before = me.memory_info().rss
program = load(sys.argv[1])
loaded = me.memory_info().rss
session = program.session(capacity=8)
mx.eval(session.forward([1, 2, 3]))
print(json.dumps({"imports": before, "loaded": loaded, "forward": me.memory_info().rss}))
"""


def measure(python: str, checkpoint: Path, out: Path, quantize: Optional[str], load: bool) -> dict:
    cmd = [python, "-m", "mlx_pte", "export", str(checkpoint), "-o", str(out), "--dtype", "bfloat16", "--no-progress"]
    if quantize:
        cmd += ["--quantize", quantize]
    export = run_measured(cmd)
    row = {"export_peak": export.peak_rss, "export_s": export.seconds, "size": out.stat().st_size}
    if load:
        loaded = run_measured([python, "-c", _LOAD_SCRIPT, str(out)])
        rss = json.loads(loaded.output.strip().splitlines()[-1])
        row |= {"load_peak": loaded.peak_rss, "load_added": rss["loaded"] - rss["imports"],
                "forward_added": rss["forward"] - rss["loaded"]}  # fmt: skip
    out.unlink()
    return row


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=["1b"])
    parser.add_argument("--q4", nargs="*", choices=tuple(SHAPES), default=["1b"],
                        help="shapes also exported with --quantize q4 (default: 1b; none when given no shape)")
    parser.add_argument("--layers", type=int, default=None, help="override each shape's layer count (a quick run)")
    parser.add_argument("--no-load", action="store_true", help="skip measuring load")
    parser.add_argument("--baseline-python", help="also run every case with this interpreter (another checkout)")
    parser.add_argument("--workdir", default=None, help="where the checkpoint and outputs go (default: a temp dir)")
    args = parser.parse_args(argv)
    pythons = [("now", sys.executable)] + ([("baseline", args.baseline_python)] if args.baseline_python else [])
    rows = []
    for shape in args.shapes:
        work = Path(tempfile.mkdtemp(prefix=f"export_memory_{shape}_", dir=args.workdir))
        try:
            overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
            weights = weight_bytes(write_zero_checkpoint(work / "ckpt", shape, **overrides))
            free = shutil.disk_usage(work).free
            if free < 2.2 * weights:
                raise SystemExit(f"{work} has {free / GB:.1f} GB free; the {shape} case needs {2.2 * weights / GB:.1f} GB")
            for quantize in [None] + (["q4"] if shape in args.q4 else []):
                for label, python in pythons:
                    row = measure(python, work / "ckpt", work / "out.pte", quantize, load=not args.no_load and shape != "8b")
                    rows.append({"shape": shape, "weights": weights, "type": quantize or "bf16", "run": label, **row})
                    print(_format(rows[-1]), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(_table(rows))
    return 0


def _format(row: dict) -> str:
    text = (f"{row['shape']:>3} {row['type']:>4} {row['run']:>8}: export peak {row['export_peak'] / GB:5.2f} GB "
            f"in {row['export_s']:6.1f} s, file {row['size'] / GB:5.2f} GB")  # fmt: skip
    if "load_peak" in row:
        text += (f"; load peak {row['load_peak'] / GB:5.2f} GB, load adds {row['load_added'] / GB:5.2f} GB, "
                 f"first forward adds {row['forward_added'] / GB:5.2f} GB")  # fmt: skip
    return text


def _table(rows: list[dict]) -> str:
    lines = ["| shape | weights | type | run | export peak RSS | export time | load peak RSS | load adds | forward adds |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        load = [f"{r[k] / GB:.2f} GB" if k in r else "-" for k in ("load_peak", "load_added", "forward_added")]
        lines.append(f"| {r['shape']} | {r['weights'] / GB:.2f} GB | {r['type']} | {r['run']} | "
                     f"{r['export_peak'] / GB:.2f} GB | {r['export_s']:.1f} s | " + " | ".join(load) + " |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
