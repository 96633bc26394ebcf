"""Run ``runtime/mlx/gemv_source.py``'s CUDA kernels on the CPU, one OS thread per CUDA thread.

The kernels' own sources (``gemv_source.kernel_source``) are compiled by the host's C++
compiler inside a function with the parameters ``mx.fast.cuda_kernel`` gives them (each input's
pointer, then the strides and ndim its source reads, then the outputs) and the template
arguments as constants, as MLX 0.32 assembles them (``mlx/backend/cuda/custom_kernel.cpp``).
What CUDA provides is emulated:

- ``threadIdx``/``blockIdx``: a block's threads are real threads; blocks run one after
  another, so ``__shared__`` (a function-local static) is the running block's;
- ``__syncthreads`` is a barrier of the block, ``__shfl_xor_sync`` one of the warp through
  a slot per lane;
- ``__nv_bfloat16`` and ``__half`` convert to and from float as CUDA's do (round to
  nearest even);
- each input is copied to a buffer whose address has the offset from a 16-byte boundary it
  has on the GPU (MLX's CUDA buffers start 256-byte aligned, its CPU buffers 8 bytes past a
  16-byte boundary), strides kept, so the kernels choose the branches they choose there;
- every 16-byte ``PteChunk`` load checks its address is 16-byte aligned, which the GPU
  requires and x86 does not.

So the kernels' indexing, branches, packing and rounding are checked on a machine with no
GPU; their speed, and NVRTC's acceptance of the source (``scripts/check_cuda_kernels.py``),
are not.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import mlx.core as mx

from mlx_pte.runtime.mlx import gemv_source

COMPILER = shutil.which("g++")
# How each dtype's elements are held in numpy (bfloat16 as its bits).
NUMPY_TYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.uint32: np.uint32}
GPU_ALIGNMENT = 256

# The header's 16-byte chunk, with its loads checked for alignment. Kept in step with
# gemv_source.HEADER by `emulated_header`, which refuses a header it does not know.
_CHUNK = "struct alignas(16) PteChunk { unsigned int word[4]; };"
_CHECKED_CHUNK = """struct alignas(16) PteChunk {
    unsigned int word[4];
    PteChunk() = default;
    PteChunk(const PteChunk& other) {
        pte_check_aligned(&other);
        for (int k = 0; k < 4; ++k) { word[k] = other.word[k]; }
    }
    PteChunk& operator=(const PteChunk& other) = default;
};"""

# The threads, barriers and checks, built once per process; each kernel's program declares
# them (_DECLARATIONS) and so compiles without the thread library's headers.
_RUNTIME = r"""
#include <atomic>
#include <barrier>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

extern "C" {
struct PteIndex { unsigned int x = 0, y = 0, z = 0; };
}

namespace {
thread_local PteIndex thread_index, block_index;
std::atomic<int> chunk_loads{0}, misaligned_loads{0};

// The running block's barriers (blocks run one at a time).
struct Block {
    explicit Block(int threads) : all(threads), slots(threads) {
        for (int w = 0; w < threads / 32; ++w) { warps.push_back(std::make_unique<std::barrier<>>(32)); }
    }
    std::barrier<> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> slots;
};
Block* block = nullptr;
}  // namespace

extern "C" {
PteIndex* pte_thread_index() { return &thread_index; }
PteIndex* pte_block_index() { return &block_index; }

void pte_sync_block() { block->all.arrive_and_wait(); }

// Lane t reads lane t ^ offset's value: every lane writes its slot, then reads its partner's.
float pte_shfl_xor(float value, int offset) {
    const int t = thread_index.x;
    std::barrier<>& warp = *block->warps[t / 32];
    block->slots[t] = value;
    warp.arrive_and_wait();
    const float other = block->slots[(t & ~31) | ((t % 32) ^ offset)];
    warp.arrive_and_wait();
    return other;
}

void pte_check_aligned(const void* p) {
    chunk_loads += 1;
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) { misaligned_loads += 1; }
}

int pte_chunk_loads() { return chunk_loads.load(); }

// Runs body on `threads` threads for each of `blocks` blocks; returns the misaligned
// 16-byte loads.
int pte_run(int blocks, int threads, void (*body)(void*), void* context) {
    Block running(threads);
    block = &running;
    chunk_loads = 0;
    misaligned_loads = 0;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            thread_index.x = t;
            for (int b = 0; b < blocks; ++b) {
                block_index.x = b;
                body(context);
                running.all.arrive_and_wait();  // the next block's shared memory starts after
            }
        });
    }
    for (auto& thread : pool) { thread.join(); }
    block = nullptr;
    return misaligned_loads.load();
}
}
"""

_DECLARATIONS = r"""
#include <cmath>
#include <cstdint>
#include <cstring>

