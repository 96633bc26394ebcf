"""The ``mlx-pte`` command line.

Each subcommand is one setup function registered with ``@command``: it adds its
arguments to the parser it is given and returns the handler that runs it. Handlers import
heavy dependencies (torch, mlx) themselves, so ``mlx-pte inspect`` starts quickly.
Errors the user can act on print one ``error: ...`` line and exit with status 1 (a usage
mistake: 2; a reader that closes the pipe early: 141, silently), never a
traceback (set MLX_PTE_DEBUG=1 to see it).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from mlx_pte.export.errors import ExportError
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.quantization import PRESETS, QuantSpec
from mlx_pte.ir.pte import read_pte
from mlx_pte.runtime.cache import KIND_BATCHED_SEQUENCE, KINDS, CacheError
from mlx_pte.serving.engine import DEFAULT_CAPACITY_CONTEXTS

from mlx_pte.serving.parallel import ranks as tensor_parallel

from .report import describe, quantization_report
from .arguments import (
    add_batching_arguments,
    add_launch_argument,
    add_max_step_argument,
    add_cache_arguments,
    add_sampling_arguments,
    add_serve_arguments,
    add_template_budget_argument,
    add_tokenizer_argument,
    positive_int,
)

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


class _Parser(argparse.ArgumentParser):
    """Usage mistakes, like every other error, are one ``error:`` line (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# Arguments that are text for the model (not paths, which may be any bytes).
TEXT_ARGUMENTS = ("prompt",)


def _check_text_arguments(args: argparse.Namespace) -> None:
    """Text the OS handed over as undecodable bytes (kept as lone surrogates) is refused."""
    for name in TEXT_ARGUMENTS:
        value = getattr(args, name, None)
        try:
            value is None or value.encode("utf-8")
        except UnicodeEncodeError:
            raw = value.encode("utf-8", "surrogateescape")[:40]
            raise ValueError(f"--{name} is not valid UTF-8 text (it starts {raw!r}); pass UTF-8") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mlx-pte", description="Export Hugging Face causal LMs to .pte files and run them on MLX."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, setup) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=setup(sub))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # ``--tp N`` starts the same command line in each rank
    try:
        _check_text_arguments(args)
        return args.handler(args)
    except BrokenPipeError:
        # The reader went away (``mlx-pte inspect FILE | head``): stop quietly, as cat does.
        # stdout's buffer is unwritable now, so point it at /dev/null for the exit-time flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
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
    add_tokenizer_argument(parser)

    def run(args: argparse.Namespace) -> int:
        payload = read_pte(args.model)
        if args.tokenizer is not None:
            from mlx_pte.interpreter.tokenizer_dir import tokenizer_fields

            payload.manifest.update(tokenizer_fields(args.tokenizer))
        print(f"{args.model}: {os.path.getsize(args.model):,} bytes")
        print("\n".join(describe(payload)))
        return 0

    return run


# -- export -----------------------------------------------------------------------------


@command("export", "export a local Hugging Face checkpoint directory to a .pte file")
def export_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("model_dir", help="local checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument(
        "-o", "--output", required=True,
        help="the .pte file to write, in an existing directory; a directory (existing, or written with a "
        "trailing /) means DIR/<model_dir name>.pte. Written whole or not at all, mode 0666 less the umask",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="dtype of weights and activations (default float32; MLX on CPU is fastest in float32)",
    )
    parser.add_argument(
        "--max-step", type=int, default=None,
        help="most tokens one forward of the program may take (the traced bound; the prefill chunk is "
        "chosen at run time within it, see run --max-step); default: the model's context, at most 8192",
    )
    parser.add_argument(
        "--quantize", choices=tuple(PRESETS), default=None,
        help="quantize linear and embedding weights: q4 / q8 (affine, MLX's packing), mxfp4, nvfp4; "
        "a weight whose rows do not divide into groups stays full precision (listed after export)",
    )
    parser.add_argument(
        "--group-size", type=int, default=None,
        help="elements per quantization group: 32, 64 (default) or 128 for q4/q8; mxfp4 uses 32, nvfp4 16",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")

    def run(args: argparse.Namespace) -> int:
        if args.group_size is not None and args.quantize is None:
            raise ValueError("--group-size needs --quantize")
        quantize = None if args.quantize is None else QuantSpec.from_preset(args.quantize, args.group_size)
        quiet_export_dependencies()
        from mlx_pte.export.hf_export import export_hf

        out = export_hf(args.model_dir, args.output, dtype=args.dtype, max_step=args.max_step,
                        progress=not args.no_progress, quantize=quantize)
        print(f"wrote {out} ({os.path.getsize(out):,} bytes)")
        if quantize is not None:
            print("\n".join(quantization_report(read_pte(out), per_tensor=False)))
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


def sampling_from(args: argparse.Namespace):
    from mlx_pte.serving.sampling.params import SamplingParams

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
        export_hf(model_dir, pte, dtype="float32", progress=True)
    return str(pte)


@command("run", "generate text from a .pte file")
def run_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("model", nargs="?", help="the .pte file (default: the bundled models/default)")
    parser.add_argument("--prompt", help="the prompt text")
    parser.add_argument("--prompts", metavar="FILE", help="a file of prompts (one per line, or JSONL) served together")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128,
                        help="most tokens to generate, at least 1 (default 128)")
    add_cache_arguments(parser, KINDS, None, "single for --prompt, batched-sequence for --prompts",
                        f"the model's max context with --prompt, {DEFAULT_CAPACITY_CONTEXTS} x it with --prompts")
    add_tokenizer_argument(parser)
    add_template_budget_argument(parser)
    add_batching_arguments(parser)
    add_max_step_argument(parser)
    add_launch_argument(parser)
    add_sampling_arguments(parser)
    tensor_parallel.add_tp_argument(parser)

    def run(args: argparse.Namespace) -> int:
        if (args.prompt is None) == (args.prompts is None):
            raise ValueError("give exactly one of --prompt TEXT or --prompts FILE")
        if args.prompts and args.max_step is not None:
            raise ValueError("--max-step applies to --prompt; with --prompts give the engine's step budget "
                             "as --max-batch-tokens")
        args.model = args.model or default_model_pte()
        if args.tp is not None and not tensor_parallel.launched():
            return tensor_parallel.launch_local(args.tp, tensor_parallel.without_tp(args.argv))
        if args.prompts:
            return run_prompts(args)
        from mlx_pte.interpreter.program import load

        from mlx_pte.serving.parallel.step_channel import watched

        group = tensor_parallel.join_group()
        with tensor_parallel.lost_ranks(group), watched(group):
            args.seed = tensor_parallel.shared_seed(group, args.seed)
            return _run_prompt(args, load(args.model, tokenizer=args.tokenizer, group=group))

    return run


def _run_prompt(args: argparse.Namespace, program) -> int:
    from mlx_pte.interpreter.session import Session
    from mlx_pte.interpreter.text import TextCodec
    from mlx_pte.serving.generation import generate

    session = Session(program, kind=args.cache or "single", capacity=args.capacity,
                      kv_dtype=args.kv_dtype, max_seqs=args.max_seqs, max_step=args.max_step, launch=args.launch)
    prompt = args.prompt
    if args.chat:
        codec = TextCodec(session.manifest, template_budget=args.template_budget)
        prompt = codec.render_chat([{"role": "user", "content": prompt}])
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


def run_prompts(args: argparse.Namespace) -> int:
    """``run MODEL --prompts FILE``: every prompt of the file through one batching engine."""
    from pathlib import Path

    from mlx_pte.serving.engine import open_engine
    from mlx_pte.serving.openai.prompts_file import run_prompts_file

    def engine_for(group):
        engine = open_engine(args.model, args.cache or KIND_BATCHED_SEQUENCE, args.capacity, args.max_batch_tokens,
                             args.max_seqs, args.kv_dtype, args.tokenizer, args.prompt_cache_tokens, group=group,
                             launch=args.launch)
        if engine.codec is not None:
            engine.codec.template_budget = args.template_budget
        return engine

    def run_file(engine) -> None:
        defaults = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                    "top_p": args.top_p, "seed": args.seed}
        run_prompts_file(engine, Path(args.prompts), {k: v for k, v in defaults.items() if v is not None})

    group = tensor_parallel.join_group()
    if group is not None and group.size() > 1:
        from mlx_pte.serving.parallel.step_channel import serve_ranks

        with tensor_parallel.lost_ranks(group):
            return serve_ranks(group, engine_for, run_file)
    run_file(engine_for(None))
    return 0


