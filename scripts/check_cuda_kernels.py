"""Compile the project's CUDA kernels (``runtime/mlx/gemv_source.py``) with NVRTC, without a GPU.

``mx.fast.cuda_kernel`` compiles a kernel's source with NVRTC the first time it runs, so a
kernel that does not compile fails only on a GPU. This script builds each kernel's full
source the way MLX 0.32's ``cuda_kernel`` does (read in ``mlx/backend/cuda/custom_kernel.cpp``
and ``jit_module.cpp``: MLX's default header, the kernel's header, a ``__global__`` function
in ``mlx::core::cu`` whose parameters are each input's pointer with the strides and ndim the
source reads, then each output's; the template arguments as ``constexpr`` lines; the body)
and compiles it with NVRTC's options there, for a few shapes, dtypes and tilings each.

It needs, none of which ships with the CPU wheels:
- NVRTC: ``pip download --no-deps nvidia-cuda-nvrtc==13.0.*`` and unzip it
  (``nvidia/cu13/lib/libnvrtc.so.13``; its ``libnvrtc-builtins`` must be on
  ``LD_LIBRARY_PATH``);
- MLX's device headers (``mlx/backend/cuda/device/*.cuh``, compiled into ``libmlx.so``):
  a checkout of ml-explore/mlx at the release in use, passed as an include folder;
- the headers MLX's CUDA wheel brings (its ``mlx/include`` and ``mlx/include/cccl``) and the
  CUDA toolkit's ``include`` (``cuda_bf16.h``).

    LD_LIBRARY_PATH=NVRTC/nvidia/cu13/lib python scripts/check_cuda_kernels.py \\
        --nvrtc NVRTC/nvidia/cu13/lib/libnvrtc.so.13 --include MLX_CHECKOUT \\
        --include WHEEL/mlx/include --include WHEEL/mlx/include/cccl --include /usr/local/cuda/include

Prints one line per kernel compiled and NVRTC's log of any that fails; exits 1 if any does.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_pte.runtime.mlx.blas  # noqa: E402,F401  (before mlx.core)
import mlx.core as mx  # noqa: E402

from mlx_pte.runtime.mlx import gemv, gemv_rows, gemv_source  # noqa: E402

# MLX's own header before every kernel's (custom_kernel.cpp's default_header).
MLX_HEADER = '#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
# (out, in) shapes: aligned for the 16-byte loads, odd, and the longest rows a norm stages.
SHAPES = ((3072, 2048), (37, 256), (2048, 8192))
TILINGS = (gemv.Tiling(), gemv.Tiling(4, 2, 8), gemv.Tiling(16, 1, 4, 4))


def full_source(spec: gemv_source.KernelSource, function: str, dtypes: dict[str, mx.Dtype],
                template: list[tuple[str, object]]) -> str:
    """``spec`` as MLX hands it to NVRTC: inputs of ``dtypes`` (all rank 2 or more)."""
    declared = {"shape": "const __grid_constant__ Shape", "strides": "const __grid_constant__ Strides",
                "ndim": "const __grid_constant__ int"}
    params = []
    for name, kind in spec.parameters():
        if kind in ("input", "output"):
            const = "const " if kind == "input" else ""
            params.append(f"    {const}{gemv_source.CUDA_TYPES[dtypes[name]]}* {name},")
        else:
            params.append(f"    {declared[kind]} {name},")
    params[-1] = params[-1][:-1] + ") {"
    constants = gemv_source.template_declarations(template, "  ")
    return (MLX_HEADER + gemv_source.HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {function}(\n" + "\n".join(params) + "\n" + constants + "\n" + spec.source
            + "\n}\n\n} // namespace mlx::core::cu\n")


def compile_source(nvrtc: ctypes.CDLL, source: str, name: str, options: list[str]) -> tuple[bool, str]:
    """(compiled, NVRTC's log)."""
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        encoded = [o.encode() for o in options]
        result = nvrtc.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        return result == 0, log.value.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvrtc", type=Path, required=True, help="libnvrtc.so (CUDA 13)")
    parser.add_argument("--include", type=Path, action="append", default=[], help="an include folder (repeat)")
    parser.add_argument("--arch", default="sm_90a", help="NVRTC's --gpu-architecture (MLX: sm_90a on H100/H200)")
    args = parser.parse_args()
    nvrtc = ctypes.CDLL(str(args.nvrtc))
    options = ["--device-as-default-execution-space", f"--gpu-architecture={args.arch}",
               *(f"--include-path={folder}" for folder in args.include)]
    failed = 0
    for packed in (False, True):
        for row in gemv_rows.ROW_KINDS:
            spec = gemv_source.kernel_source(packed, row)
            for dtype in (mx.bfloat16, mx.float16, mx.float32):
                for (out_features, in_features), tiling in zip(SHAPES, TILINGS * 2):
                    dtypes = {name: dtype for name in (*spec.inputs, *spec.outputs)}
                    template = [("T", dtype), ("OUT", out_features), ("IN", in_features), *tiling.template()]
                    if packed:
                        dtypes["w"] = mx.uint32
                        template.append(("GROUP", 64))
                    if row.endswith("_glu"):
                        template.append(("UP_AT", in_features + 16))  # a fused gate/up row, padded
                    elif row != "input":
                        template.append(("EPS", 925353388))  # 1e-5's float bits
                    function = f"custom_kernel_{spec.name}"
                    ok, log = compile_source(nvrtc, full_source(spec, function, dtypes, template), function, options)
                    label = f"{spec.name} {dtype} {out_features}x{in_features} {tiling}"
                    print(f"{'ok  ' if ok else 'FAIL'} {label}", flush=True)
                    if not ok:
                        failed += 1
                        print(log)
    print(f"{failed} of the kernels failed to compile" if failed else "every kernel compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
