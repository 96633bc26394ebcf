"""The ``mlx-pte`` command line.

Each subcommand is one setup function registered with ``@command``: it adds its
arguments to the parser it is given and returns the handler that runs it. Handlers import
heavy dependencies (torch, mlx) themselves, so ``mlx-pte inspect`` starts quickly.
Errors the user can act on (FormatError, OSError) print one ``error: ...`` line and exit
with status 1, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from typing import Callable, Optional, Sequence

from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import ScalarType, SymDim, TensorType
from mlx_pte.ir.manifest import CacheLayerSpec
from mlx_pte.ir.payload import Payload
from mlx_pte.ir.pte import read_pte

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
    except (FormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


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