# -- serve ------------------------------------------------------------------------------


@command("serve", "serve a .pte file over an OpenAI-compatible HTTP API (completions, chat, streaming)")
def serve_command(parser: argparse.ArgumentParser) -> Handler:
    add_serve_arguments(parser)
    tensor_parallel.add_tp_argument(parser)

    def run(args: argparse.Namespace) -> int:
        from pathlib import Path

        from mlx_pte.serving.openai.app import serve
        from mlx_pte.serving.engine import open_engine
        from mlx_pte.serving.openai.request_body import BodyLimits

        if args.tp is not None and not tensor_parallel.launched():
            return tensor_parallel.launch_local(args.tp, tensor_parallel.without_tp(args.argv))

        def engine_for(group):
            return open_engine(args.model, args.cache, args.capacity, args.max_batch_tokens, args.max_seqs,
                               args.kv_dtype, args.tokenizer, args.prompt_cache_tokens, group=group,
                               launch=args.launch)

        def serve_engine(engine) -> None:
            # Every compile bucket is traced before the port opens, so no request pays for it,
            # on the engine's own thread, where its steps run (MLX keeps compiled graphs per thread).
            engine.start()
            print(f"warmed up {engine.kind} engine in {engine.warm_up():.1f} s", file=sys.stderr, flush=True)
            serve(engine, args.model_id or Path(args.model).stem, args.host, args.port,
                  BodyLimits(args.max_body_bytes, args.body_timeout), args.header_timeout, args.keep_alive,
                  args.template_budget)

        group = tensor_parallel.join_group()
        if group is not None and group.size() > 1:
            from mlx_pte.serving.parallel.step_channel import serve_ranks

            with tensor_parallel.lost_ranks(group):
                return serve_ranks(group, engine_for, serve_engine)
        serve_engine(engine_for(None))
        return 0

    return run


