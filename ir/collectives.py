"""Collective ops: what a program sharded over several processes adds to its graph.

``all_sum`` is never written by the exporter: the loader inserts one after every
row-parallel linear when it shards a program (``ir.sharding``). ``group`` names the
process group in the interpreter's registry (``interpreter.collectives``), so one
process may run programs sharded over different groups.
"""
from __future__ import annotations

from .catalog import AttrSpec, OpSpec, define

ALL_SUM = define(
    OpSpec(
        "all_sum",
        ("x",),
        (AttrSpec("group", "int"),),
        output_rule="same dtype and shape as x: the elementwise sum of x over every rank of the group "
        "(MLX: mx.distributed.all_sum(x, group=group))",
    )
)
