"""GEMV bandwidth on the GPU for a Llama-3.2-1B decode step's shapes (B=1, bfloat16), the
way the ``linear`` handler issues them (``x @ W.T``, W [out, in]), against the H200's
4.8 TB/s; with ``--custom``, a warp-per-row ``mx.fast.cuda_kernel`` GEMV in the same run,
checked against MLX's result, and with ``--torch``, cuBLAS through torch as a reference.
``--q4`` adds MLX's ``quantized_matmul`` (4 bits, group 64) at the same shapes.

    python3 bench/gpu_gemv.py --wheels .whl [--custom] [--torch] [--q4] [--peak 4800]

Each timed eval runs one GEMV per weight copy, enough distinct copies that the weights
(not the 50 MB L2) are what is read; time per GEMV = the eval's time / copies (median
over repeats), so the figure includes MLX's per-kernel launch gaps inside one CUDA graph
(what a decode step sees). GB/s counts the weight bytes (and x, y) read or written once.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

SHAPES = ((512, 2048), (2048, 2048), (8192, 2048), (2048, 8192), (128256, 2048))  # (out, in)
WORKING_SET = 1 << 30  # bytes of distinct weights per timed eval: far past L2

# One warp per output row; each lane reads 16 bytes (8 bf16) of W and x per iteration,
# accumulates in float, and the warp reduces by shuffles. IN is a template constant.
GEMV_SOURCE = """
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= OUT) return;
    const uint4* wv = reinterpret_cast<const uint4*>(w + (size_t)row * IN);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    float acc = 0.0f;
    #pragma unroll 4
    for (int i = lane; i < IN / 8; i += 32) {
        uint4 a = wv[i];
        uint4 b = xv[i];
        const __nv_bfloat162* ap = reinterpret_cast<const __nv_bfloat162*>(&a);
        const __nv_bfloat162* bp = reinterpret_cast<const __nv_bfloat162*>(&b);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            float2 fa = __bfloat1622float2(ap[j]);
            float2 fb = __bfloat1622float2(bp[j]);
            acc += fa.x * fb.x + fa.y * fb.y;
        }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) y[row] = __float2bfloat16(acc);
"""
ROWS_PER_BLOCK = 8  # warps per block


def custom_gemv():
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name="pte_gemv_bf16", input_names=["w", "x"], output_names=["y"],
                                 source=GEMV_SOURCE, header="#include <cuda_bf16.h>\n")

    def gemv(x, w):
        out, inn = w.shape
        return kernel(inputs=[w, x], template=[("OUT", out), ("IN", inn)], grid=(out * 32, 1, 1),
                      threadgroup=(32 * ROWS_PER_BLOCK, 1, 1), output_shapes=[(1, out)],
                      output_dtypes=[mx.bfloat16])[0]

    return gemv


def time_mlx(fn, xs, ws, repeats: int) -> float:
    """Median seconds per GEMV over ``repeats`` evals of one GEMV per weight copy."""
    import mlx.core as mx

    mx.eval([fn(x, w) for x, w in zip(xs, ws)])  # warm-up: JIT and graph capture
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn(x, w) for x, w in zip(xs, ws)])
        times.append((time.perf_counter() - t0) / len(ws))
    return statistics.median(times)


def time_torch(out: int, inn: int, copies: int, repeats: int) -> float:
    import torch

    ws = [torch.zeros(out, inn, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(1, inn, dtype=torch.bfloat16, device="cuda")
    for w in ws:
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for w in ws:
            torch.nn.functional.linear(x, w)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, help="MLX CUDA, mlx and mlx-lm wheels to install first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where wheels are installed")
    parser.add_argument("--peak", type=float, default=4800.0, help="the GPU's memory bandwidth in GB/s (H200: 4800)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--custom", action="store_true", help="also the mx.fast.cuda_kernel GEMV (checked against MLX)")
    parser.add_argument("--torch", action="store_true", help="also torch's cuBLAS GEMV")
    parser.add_argument("--q4", action="store_true", help="also MLX's quantized_matmul, 4 bits, group 64")
    args = parser.parse_args()
    if args.wheels:
        from gpu_decode import install_mlx

        install_mlx(args.wheels, args.site)
    sys.path.insert(0, str(args.site))
    if args.torch:
        import torch  # noqa: F401  (before MLX, as gpu_decode.py does)
    import mlx.core as mx

    from gpu_decode import check_mlx_device

    check_mlx_device(args.wheels is not None)
    gemv = custom_gemv() if args.custom else None
    print(f"MLX {mx.__version__} on {mx.default_device()}; GB/s against {args.peak:.0f}")
    print(f"{'out x in':>14} {'copies':>6} {'impl':<14} {'us':>8} {'GB/s':>8} {'of peak':>8}")
    for out, inn in SHAPES:
        nbytes = 2 * (out * inn + out + inn)
        copies = max(1, min(64, WORKING_SET // (2 * out * inn)))
        ws = [mx.random.normal((out, inn)).astype(mx.bfloat16) for _ in range(copies)]
        xs = [mx.random.normal((1, inn)).astype(mx.bfloat16) for _ in range(copies)]
        mx.eval(ws, xs)
        rows = [("mlx x@W.T", time_mlx(lambda x, w: x @ w.T, xs, ws, args.repeats), nbytes)]
        if gemv is not None:
            want, got = (xs[0] @ ws[0].T).astype(mx.float32), gemv(xs[0], ws[0]).astype(mx.float32)
            error = mx.max(mx.abs(want - got)).item() / max(mx.max(mx.abs(want)).item(), 1e-6)
            rows.append((f"custom (e{error:.0e})", time_mlx(gemv, xs, ws, args.repeats), nbytes))
        if args.torch:
            rows.append(("torch cuBLAS", time_torch(out, inn, copies, args.repeats), nbytes))
        if args.q4:
            packed = [mx.quantize(w, group_size=64, bits=4) for w in ws]
            mx.eval(packed)
            qbytes = out * inn // 2 + 2 * 2 * (out * inn // 64) + 2 * (out + inn)

            def qmm(x, p):
                return mx.quantized_matmul(x, *p, transpose=True, group_size=64, bits=4)

            rows.append(("mlx q4 g64", time_mlx(qmm, xs, packed, args.repeats), qbytes))
        for name, seconds, moved in rows:
            rate = moved / seconds / 1e9
            print(f"{f'{out}x{inn}':>14} {copies:>6} {name:<14} {seconds * 1e6:>8.1f} {rate:>8.0f} "
                  f"{rate / args.peak:>8.0%}", flush=True)
        del ws, xs


if __name__ == "__main__":
    main()