# -- bench ------------------------------------------------------------------------------


@command("bench", "measure prefill and decode speed and peak memory of a .pte file")
def bench_command(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("model", help="the .pte file")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="prompt length (default 128)")
    parser.add_argument("--generate", type=positive_int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs after one warm-up (default 3)")
    add_cache_arguments(parser, KINDS, "single", "single", "the model's max context")
    add_max_step_argument(parser)
    add_tokenizer_argument(parser)
    tensor_parallel.add_tp_argument(parser)

    def run(args: argparse.Namespace) -> int:
        if args.tp is not None and not tensor_parallel.launched():
            return tensor_parallel.launch_local(args.tp, tensor_parallel.without_tp(args.argv))
        from mlx_pte.serving.parallel.step_channel import watched

        group = tensor_parallel.join_group()
        with tensor_parallel.lost_ranks(group), watched(group):
            return _bench(args, group)

    return run


def _bench(args: argparse.Namespace, group) -> int:
    import statistics

    import numpy as np

    from mlx_pte.interpreter.program import load
    from mlx_pte.interpreter.session import Session
    from mlx_pte.serving.generation import generate
    import mlx.core as mx

    program = load(args.model, tokenizer=args.tokenizer, group=group)
    vocab = int(program.manifest["vocab_size"])
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_tokens).tolist()

    def once(n_prompt: int, n_new: int):
        session = Session(program, kind=args.cache, capacity=args.capacity, kv_dtype=args.kv_dtype,
                          max_step=args.max_step)
        return generate(session, prompt[:n_prompt], max_new_tokens=n_new, stop_on_eos=False)

    once(min(8, len(prompt)), 4)
    mx.reset_peak_memory()
    runs = [once(len(prompt), args.generate) for _ in range(args.repeats)]
    prefill = statistics.median(r.prefill_tps for r in runs)
    decode = statistics.median(r.decode_tps for r in runs)
    print(f"{args.model}: cache {args.cache}, prompt {args.prompt_tokens}, generate {args.generate}, "
          f"median of {len(runs)}, device {mx.default_device()}")
    print(f"  prefill {prefill:.1f} tok/s | decode {decode:.2f} tok/s | "
          f"peak memory {mx.get_peak_memory() / 2**20:.1f} MiB")
    if group is not None and group.size() > 1:
        from mlx_pte.interpreter.shards import all_sum_bytes_per_token

        print(f"  tensor parallel over {group.size()} ranks: each all-sums "
              f"{all_sum_bytes_per_token(program.graph):,} bytes per token")
    return 0
