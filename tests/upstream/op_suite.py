"""Upstream ExecuTorch's MLX op test suite (``executorch.backends.mlx.test``), run on
mlx-pte's interpreter instead of upstream's C++ ``op_test_runner``.

Each registered case is built exactly as upstream's ``OpTestCase.generate_test_files``
builds it (its seed, model, export and test inputs, expected outputs from eager torch,
``test_utils.export_model_to_pte`` with upstream's own ``MLXPartitioner``), then imported
with ``ir.upstream.importer.import_function``, run, and compared with upstream's
``compare_outputs`` at the case's own tolerances (the ones upstream's runner applies; the
defaults are ``test_utils.TOLERANCE_PRESETS``'s fp32 row). Outcomes:

- passed / failed (wrong values or shape, or an error while running);
- unsupported: node types mlx-pte has no translation for (listed), or state kept in
  mutable graph buffers (an in-graph KV cache);
- not delegated: upstream keeps part of the program outside its delegate (by design for
  the case, e.g. ``expected_mlx_segments != 1``), so no single payload computes it;
- build error: upstream's case itself (its model, inputs or eager reference) or its
  export fails here (e.g. a transformers version it was not written for).

``python -m tests.upstream.op_suite [--per-class N] [CLASS ...]`` prints the per-class table.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import types
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

import mlx.core as mx
from mlx_pte.interpreter.program import Program
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.pte import read_program
from mlx_pte.ir.upstream.importer import MutableBuffersError, UnsupportedNodeError, import_function
from mlx_pte.runtime.cache import CACHE_FACTORY, KIND_SINGLE, CacheConfig, CacheGeometry, LayerGeometry, LayerPolicy, Step

PASSED, FAILED, UNSUPPORTED, NOT_DELEGATED, BUILD_ERROR = (
    "passed", "failed", "unsupported", "not delegated", "build error",
)  # fmt: skip
OUTCOMES = (PASSED, FAILED, UNSUPPORTED, NOT_DELEGATED, BUILD_ERROR)
# ExecuTorch ScalarType codes in a case's kv_cache spec -> mlx-pte dtypes.
_KV_DTYPES = {5: "float16", 6: "float32", 15: "bfloat16"}


@dataclass(frozen=True)
class CaseResult:
    test_class: str  # the registered base name, e.g. "add"
    case: str  # the configuration's name
    outcome: str
    detail: str = ""
    node_types: tuple[str, ...] = ()  # for UNSUPPORTED


def registry() -> dict[str, type]:
    """Upstream's registered test classes by base name.

    ``executorch.extension.llm.modules``' package ``__init__`` imports torchtune, which only
    its attention module needs; the suite imports a sibling (``turboquant``), so the package
    is entered without running that ``__init__`` rather than installing torchtune.
    """
    name = "executorch.extension.llm.modules"
    if name not in sys.modules:
        spec = importlib.util.find_spec("executorch.extension.llm")
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(next(iter(spec.submodule_search_locations)), "modules")]
        sys.modules[name] = package
    importlib.import_module("executorch.backends.mlx.test.test_ops")
    from executorch.backends.mlx.test.test_utils import _TEST_REGISTRY

    return dict(_TEST_REGISTRY)


def cases(test_class: type) -> list:
    return test_class.get_test_configs() if hasattr(test_class, "get_test_configs") else [test_class()]


def _as_list(values: Any) -> list:
    return [values] if isinstance(values, torch.Tensor) else list(values)


def _to_mlx(t: torch.Tensor) -> mx.array:
    if t.dtype == torch.bfloat16:
        return mx.array(t.float().numpy()).astype(mx.bfloat16)
    return mx.array(t.numpy())


def _to_torch(a: mx.array) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _kv_cache(spec: str, steps: int) -> Any:
    """The cache a case's ``kv_cache`` spec asks for ("capacity,n_layers,n_kv_heads,head_dim[,dtype]")."""
    capacity, n_layers, n_kv_heads, head_dim, *rest = (int(x) for x in spec.split(","))
    geometry = CacheGeometry(tuple(LayerGeometry(LayerPolicy.from_window(0), n_kv_heads, head_dim, head_dim)
                                   for _ in range(n_layers)))  # fmt: skip
    config = CacheConfig(capacity=capacity, max_write=steps, initial_capacity=capacity,
                         kv_dtype=_KV_DTYPES[rest[0]] if rest else "float32")  # fmt: skip
    return CACHE_FACTORY.build("mlx", KIND_SINGLE, geometry, config)