extern "C" {
struct PteIndex { unsigned int x, y, z; };
PteIndex* pte_thread_index();
PteIndex* pte_block_index();
void pte_sync_block();
float pte_shfl_xor(float value, int offset);
void pte_check_aligned(const void* p);
int pte_run(int blocks, int threads, void (*body)(void*), void* context);
}

struct __nv_bfloat16 {
    uint16_t bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {  // round to nearest even, as __float2bfloat16
        uint32_t u;
        std::memcpy(&u, &f, 4);
        u += 0x7fffu + ((u >> 16) & 1u);
        bits = static_cast<uint16_t>(u >> 16);
    }
    operator float() const {
        const uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

struct __half {
    _Float16 value;
    __half() = default;
    __half(float f) : value(static_cast<_Float16>(f)) {}
    operator float() const { return static_cast<float>(value); }
};

#define threadIdx (*pte_thread_index())
#define blockIdx (*pte_block_index())
#define __shared__ static

inline void __syncthreads() { pte_sync_block(); }
inline float __shfl_xor_sync(unsigned int, float value, int offset) { return pte_shfl_xor(value, offset); }

inline float __int_as_float(int bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
"""


def available() -> bool:
    return COMPILER is not None


def emulated_header() -> str:
    """gemv_source.HEADER for the host compiler: CUDA's type headers are the prelude's, and the
    chunk checks its loads."""
    lines = [line for line in gemv_source.HEADER.splitlines() if line.strip()]
    includes = [line for line in lines if line.startswith("#include")]
    rest = [line for line in lines if not line.startswith("#include")]
    if set(includes) != {"#include <cuda_bf16.h>", "#include <cuda_fp16.h>"} or rest != [_CHUNK]:
        raise AssertionError("gemv_source.HEADER changed: bring tests/runtime/mlx/cuda_emulation.py's copy in step")
    return _CHECKED_CHUNK


# How the parameters besides the arrays' pointers are passed here: (C++ type, the field of
# the launch's Arguments that holds one per array).
_EMULATED_PARAMETERS = {"shape": ("const int32_t*", "shapes"), "strides": ("const int64_t*", "strides"),
                        "ndim": ("int", "ndims")}


def _program(spec: gemv_source.KernelSource, dtypes: dict[str, mx.Dtype],
             template: Sequence[tuple[str, object]]) -> str:
    params, args = [], []
    index = -1  # of the array the parameter belongs to
    for name, kind in spec.parameters():
        if kind in ("input", "output"):
            index += 1
            ctype = gemv_source.CUDA_TYPES[dtypes[name]]
            const = "const " if kind == "input" else ""
            params.append(f"{const}{ctype}* {name}")
            args.append(f"static_cast<{const}{ctype}*>(a.data[{index}])")
        else:
            ctype, field = _EMULATED_PARAMETERS[kind]
            params.append(f"{ctype} {name}")
            args.append(f"a.{field}[{index}]")
    constants = gemv_source.template_declarations(list(template), "    ")
    return (
        _DECLARATIONS + emulated_header() + "\n\n"
        + f"static void kernel({', '.join(params)}) {{\n{constants}{spec.source}\n}}\n\n"
        + "struct Arguments { void* const* data; const int64_t* const* strides; const int32_t* const* shapes;"
        + " const int* ndims; };\n\n"
        + "static void body(void* context) {\n"
        + "    const Arguments& a = *static_cast<const Arguments*>(context);\n"
        + f"    kernel({', '.join(args)});\n}}\n\n"
        + 'extern "C" int pte_launch(void* const* data, const int64_t* const* strides, const int32_t* const* shapes,\n'
        + "                          const int* ndims, int blocks, int threads) {\n"
        + "    Arguments a{data, strides, shapes, ndims};\n"
        + "    return pte_run(blocks, threads, body, &a);\n}\n"
    )


_FLAGS = ["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas"]
_libraries: dict[str, ctypes.CDLL] = {}


@functools.cache
def _build_dir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="mlx-pte-cuda-emulation-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _compiled(program: str, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
    """``program`` built and loaded once per process."""
    key = hashlib.sha256(program.encode()).hexdigest()[:24]
    if key not in _libraries:
        source, library = _build_dir() / f"{key}.cpp", _build_dir() / f"{key}.so"
        source.write_text(program)
        built = subprocess.run([COMPILER, *_FLAGS, "-o", str(library), str(source)], capture_output=True, text=True)
        if built.returncode:
            raise RuntimeError(f"{COMPILER} could not build {source}:\n{built.stderr}")
        _libraries[key] = ctypes.CDLL(str(library), mode=mode)
    return _libraries[key]


def _runtime() -> ctypes.CDLL:
    """The threads and barriers, loaded globally so each kernel's library links to them."""
    return _compiled(_RUNTIME, ctypes.RTLD_GLOBAL)


@functools.cache
def _base_residue() -> int:
    """Where MLX's CPU buffers start relative to a 16-byte boundary (the same for all)."""
    residues = set()
    with mx.stream(mx.cpu):
        for n in (1, 7, 100, 4096):
            a = mx.zeros((n,), mx.float32) + 1
            mx.eval(a)
            residues.add(np.asarray(a).ctypes.data % 16)
    if len(residues) != 1:
        raise AssertionError(f"MLX's CPU buffers start at varying offsets from 16 bytes: {residues}")
    return residues.pop()


def _as_on_gpu(a: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """(a's elements as numpy, strides kept, at an address with the 16-byte offset a has on
    the GPU; the buffer holding them). a's strides must be non-negative."""
    mx.eval(a)
    view = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    if any(s < 0 for s in view.strides):
        raise ValueError("negative strides are not emulated")
    extent = sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + view.itemsize if view.size else 0
    offset = (view.ctypes.data - _base_residue()) % 16
    buffer = np.zeros(extent + offset + GPU_ALIGNMENT, np.uint8)
    start = (-buffer.ctypes.data) % GPU_ALIGNMENT + offset
    buffer[start:start + extent] = np.frombuffer(ctypes.string_at(view.ctypes.data, extent), np.uint8)
    placed = np.lib.stride_tricks.as_strided(buffer[start:].view(view.dtype), view.shape, view.strides)
    return placed, buffer


def _gpu_buffer(shape: Sequence[int], dtype: mx.Dtype) -> tuple[np.ndarray, np.ndarray]:
    """A fresh row-contiguous output at a 256-byte boundary, filled with NaN bit patterns so
    an element the kernel does not write shows."""
    itemsize = np.dtype(NUMPY_TYPES[dtype]).itemsize
    count = int(np.prod(shape)) if shape else 1
    buffer = np.full(count * itemsize + GPU_ALIGNMENT, 0xFF, np.uint8)
    start = (-buffer.ctypes.data) % GPU_ALIGNMENT
    return buffer[start:start + count * itemsize].view(NUMPY_TYPES[dtype]).reshape(shape), buffer


@dataclass
class Launch:
    """What the last emulated launch did: its 16-byte chunk loads (0: only the strided loops ran)."""

    chunk_loads: int = 0


last_launch = Launch()


class MisalignedLoad(AssertionError):
    """A kernel loaded a 16-byte chunk from an address the GPU would fault on."""


def cuda_kernel(name: str, input_names: list[str], output_names: list[str], source: str, header: str = "",
                ensure_row_contiguous: bool = True) -> Callable:
    """What ``mx.fast.cuda_kernel`` returns, run by this emulation on the CPU."""
    if header != gemv_source.HEADER or ensure_row_contiguous:
        raise ValueError("the emulation runs gemv_source.py's kernels only (their header, strides as given)")
    spec = gemv_source.KernelSource(name, tuple(input_names), tuple(output_names), source)

    def call(*, inputs: list[mx.array], template: list[tuple[str, object]], grid: tuple[int, int, int],
             threadgroup: tuple[int, int, int], output_shapes: list, output_dtypes: list) -> list[mx.array]:
        dtypes = {**dict(zip(spec.inputs, (a.dtype for a in inputs))), **dict(zip(spec.outputs, output_dtypes))}
        runtime = _runtime()
        lib = _compiled(_program(spec, dtypes, template))
        placed = [_as_on_gpu(a) for a in inputs]
        outputs = [_gpu_buffer(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        arrays = [a for a, _ in placed] + [a for a, _ in outputs]
        strides = [np.array([s // a.itemsize for s in a.strides] or [0], np.int64) for a in arrays]
        shapes = [np.array(a.shape or (1,), np.int32) for a in arrays]
        pointers = lambda items: (ctypes.c_void_p * len(items))(*(i.ctypes.data for i in items))  # noqa: E731
        threads = min(threadgroup[0], grid[0])
        if grid[1:] != (1, 1) or threadgroup[1:] != (1, 1) or threads % 32:
            raise ValueError("the emulation runs one-dimensional grids of whole warps")
        misaligned = lib.pte_launch(pointers(arrays), pointers(strides), pointers(shapes),
                                    (ctypes.c_int * len(arrays))(*(a.ndim for a in arrays)),
                                    -(-grid[0] // threadgroup[0]), threads)
        last_launch.chunk_loads = runtime.pte_chunk_loads()
        if misaligned:
            raise MisalignedLoad(f"{name}: {misaligned} 16-byte loads from unaligned addresses")
        results = []
        for (array, _), dtype in zip(outputs, output_dtypes):
            result = mx.array(np.ascontiguousarray(array))
            results.append(result.view(mx.bfloat16) if dtype == mx.bfloat16 else result)
        return results

    return call
