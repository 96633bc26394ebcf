"""Export a torch module, or an already exported program, to an ExecuTorch ``.pte`` file
whose whole graph is delegated to the MLX backend.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Optional, Sequence, Union

import torch
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from torch.export import ExportedProgram

from mlx_pte.ir.quantization import QuantSpec

from .backend import SEPARATE, drop_preprocess_specs
from .errors import OutputPathError
from .lowering import dim_ranges
from .partitioner import MLXPtePartitioner
from .tensor_source import TensorSource
from .weight_writer import PARTIAL_SUFFIX, Progress, WeightSink, streaming

PathLike = Union[str, "os.PathLike[str]"]


def export_program(
    ep: ExportedProgram,
    out: PathLike,
    manifest: Optional[Mapping[str, Any]] = None,
    quantization: Optional[QuantSpec] = None,
    fused_projections: bool = True,
    sources: Optional[Mapping[str, TensorSource]] = None,
    progress: Optional[Progress] = None,
) -> Path:
    """Lower ``ep`` to the MLX backend and write the ``.pte`` to ``out``.

    The file is written atomically (see ``write_atomically``): on any failure nothing is left
    at ``out``. Weights go through a temporary file beside ``out`` one at a time
    (``weight_writer``), so the export never holds them all.

    Args:
        ep: an ATen-dialect program from ``torch.export.export``.
        out: the ``.pte`` path to write.
        manifest: JSON-serializable metadata stored in the delegate payload
            (see ``ir.manifest.Manifest``); ``{}`` when omitted.
        quantization: quantize linear and embedding weights to this type (see
            ``export.quantize``; recorded as the manifest's ``quantization``).
        fused_projections: one matmul for the linears that read one input (q/k/v,
            gate/up; ``ir.fuse_projections``); False keeps one each (recorded as the
            manifest's ``extra["projections"] = "separate"``).
        sources: where the values of ``ep``'s placeholder weights come from, by
            state-dict name (a program traced from ``hf_checkpoint.load_skeleton``).
        progress: called after each constant is written (name, index, count).

    Returns:
        The path written.

    Raises:
        UnsupportedOpsError: the graph uses ops the backend cannot lower (all listed).
    """
    manifest = dict(manifest or {})
    if quantization is not None:
        manifest["quantization"] = quantization.to_dict()
    if not fused_projections:
        manifest["extra"] = {**manifest.get("extra", {}), "projections": SEPARATE}
    out = Path(out)
    check_writable(out)
    sink = WeightSink(out, dict(sources or {}), progress)
    try:
        with streaming(sink):
            edge = to_edge_transform_and_lower(
                ep,
                partitioner=[MLXPtePartitioner(manifest, dim_ranges(ep))],
                # Non-core ops (linear, rms_norm, the custom op) must survive to the partitioner.
                compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
            )
        drop_preprocess_specs(edge.exported_program().graph_module)
        program = edge.to_executorch()

        def write(f: BinaryIO) -> None:
            program.write_to_file(f)
            sink.remove_files()  # the .pte holds the weights now

        return write_atomically(out, write)
    finally:
        sink.remove_files()


def export_module(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    out: PathLike,
    dynamic_shapes: Optional[Any] = None,
    manifest: Optional[Mapping[str, Any]] = None,
    quantization: Optional[QuantSpec] = None,
    fused_projections: bool = True,
) -> Path:
    """``torch.export`` ``module`` (non-strict) on ``example_inputs``, then ``export_program``.

    Args:
        module: the module to export (put it in eval mode first).
        example_inputs: positional inputs for tracing.
        out: the ``.pte`` path to write.
        dynamic_shapes: as ``torch.export.export`` takes them.
        manifest, quantization, fused_projections: see ``export_program``.

    Returns:
        The path written.
    """
    ep = torch.export.export(module, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False)
    return export_program(ep, out, manifest, quantization, fused_projections)


# The temp files of an export in progress (the .pte and its weights): beside the output,
# visible, tagged with the writer's pid.


def output_path(out: PathLike, default_name: str) -> Path:
    """Where ``-o out`` writes: ``out``, or ``out/default_name`` when ``out`` is an existing
    directory or ends with a path separator.

    Raises:
        OutputPathError: the directory to write in does not exist (nothing is created).
    """
    text = os.fspath(out)
    path = Path(text)
    if path.is_dir() or text.endswith((os.sep, "/")):
        path = path / default_name
    if not path.parent.is_dir():
        raise OutputPathError(f"cannot write {path}: the directory {path.parent} does not exist; create it first")
    return path


def check_writable(out: Path) -> None:
    """Raise OutputPathError now if ``write_atomically`` could not write ``out``."""
    if out.is_dir():
        raise OutputPathError(f"cannot write {out}: it is a directory; give a file name")
    if not out.parent.is_dir():
        raise OutputPathError(f"cannot write {out}: the directory {out.parent} does not exist; create it first")


def write_atomically(out: Path, data: Union[bytes, Callable[[BinaryIO], None]]) -> Path:
    """Write ``data`` (bytes, or a function writing to a file) to ``out`` through
    ``out.<pid>.partial`` and a rename, so ``out`` is the old file or the whole new one,
    never a part. The file gets mode 0666 less the umask, as any new file. Partial files
    of writers that no longer run (killed exports) are removed.

    Raises:
        OutputPathError: ``out`` is a directory, or its directory does not exist.
    """
    check_writable(out)
    _remove_stale_partials(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _remove_stale_partials(out: Path) -> None:
    for partial in out.parent.glob(f"{glob.escape(out.name)}.*{PARTIAL_SUFFIX}"):
        pid = partial.name[len(out.name) + 1 : -len(PARTIAL_SUFFIX)].split(".")[0]  # <pid>[.weights]
        if pid.isdigit() and not _running(int(pid)):
            partial.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
