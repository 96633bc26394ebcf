"""One rank of the two-process parity test (tests/interpreter/test_tensor_parallel.py).

Loads each given .pte whole and as this rank's shard, runs the same greedy generation on
both for every cache kind, capture off and on, and exits non-zero unless the tokens are
equal and the logits within 1e-5. ``--fused`` also shards a copy whose q/k/v and gate/up
projections are fused here (one linear over the concatenated weights, then a split, as
a fusing export writes them). Run with MLX_RANK and MLX_HOSTFILE set.
"""
from __future__ import annotations

import sys
from typing import Optional

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (load an optimized BLAS before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter.shards import shard_program
from mlx_pte.interpreter.program import Program, load
from mlx_pte.ir.graph import Graph, Instruction, Slot, SlotKind, TensorType
from mlx_pte.runtime.cache import KINDS

PROMPT = [1, 5, 9, 33, 70, 2, 11, 400, 17, 3]  # longer than the tiny models' window of 4
NEW_TOKENS = 12
TOLERANCE = 1e-5


def greedy(program, kind: str, capture: bool) -> tuple[list[int], np.ndarray]:
    session = program.session(kind, capture=capture, capacity=64)
    seq = None if kind == "single" else session.cache.seq_new()
    tokens, logits = list(PROMPT), []
    step = list(PROMPT)
    for _ in range(NEW_TOKENS + 1):
        logits.append(np.array(session.forward(step, seq_ids=seq)[-1]))
        step = [int(np.argmax(logits[-1]))]
        tokens.extend(step)
    return tokens, np.stack(logits)


_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused(program: Program) -> Optional[tuple[Graph, dict, dict]]:
    """``program``'s graph with each layer's q/k/v and gate/up linears as one linear + split
    (None if it has no such float linears)."""
    g = program.graph
    slots, weights = list(g.slots), dict(program.weights)
    by_name = {}
    for index, instr in enumerate(g.instructions):
        if instr.op == "linear":
            by_name[g.slots[instr.inputs[1]].name] = index
    replaced: dict[int, list[Instruction]] = {}
    dropped: set[int] = set()
    for name, index in by_name.items():
        for fused_name, parts in _GROUPS.items():
            if not name.endswith(f".{parts[0]}.weight"):
                continue
            members = [by_name[name.replace(parts[0], p)] for p in parts]
            instrs = [g.instructions[i] for i in members]
            ws = [weights[i.inputs[1]] for i in instrs]
            sizes = tuple(int(w.shape[0]) for w in ws)
            slots.append(Slot(name.replace(parts[0], fused_name), SlotKind.CONSTANT,
                              TensorType(g.slots[instrs[0].inputs[1]].type.dtype, (sum(sizes), int(ws[0].shape[1])))))
            weight = len(slots) - 1
            weights[weight] = mx.concatenate(ws, axis=0)
            out_t = g.slots[instrs[0].outputs[0]].type
            slots.append(Slot(fused_name + ".out", SlotKind.TEMP, TensorType(out_t.dtype, out_t.shape[:-1] + (sum(sizes),))))
            out = len(slots) - 1
            replaced[members[0]] = [
                Instruction("linear", (instrs[0].inputs[0], weight, None), (out,)),
                Instruction("split", (out,), tuple(i.outputs[0] for i in instrs), (("sizes", sizes), ("dim", 2))),
            ]
            dropped.update(members[1:])
    instructions = []
    for index, instr in enumerate(g.instructions):
        if index not in dropped:
            instructions.extend(replaced.get(index, [instr]))
    if not replaced:
        return None
    return Graph(slots, instructions, list(g.inputs), list(g.outputs)), weights, program.manifest


def main(paths: list[str], fuse: bool) -> int:
    group = mx.distributed.init(strict=True, backend="ring")
    failures = []
    for path in paths:
        whole = load(path)
        shards = {path: load(path, group=group)}
        fusion = fused(whole) if fuse else None
        if fusion is not None:
            shards[f"{path} fused"] = Program(*shard_program(*fusion, group))
        for label, shard in shards.items():
            failures += compare(label, whole, shard)
    print(f"rank {group.rank()}: {len(failures)} failures", *failures, sep="\n", flush=True)
    return 1 if failures else 0


def compare(path: str, whole: Program, shard: Program) -> list[str]:
    failures = []
    for kind in KINDS:
        for capture in (False, True):
            want, want_logits = greedy(whole, kind, capture)
            got, got_logits = greedy(shard, kind, capture)
            diff = float(np.abs(want_logits - got_logits).max())
            if got != want or diff > TOLERANCE:
                failures.append(f"{path} {kind} capture={capture}: tokens equal {got == want}, max diff {diff:.2e}")
    return failures


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main([a for a in args if a != "--fused"], "--fused" in args))
