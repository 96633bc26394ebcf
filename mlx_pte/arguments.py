"""The command line's argument groups, each defined once and shared by the subcommands.

Values are checked as they are parsed, so a bad one is argparse's one ``error:`` line
naming the flag. Nothing heavy is imported here: ``mlx-pte --help`` stays fast.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional, Sequence

from mlx_pte.interpreter.template_budget import DEFAULT_BUDGET as DEFAULT_TEMPLATE_BUDGET
from mlx_pte.runtime.cache import KINDS, KV_DTYPES
from mlx_pte.runtime.launch_modes import LAUNCH_MODES
from mlx_pte.serving.engine import DEFAULT_CAPACITY_CONTEXTS
from mlx_pte.serving.openai.request_body import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE,
    DEFAULT_MAX_BODY_BYTES,
    MAX_DEPTH,
    MAX_INT_DIGITS,
)
from mlx_pte.serving.sampling.params import GREEDY_TEMPERATURE
from mlx_pte.serving.text.stops import MAX_STOP_CHARS, MAX_STOPS


def _checked(kind: type, what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: ``kind(text)`` that must satisfy ``ok``; argparse names the flag."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = what  # argparse shows it in its own messages
    return parse


positive_int = _checked(int, "an integer >= 1", lambda v: v >= 1)
non_negative_int = _checked(int, "an integer >= 0", lambda v: v >= 0)
non_negative_float = _checked(float, "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0)
positive_float = _checked(float, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)
probability = _checked(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
tcp_port = _checked(int, "a TCP port in [0, 65535]", lambda v: 0 <= v <= 65535)

_KIND_HELP = {
    "single": "single = one sequence",
    "batched-cell": "batched-cell = one pool of cells shared by all sequences",
    "batched-sequence": "batched-sequence = a private history per sequence",
}


def add_cache_arguments(parser: argparse.ArgumentParser, kinds: Sequence[str], default_kind: Optional[str],
                        default_shown: str, capacity_default: str) -> None:
    """``--cache``, ``--capacity`` and ``--kv-dtype``.

    Args:
        default_shown: the default kind as the help states it (it may depend on other flags).
        capacity_default: what an unset ``--capacity`` means for this command.
    """
    parser.add_argument(
        "--cache", default=default_kind, choices=tuple(kinds),
        help=f"KV-cache layout (default: {default_shown}): " + "; ".join(_KIND_HELP[k] for k in kinds),
    )
    parser.add_argument(
        "--capacity", type=positive_int, default=None,
        help="cache capacity: positions (single), cells (batched-cell) or total positions "
        f"(batched-sequence); default: {capacity_default}",
    )
    parser.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                        help="K/V storage dtype (default: the model's dtype)")


def add_max_step_argument(parser: argparse.ArgumentParser) -> None:
    """The run-time prefill chunk (``Session(max_step=...)``) of a single-session command."""
    parser.add_argument("--max-step", type=positive_int, default=None,
                        help="most tokens per forward (the prefill chunk), at most the export's bound; "
                        "default: 2048 on the GPU, 256 on the CPU, within that bound")


def add_launch_argument(parser: argparse.ArgumentParser) -> None:
    """How steps are handed to MLX (``Session(launch=...)``)."""
    parser.add_argument("--launch", default=None, choices=LAUNCH_MODES,
                        help="thread: MLX encodes each step on a thread of its own while the next is built "
                        "(host-bound steps: a GPU); inline: on the building thread; default: per device "
                        "(see the README)")


def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that size the engine (``serve`` and ``run --prompts``)."""
    parser.add_argument("--max-batch-tokens", type=positive_int, default=None,
                        help="most tokens per forward (default: the model's max step)")
    parser.add_argument("--max-seqs", type=positive_int, default=None, help="most live sequences")
    parser.add_argument(
        "--prompt-cache-tokens", type=non_negative_int, default=None, metavar="N",
        help="keep finished requests' sequences in the cache, up to N tokens, so that prompts sharing "
        "their prefix (a conversation's next turn) skip recomputing it; they use only room no request "
        "has reserved and are evicted first (least recently used). 0 disables; default: the capacity",
    )


def add_template_budget_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--template-budget", type=positive_float, default=DEFAULT_TEMPLATE_BUDGET, metavar="SECONDS",
                        help="CPU seconds one chat-template render may take before it is refused "
                             f"(default: {DEFAULT_TEMPLATE_BUDGET:g})")


def add_tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", metavar="HF_DIR", default=None,
        help="take the tokenizer (and config) from this Hugging Face checkpoint directory; "
        "needed for text with upstream ExecuTorch exports, which carry none",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="0 (default) is greedy, as is any temperature too small to sample with")
    parser.add_argument("--top-k", type=non_negative_int, default=0,
                        help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--top-p", type=probability, default=1.0,
                        help="sample from the smallest set holding this mass")
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help="random seed (an integer >= 0), for reproducible sampling")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the .pte file to serve")
    add_tokenizer_argument(parser)
    add_template_budget_argument(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=tcp_port, default=8000)
    parser.add_argument("--model-id", default=None, help="the name clients use (default: the file's stem)")
    add_cache_arguments(parser, KINDS, "batched-sequence", "batched-sequence",
                        f"{DEFAULT_CAPACITY_CONTEXTS} x the model's max context")
    add_batching_arguments(parser)
    add_launch_argument(parser)
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body; larger ones get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--header-timeout", type=positive_float, default=DEFAULT_HEADER_TIMEOUT,
                        help="seconds a client has to send a request's headers, else 408 and close "
                             f"(default: {DEFAULT_HEADER_TIMEOUT:g})")
    parser.add_argument("--body-timeout", type=positive_float, default=DEFAULT_BODY_TIMEOUT,
                        help="seconds the whole of a request body may take to arrive, else 408 and close "
                             f"(default: {DEFAULT_BODY_TIMEOUT:g})")
    parser.add_argument("--keep-alive", type=positive_float, default=DEFAULT_KEEP_ALIVE,
                        help=f"seconds an idle keep-alive connection stays open (default: {DEFAULT_KEEP_ALIVE:g})")
    parser.epilog = (
        f"Limits per request: at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters; "
        f"'seed' in [0, 2**63 - 1]; temperatures below {GREEDY_TEMPERATURE:g} are greedy; the body is "
        f"JSON nested at most {MAX_DEPTH} deep, integers of at most {MAX_INT_DIGITS} digits, no lone "
        "surrogates. Bad requests get an OpenAI-shaped 4xx error."
    )
