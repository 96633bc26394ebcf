"""GEMV bandwidth on the GPU for a Llama-3.2-1B decode step's shapes (B=1, bfloat16, the
fused projections), MLX's ``x @ W.T`` (``gemv_single``) against the project's kernel
(``runtime/mlx/gemv.py``) at each tiling given, checked against MLX's result; ``--torch``
adds cuBLAS through torch and ``--q4`` MLX's ``quantized_matmul`` (4 bits, group 64)
against the kernel on the same packed weights. Where a norm feeds the projection, MLX's
residual add, ``rms_norm`` and GEMV are timed against the kernel that fuses them
(``norm_gemv``); where the MLP's GLU feeds it (the down projection), MLX's split of the
fused gate/up row, GLU and GEMV against the kernel that builds the GLU's row (``glu_gemv``).

    python3 bench/gpu_gemv.py --wheels .whl [--tilings 8x1x4,16x1x4x4] [--shapes 2048x8192] [--torch] [--q4] \
        [--kernel-time]

Each timed eval runs one GEMV per weight copy, enough distinct copies that the weights
(not the 50 MB L2) are what is read; time per GEMV = the eval's time / copies (median
over repeats), so the figure includes MLX's encoding of each kernel and the launch gaps
inside one CUDA graph (what a decode step sees), not the Python that builds the calls.
GB/s counts the weight bytes (and x, y) read or written once; the peak is the GPU's memory
bandwidth (H100 SXM 3,350 GB/s, H200 4,800 GB/s, from the device's name unless ``--peak``
says). With ``--kernel-time`` (needs torch), one more eval of each row runs under
``torch.profiler`` (CUPTI records MLX's kernels too) and the row also gives its kernels' own
time per GEMV, without the encoding and launch gaps: what the GPU spends once the host
keeps up, and the figure that tells tilings apart where the eval's time is the host's.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (out, in): q/k/v fused, o, gate/up fused, down, the LM head.
SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048))
NORM_SITES = ((3072, 2048), (16384, 2048))  # the projections a norm (and residual add) feeds
GLU_SITES = ((2048, 8192),)  # the projection act(gate) * up feeds
WORKING_SET = 1 << 30  # bytes of distinct weights per timed eval: far past L2
PEAKS = {"H100": 3350.0, "H200": 4800.0}  # GB/s of HBM, by a word of the device's name


def peak_bandwidth() -> float:
    """The memory bandwidth of the GPU nvidia-smi names (GB/s), or the H200's if unknown."""
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    return next((gbs for word, gbs in PEAKS.items() if word in name), PEAKS["H200"])


def time_mlx(fn, xs, ws, repeats: int, kernel_time: bool) -> tuple[float, float]:
    """Median seconds per GEMV over ``repeats`` evals of one GEMV per weight copy, and with
    ``kernel_time`` the seconds its kernels ran per GEMV in one more eval, profiled (else
    NaN); both NaN (and the error on stderr) where the GPU refuses the kernel, so the other
    rows still run."""
    import mlx.core as mx

    try:
        mx.eval([fn(x, w) for x, w in zip(xs, ws)])  # warm-up: JIT and graph capture
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return float("nan"), float("nan")
    times = []
    for _ in range(repeats):
        # Built before the clock starts: mx.compile rebuilds a captured segment's graph
        # without running its Python, so a decode step pays MLX's encoding and the kernel.
        outputs = [fn(x, w) for x, w in zip(xs, ws)]
        t0 = time.perf_counter()
        mx.eval(outputs)
        times.append((time.perf_counter() - t0) / len(ws))
    if not kernel_time:
        return statistics.median(times), float("nan")
    from gpu_profile import profiled

    outputs = [fn(x, w) for x, w in zip(xs, ws)]
    micros = sum(profiled(lambda: (mx.eval(outputs), mx.synchronize())).micros.values())
    if not micros:
        print("warning: the profiler recorded no CUDA kernels (is CUPTI available?)", file=sys.stderr, flush=True)
    return statistics.median(times), micros / 1e6 / len(ws) if micros else float("nan")