def _delegate_argument_order(data: bytes) -> Optional[list[int]]:
    """For each delegate input, the index of the method input it is; None unless the forward
    is one delegate call and nothing else (no CPU kernels, every argument an input)."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import DelegateCall

    program = deserialize_pte_binary(data).program
    (forward,) = [plan for plan in program.execution_plan if plan.name == "forward"]
    calls = [i.instr_args for chain in forward.chains for i in chain.instructions]
    if len(calls) != 1 or not isinstance(calls[0], DelegateCall):
        return None
    inputs = list(forward.inputs)
    order = [inputs.index(a) for a in calls[0].args if a in inputs]
    return order if sorted(order) == list(range(len(inputs))) else None


def run_case(base: str, case: Any, workdir: Path) -> CaseResult:
    from executorch.backends.mlx.test.test_utils import compare_outputs, export_model_to_pte

    name = getattr(case, "name", base)
    if case.expected_mlx_segments != 1:
        return CaseResult(base, name, NOT_DELEGATED, f"the case expects {case.expected_mlx_segments} MLX segments")
    path = workdir / f"{name}.pte"
    try:
        case._set_seed()
        model = case.create_model().eval()
        export_inputs = case.create_inputs()
        case._set_seed()
        test_inputs = tuple(_as_list(case.create_test_inputs()))
        with torch.no_grad():
            expected = _as_list(case.compute_expected_outputs(model, test_inputs))
        export_model_to_pte(model, tuple(_as_list(export_inputs)), path, dynamic_shapes=case.get_dynamic_shapes(),
                            edge_compile_config=case.get_edge_compile_config(),
                            transform_passes=case.get_transform_passes())  # fmt: skip
    except Exception as exc:  # upstream's case or exporter: any failure is reported, not raised
        return CaseResult(base, name, BUILD_ERROR, f"{type(exc).__name__}: {str(exc)[:200]}")
    data = path.read_bytes()
    order = _delegate_argument_order(data)
    if order is None:
        return CaseResult(base, name, NOT_DELEGATED, "upstream's partitioner left CPU kernels in the program")
    try:
        contents = read_program(data)
        program = Program.from_payload(import_function(contents.payload, contents.named_data))
    except UnsupportedNodeError as exc:
        return CaseResult(base, name, UNSUPPORTED, str(exc), tuple(sorted(exc.node_types)))
    except MutableBuffersError as exc:
        return CaseResult(base, name, UNSUPPORTED, str(exc), ("mutable buffers",))
    except FormatError as exc:
        return CaseResult(base, name, FAILED, f"import: {exc}")
    except Exception as exc:  # a bug in the importer: reported with the case, the suite goes on
        return CaseResult(base, name, FAILED, f"import crashed: {type(exc).__name__}: {str(exc)[:200]}")
    try:
        actual = [_to_torch(a) for a in _run(program, case, tuple(test_inputs[i] for i in order))]
    except Exception as exc:  # a runtime failure of the interpreter is this case's failure
        return CaseResult(base, name, FAILED, f"run: {type(exc).__name__}: {str(exc)[:200]}")
    if case.skip_comparison:
        return CaseResult(base, name, PASSED, "ran (upstream skips the comparison for this case)")
    ok, message = compare_outputs(expected, actual, rtol=case.rtol, atol=case.atol)
    return CaseResult(base, name, PASSED if ok else FAILED, "" if ok else message)


def _run(program: Program, case: Any, inputs: tuple) -> list[mx.array]:
    arrays = [_to_mlx(t) for t in inputs]
    if not case.kv_cache:
        return program.run(arrays)
    # update_and_attend cases: q, k, v and position[T, 1] (the one int input); one sequence.
    (position,) = [t for t in inputs if not t.is_floating_point()]
    positions = [int(p) for p in position.reshape(-1)]
    cache = _kv_cache(case.kv_cache, len(positions))
    cache.declare_step(Step((cache.SEQ_ID,) * len(positions), tuple(positions)))
    outputs = program.run(arrays, cache=cache)
    cache.finish_step()
    return outputs


def run_suite(
    classes: Optional[Iterable[str]] = None,
    per_class: Optional[int] = None,
    on_result: Optional[Callable[[CaseResult], None]] = None,
) -> list[CaseResult]:
    """Every case of ``classes`` (default: all registered), or the first ``per_class`` of
    each; ``on_result`` sees each result as it comes."""
    tests = registry()
    wanted = list(tests) if classes is None else list(classes)
    results = []
    with tempfile.TemporaryDirectory(prefix="mlx-op-suite-") as tmp:
        for base in wanted:
            for case in cases(tests[base])[:per_class]:
                results.append(run_case(base, case, Path(tmp)))
                if on_result is not None:
                    on_result(results[-1])
    return results


def table(results: list[CaseResult]) -> str:
    """A markdown table: per class, the count of each outcome and the unsupported node types."""
    by_class: dict[str, Counter] = defaultdict(Counter)
    missing: dict[str, set] = defaultdict(set)
    for r in results:
        by_class[r.test_class][r.outcome] += 1
        missing[r.test_class].update(r.node_types)
    lines = ["| class | " + " | ".join(OUTCOMES) + " | node types not handled |",
             "|---" * (len(OUTCOMES) + 2) + "|"]  # fmt: skip
    for base, counts in by_class.items():
        cells = " | ".join(str(counts[o]) for o in OUTCOMES)
        lines.append(f"| {base} | {cells} | {', '.join(sorted(missing[base]))} |")
    totals = Counter(r.outcome for r in results)
    lines.append("| **all** | " + " | ".join(str(totals[o]) for o in OUTCOMES) + " | |")
    return "\n".join(lines)


if __name__ == "__main__":
    # python -m tests.upstream.op_suite [--per-class N] [CLASS ...]
    argv = sys.argv[1:]
    limit = int(argv[1]) if argv[:1] == ["--per-class"] else None
    progress = lambda r: print(f"{r.outcome}: {r.case} {r.detail[:150]}", file=sys.stderr, flush=True)  # noqa: E731
    suite = run_suite(argv[2 if limit else 0 :] or None, per_class=limit, on_result=progress)
    print(table(suite))
    for r in suite:
        if r.outcome == FAILED:
            print(f"FAILED {r.case}: {r.detail}")
