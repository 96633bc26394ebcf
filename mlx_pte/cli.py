"""The ``mlx-pte`` command line.

Each subcommand is one setup function registered with ``@command``: it adds its
arguments to the parser it is given and returns the handler that runs it. Handlers import
heavy dependencies (torch, mlx) themselves, so ``mlx-pte inspect`` starts quickly.
Errors the user can act on print one ``error: ...`` line and exit with status 1, never a
traceback (set MLX_PTE_DEBUG=1 to see it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from typing import Callable, Optional, Sequence

from mlx_pte.export.errors import ExportError
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import ScalarType, SymDim, TensorType
from mlx_pte.ir.layers import layer_counts
from mlx_pte.ir.manifest import CacheLayerSpec
from mlx_pte.ir.payload import Payload
from mlx_pte.ir.pte import read_pte
from mlx_pte.runtime.cache import KINDS, CacheError

Handler = Callable[[argparse.Namespace], int]
Setup = Callable[[argparse.ArgumentParser], Handler]

# name -> (one-line help, setup), in registration order
COMMANDS: dict[str, tuple[str, Setup]] = {}


def command(name: str, help: str) -> Callable[[Setup], Setup]:
    """Register ``setup`` as the subcommand ``name``."""

    def register(setup: Setup) -> Setup:
        COMMANDS[name] = (help, setup)
        return setup

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-pte", description="Export Hugging Face causal LMs to .pte files and run them on MLX."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, setup) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=setup(sub))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (FormatError, OSError, ValueError, CacheError, ExportError) as exc:
        if os.environ.get("MLX_PTE_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


# -- inspect --------------------------------------------------------------------------


@command("inspect", "print a .pte file's manifest, ops, inputs/outputs, sizes and cache geometry")
def inspect_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("model", help="the .pte file")

    def run(args: argparse.Namespace) -> int:
        payload = read_pte(args.model)
        print(f"{args.model}: {os.path.getsize(args.model):,} bytes")
        print("\n".join(describe(payload)))
        return 0

    return run


def describe(payload: Payload) -> list[str]:
    """The inspect report of a decoded payload, as lines."""
    graph = payload.graph
    kinds = Counter(slot.kind.value for slot in graph.slots)
    weight_bytes = sum(c.nbytes for c in payload.constants.values())
    lines = [
        f"graph: {len(graph.slots)} slots ({kinds['input']} inputs, {kinds['constant']} constants, "
        f"{kinds['temp']} temps), {len(graph.instructions)} instructions",
        layer_counts(graph).summary(),
        f"weights: {len(payload.constants)} constants, {weight_bytes:,} bytes",
    ]
    for title, slots in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        lines.append(f"{title}:")
        lines += _table([(graph.slots[s].name, _type_name(graph.slots[s].type)) for s in slots])
    shapes = [slot.type.shape for slot in graph.slots if isinstance(slot.type, TensorType)]
    dims = sorted({d for shape in shapes for d in shape if isinstance(d, SymDim)}, key=lambda d: d.name)
    if dims:
        lines.append("dynamic dims:")
        lines += _table([(d.name, f"[{d.min}, {'unbounded)' if d.max is None else f'{d.max}]'}") for d in dims])
    ops = Counter(instr.op for instr in graph.instructions)
    lines.append("ops:")
    lines += _table([(op, str(n)) for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))])
    cache = payload.manifest.get("cache")
    if isinstance(cache, list) and all(isinstance(layer, dict) for layer in cache):
        names = [f.name for f in dataclasses.fields(CacheLayerSpec)]
        lines.append("cache geometry:")
        rows = [(str(i), *(str(layer.get(n)) for n in names)) for i, layer in enumerate(cache)]
        lines += _table([("cache_id", *names), *rows])
    shown = dict(payload.manifest)
    if isinstance(shown.get("tokenizer"), str):
        shown["tokenizer"] = f"<tokenizer.json: {len(shown['tokenizer']):,} characters>"
    lines.append("manifest:")
    lines += ["  " + line for line in json.dumps(shown, indent=2, ensure_ascii=False).splitlines()]
    return lines


def _type_name(t: TensorType | ScalarType) -> str:
    if not isinstance(t, TensorType):
        return t.kind
    return f"{t.dtype}[{', '.join(d.name if isinstance(d, SymDim) else str(d) for d in t.shape)}]"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as left-aligned columns, indented two spaces."""
    if not rows:
        return ["  (none)"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


# -- export -----------------------------------------------------------------------------


@command("export", "export a local Hugging Face checkpoint directory to a .pte file")
def export_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("model_dir", help="local checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("-o", "--output", required=True, help="the .pte file to write")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="dtype of weights and activations (default float32; MLX on CPU is fastest in float32)",
    )
    parser.add_argument(
        "--max-step", type=int, default=256,
        help="most tokens one forward takes (prefill chunk size); default 256",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")

    def run(args: argparse.Namespace) -> int:
        quiet_export_dependencies()
        from mlx_pte.export.hf_export import export_hf

        out = export_hf(args.model_dir, args.output, dtype=args.dtype, max_step=args.max_step,
                        progress=not args.no_progress)
        print(f"wrote {out} ({os.path.getsize(out):,} bytes)")
        return 0

    return run


def quiet_export_dependencies() -> None:
    """Silence start-up chatter of torch/torchao that says nothing about the user's export."""
    import logging
    import warnings

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


# -- run --------------------------------------------------------------------------------


def add_cache_arguments(parser: argparse.ArgumentParser, default_kind: Optional[str], capacity: bool = True) -> None:
    shown = default_kind or "single for --prompt, batched-sequence for --prompts"
    parser.add_argument(
        "--cache", default=default_kind, choices=KINDS,
        help=f"KV-cache layout (default: {shown}): single = one sequence; batched-cell = one "
        "pool of cells shared by all sequences; batched-sequence = a private history per sequence",
    )
    if capacity:
        parser.add_argument(
            "--capacity", type=int, default=None,
            help="cache capacity: positions (single), cells (batched-cell) or total positions "
            "(batched-sequence); default: the model's max context",
        )
    parser.add_argument(
        "--kv-dtype", default=None, choices=("float32", "bfloat16", "float16"),
        help="K/V storage dtype (default: the model's dtype)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this mass")
    parser.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling")


def sampling_from(args: argparse.Namespace):
    from mlx_pte.interpreter.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def default_model_pte() -> str:
    """The bundled default model (models/default), exported once next to it."""
    from pathlib import Path

    model_dir = Path(__file__).resolve().parents[1] / "models" / "default"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError("no model given and no bundled models/default found; pass a .pte file")
    pte = model_dir.parent / "default.pte"
    if not pte.is_file() or pte.stat().st_mtime < (model_dir / "model.safetensors").stat().st_mtime:
        quiet_export_dependencies()
        from mlx_pte.export.hf_export import export_hf

        print(f"exporting the bundled model {model_dir} to {pte} ...", file=sys.stderr)
        export_hf(model_dir, pte, dtype="float32", max_step=256, progress=True)
    return str(pte)


@command("run", "generate text from a .pte file")
def run_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("model", nargs="?", help="the .pte file (default: the bundled models/default)")
    parser.add_argument("--prompt", help="the prompt text")
    parser.add_argument("--prompts", metavar="FILE", help="a file of prompts (one per line, or JSONL) served together")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    add_cache_arguments(parser, None, capacity=False)
    from mlx_pte.interpreter.server import add_batching_arguments

    add_batching_arguments(parser)
    add_sampling_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        if (args.prompt is None) == (args.prompts is None):
            raise ValueError("give exactly one of --prompt TEXT or --prompts FILE")
        args.model = args.model or default_model_pte()
        if args.prompts:
            from mlx_pte.interpreter.prompts_file import run_prompts_main

            return run_prompts_main(args)
        from mlx_pte.interpreter.generation import generate
        from mlx_pte.interpreter.program import load
        from mlx_pte.interpreter.session import Session
        from mlx_pte.interpreter.text import TextCodec

        session = Session(load(args.model), kind=args.cache or "single", capacity=args.capacity,
                          kv_dtype=args.kv_dtype, max_seqs=args.max_seqs)
        prompt = args.prompt
        if args.chat:
            prompt = TextCodec(session.manifest).render_chat([{"role": "user", "content": prompt}])
        echo = [args.prompt if not args.chat else ""]

        def show(piece: str) -> None:
            # The prompt is echoed once generation has started, so a refused prompt prints nothing.
            sys.stdout.write(echo.pop() + piece if echo else piece)
            sys.stdout.flush()

        result = generate(session, prompt, max_new_tokens=args.max_new_tokens, sampling=sampling_from(args),
                          on_text=show)
        print()
        print(
            f"prefill: {result.prompt_tokens} tokens, {result.prefill_tps:.1f} tok/s | "
            f"decode: {len(result.tokens)} tokens, {result.decode_tps:.1f} tok/s | stop: {result.finish_reason}",
            file=sys.stderr,
        )
        return 0

    return run


# -- serve ------------------------------------------------------------------------------


@command("serve", "serve a .pte file over an OpenAI-compatible HTTP API (completions, chat, streaming)")
def serve_command(parser: argparse.ArgumentParser) -> Handler:
    from mlx_pte.interpreter.server import add_serve_arguments, serve_main

    add_serve_arguments(parser)
    return serve_main


# -- bench ------------------------------------------------------------------------------


@command("bench", "measure prefill and decode speed and peak memory of a .pte file")
def bench_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("model", help="the .pte file")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    parser.add_argument("--generate", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (default 3)")
    add_cache_arguments(parser, "single")

    def run(args: argparse.Namespace) -> int:
        import statistics

        import numpy as np

        from mlx_pte.interpreter.generation import generate
        from mlx_pte.interpreter.program import load
        from mlx_pte.interpreter.session import Session
        import mlx.core as mx

        program = load(args.model)
        vocab = int(program.manifest["vocab_size"])
        prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_tokens).tolist()

        def once(n_prompt: int, n_new: int):
            session = Session(program, kind=args.cache, capacity=args.capacity, kv_dtype=args.kv_dtype)
            return generate(session, prompt[:n_prompt], max_new_tokens=n_new, stop_on_eos=False)

        once(min(8, len(prompt)), 4)
        mx.reset_peak_memory()
        runs = [once(len(prompt), args.generate) for _ in range(max(1, args.repeats))]
        prefill = statistics.median(r.prefill_tps for r in runs)
        decode = statistics.median(r.decode_tps for r in runs)
        print(f"{args.model}: cache {args.cache}, prompt {args.prompt_tokens}, generate {args.generate}, "
              f"median of {len(runs)}, device {mx.default_device()}")
        print(f"  prefill {prefill:.1f} tok/s | decode {decode:.2f} tok/s | "
              f"peak memory {mx.get_peak_memory() / 2**20:.1f} MiB")
        return 0

    return run