def relative_error(want, fn, *args) -> str:
    """The largest error of ``fn(*args)`` relative to the largest |want|, as a label ("failed",
    and the error on stderr, where the GPU refuses the kernel)."""
    import mlx.core as mx

    try:
        got = fn(*args).astype(mx.float32)
        return f"e{mx.max(mx.abs(want - got)).item() / max(mx.max(mx.abs(want)).item(), 1e-6):.0e}"
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return "failed"


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


def parse_tilings(text: str):
    """``WARPSxROWSxUNROLL[xSPLIT],...`` as the kernel's tilings."""
    from mlx_pte.runtime.mlx.gemv import Tiling

    return [Tiling.parse(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, help="MLX CUDA, mlx and mlx-lm wheels to install first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where wheels are installed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_decode"), help="scratch folder")
    parser.add_argument("--peak", type=float, help="the GPU's memory bandwidth in GB/s (default: from its name)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tilings", default="8x1x4,16x1x4,4x2x4,8x2x4,16x1x4x4",
                        help="the kernel's tilings, WARPSxROWSxUNROLL[xSPLIT], comma-separated ('' for none)")
    parser.add_argument("--shapes", default=",".join(f"{o}x{i}" for o, i in SHAPES),
                        help="the weights' shapes, OUTxIN, comma-separated (default: the model's five)")
    parser.add_argument("--torch", action="store_true", help="also torch's cuBLAS GEMV")
    parser.add_argument("--kernel-time", action="store_true",
                        help="also each row's kernel time per GEMV, from one eval under torch.profiler")
    parser.add_argument("--q4", action="store_true", help="also MLX's quantized_matmul, 4 bits, group 64, and the "
                        "kernel on the same packed weights (each tiling, and with the fused norm)")
    args = parser.parse_args()
    from gpu_setup import install_mlx, project_root

    if args.wheels:
        install_mlx(args.wheels, args.site)
    sys.path[:0] = [str(args.site), str(project_root(args.work / "src"))]
    if args.torch or args.kernel_time:
        import torch  # noqa: F401  (before MLX, as gpu_decode.py does)
    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
    import mlx.core as mx

    from gpu_setup import check_mlx_device
    from mlx_pte.interpreter.handlers import HANDLERS
    from mlx_pte.runtime.mlx import gemv

    device = check_mlx_device(args.wheels is not None)
    peak = args.peak or peak_bandwidth()
    tilings = parse_tilings(args.tilings)
    print(f"MLX {mx.__version__} on {device}; GB/s against {peak:.0f}")
    print(f"{'out x in':>14} {'copies':>6} {'impl':<24} {'us':>8} {'GB/s':>8} {'of peak':>8} {'kernel us':>9} "
          f"{'GB/s':>8} {'of peak':>8}")

    def timed(fn, xs_, ws_) -> tuple[float, float]:
        return time_mlx(fn, xs_, ws_, args.repeats, args.kernel_time)

    for out, inn in (tuple(int(n) for n in part.split("x")) for part in args.shapes.split(",") if part):
        nbytes = 2 * (out * inn + out + inn)
        copies = max(1, min(64, WORKING_SET // (2 * out * inn)))
        ws = [mx.random.normal((out, inn)).astype(mx.bfloat16) for _ in range(copies)]
        xs = [mx.random.normal((1, inn)).astype(mx.bfloat16) for _ in range(copies)]
        mx.eval(ws, xs)
        rows = [("mlx x@W.T", timed(lambda x, w: x @ w.T, xs, ws), nbytes)]
        for tiling in tilings:
            kernel = lambda x, w, t=tiling: gemv.gemv(x, w, t)  # noqa: E731
            error = relative_error((xs[0] @ ws[0].T).astype(mx.float32), kernel, xs[0], ws[0])
            rows.append((f"{tiling} ({error})", timed(kernel, xs, ws), nbytes))
        if (out, inn) in NORM_SITES:  # a residual add and an rms_norm before the GEMV
            rs = [mx.random.normal((1, inn)).astype(mx.bfloat16) for _ in range(copies)]
            g = mx.ones((inn,), mx.bfloat16)
            mx.eval(rs)
            pairs = list(zip(xs, rs))

            def mlx_ops(pair, w):
                return mx.fast.rms_norm(pair[0] + pair[1], g, 1e-5) @ w.T

            def fused(pair, w, tiling=None):
                return gemv.norm_gemv(pair[0], g, 1e-5, w, residual=pair[1], layout=tiling)[0]

            rows.append(("mlx add+norm+gemv", timed(mlx_ops, pairs, ws), nbytes))
            for tiling in tilings:
                kernel = lambda pair, w, t=tiling: fused(pair, w, t)  # noqa: E731
                rows.append((f"add_norm {tiling}", timed(kernel, pairs, ws), nbytes))
        if (out, inn) in GLU_SITES:  # the fused gate/up row, its halves read by the glu
            gate_ups = [mx.random.normal((1, 2 * inn)).astype(mx.bfloat16) for _ in range(copies)]
            mx.eval(gate_ups)
            glu_attrs = {"activation": "silu", "width": inn}

            def glu_row(gate_up):
                return HANDLERS["glu"]([gate_up, None], glu_attrs, None)

            def glu_kernel(gate_up, w, tiling=None):
                return gemv.glu_gemv(gate_up, None, inn, "silu", w, tiling)

            want = (glu_row(gate_ups[0]) @ ws[0].T).astype(mx.float32)
            rows.append(("mlx glu+gemv", timed(lambda gu, w: glu_row(gu) @ w.T, gate_ups, ws), nbytes))
            for tiling in tilings:  # the row's prologue is built once a block: tilings weigh differently here
                kernel = lambda gu, w, t=tiling: glu_kernel(gu, w, t)  # noqa: E731
                error = relative_error(want, kernel, gate_ups[0], ws[0])
                rows.append((f"glu {tiling} ({error})", timed(kernel, gate_ups, ws), nbytes))
        if args.torch:  # timed by CUDA events around the launches: no host work to take out
            rows.append(("torch cuBLAS", (time_torch(out, inn, copies, args.repeats), float("nan")), nbytes))
        if args.q4:
            packed = [mx.quantize(w, group_size=64, bits=4) for w in ws]
            mx.eval(packed)
            qbytes = out * inn // 2 + 2 * 2 * (out * inn // 64) + 2 * (out + inn)

            def qmm(x, p):
                return mx.quantized_matmul(x, *p, transpose=True, group_size=64, bits=4)

            rows.append(("mlx q4 g64", timed(qmm, xs, packed), qbytes))
            weights4 = [gemv.Packed4(*p, 64) for p in packed]
            want = qmm(xs[0], packed[0]).astype(mx.float32)
            for tiling in tilings:
                kernel = lambda x, w, t=tiling: gemv.gemv(x, w, t)  # noqa: E731
                error = relative_error(want, kernel, xs[0], weights4[0])
                rows.append((f"q4 {tiling} ({error})", timed(kernel, xs, weights4), qbytes))
            if (out, inn) in NORM_SITES:
                rows.append(("mlx add+norm+q4", timed(lambda pair, p: qmm(mx.fast.rms_norm(
                    pair[0] + pair[1], g, 1e-5), p), pairs, packed), qbytes))  # fmt: skip
                for tiling in tilings:
                    kernel = lambda pair, w, t=tiling: fused(pair, w, t)  # noqa: E731
                    rows.append((f"q4 add_norm {tiling}", timed(kernel, pairs, weights4), qbytes))
            if (out, inn) in GLU_SITES:
                rows.append(("mlx glu+q4", timed(lambda gu, p: qmm(glu_row(gu), p), gate_ups, packed),
                             qbytes))
                for tiling in tilings:
                    kernel = lambda gu, w, t=tiling: glu_kernel(gu, w, t)  # noqa: E731
                    name = f"q4 glu {tiling}"
                    rows.append((name, timed(kernel, gate_ups, weights4), qbytes))
        for name, (seconds, kernel_seconds), moved in rows:
            rate, kernel_rate = moved / seconds / 1e9, moved / kernel_seconds / 1e9
            print(f"{f'{out}x{inn}':>14} {copies:>6} {name:<24} {seconds * 1e6:>8.1f} {rate:>8.0f} "
                  f"{rate / peak:>8.0%} {kernel_seconds * 1e6:>9.1f} {kernel_rate:>8.0f} {kernel_rate / peak:>8.0%}",
                  flush=True)
        del ws, xs


if __name__ == "__main__":
    main()
