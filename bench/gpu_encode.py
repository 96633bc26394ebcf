"""What one graph node costs the host on MLX's GPU backend, by kind: a chain of N nodes
of one kind is built (Python, ``mx`` calls) and evaluated (MLX encodes each node), and the
two are timed apart, per node. A decode step at B=1 is bound by this host work, so the
figures say which nodes are worth removing from it (views such as reshape, or kernels).

    python3 bench/gpu_encode.py --wheels .whl [--nodes 400] [--repeats 30]

Kinds: ``reshape`` / ``expand_squeeze`` / ``transpose`` / ``slice`` (views: no kernel),
``add`` (one elementwise kernel each), ``gemv`` (a [1, 256] @ [256, 256].T bf16 each; ``kernel_gemv``
the same through ``runtime/mlx/gemv.py``'s custom kernel),
``slice_update`` (a one-row write at a static offset each), ``compiled`` (an ``mx.compile``d
silu-multiply: one fused kernel), and the fast ops a decode layer issues: ``rms_norm``,
``rope`` (offsets in an array) and ``sdpa`` (one query over 128 keys). Each eval ends the chain
in one ``+ 0`` kernel so a view chain has something to run. Run it once per MLX setting
(``MLX_USE_CUDA_GRAPHS=0``, ``MLX_MAX_OPS_PER_BUFFER``) to see what they change.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable


def chains(mx, kernel_gemv: Callable) -> dict[str, Callable]:
    """Each kind: ``(state, n) -> array``, a chain of n nodes of that kind."""
    def reshape(s, n):
        y = s["x"]
        for i in range(n):
            y = y.reshape((16, 16) if i % 2 == 0 else (256,))
        return y

    def expand_squeeze(s, n):
        y = s["x"]
        for i in range(n):
            y = mx.expand_dims(y, 0) if i % 2 == 0 else mx.squeeze(y, 0)
        return y

    def transpose(s, n):
        y = s["m"]
        for _ in range(n):
            y = mx.transpose(y)
        return y

    def slice_(s, n):
        y = s["long"]
        for _ in range(n):
            y = y[:-1]
        return y[:256]

    def add(s, n):
        y = s["x"]
        for _ in range(n):
            y = y + s["x"]
        return y

    def gemv(s, n):
        y = s["row"]
        for _ in range(n):
            y = y @ s["w"].T
        return y

    def kernel_gemv_(s, n):
        y = s["row"]
        for _ in range(n):
            y = kernel_gemv(y, s["w"])
        return y

    def slice_update(s, n):
        pool = mx.array(s["pool"])  # a new node over the same data: __setitem__ rebinds it
        for i in range(n):
            pool[i % 64:i % 64 + 1] = s["row"]
        return pool

    silu_mul = mx.compile(lambda a, b: a * mx.sigmoid(a) * b)

    def compiled(s, n):  # one fused elementwise kernel each, as mx.compile leaves them
        y = s["x"]
        for _ in range(n):
            y = silu_mul(y, s["x"])
        return y

    def rms_norm(s, n):
        y = s["row"]
        for _ in range(n):
            y = mx.fast.rms_norm(y, s["x"], 1e-5)
        return y

    def rope(s, n):  # offsets in an array, as a decode step passes its positions
        y = s["heads"]
        for _ in range(n):
            y = mx.fast.rope(y, 64, traditional=False, base=10000.0, scale=1.0, offset=s["offset"])
        return y

    def sdpa(s, n):  # one query over 128 keys: MLX's vector kernel
        y = s["q"]
        for _ in range(n):
            y = mx.fast.scaled_dot_product_attention(y, s["k"], s["k"], scale=0.125)
        return y

    return {"reshape": reshape, "expand_squeeze": expand_squeeze, "transpose": transpose,
            "slice": slice_, "add": add, "gemv": gemv,
            "kernel_gemv": kernel_gemv_, "slice_update": slice_update,
            "compiled": compiled, "rms_norm": rms_norm, "rope": rope, "sdpa": sdpa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, help="install MLX from these wheels (cuda.part.NN, mlx) first")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_decode"), help="scratch folder")
    parser.add_argument("--nodes", type=int, default=400, help="nodes per chain")
    parser.add_argument("--repeats", type=int, default=30, help="timed chains per kind (median)")
    args = parser.parse_args()
    from gpu_setup import install_mlx, project_root

    if args.wheels:
        install_mlx(args.wheels, args.site)
    sys.path[:0] = [str(args.site), str(project_root(args.work / "src"))]
    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
    import mlx.core as mx

    from mlx_pte.runtime.mlx.gemv import gemv

    state = {"x": mx.ones((256,), mx.bfloat16), "m": mx.ones((16, 16), mx.bfloat16),
             "row": mx.ones((1, 256), mx.bfloat16), "w": mx.ones((256, 256), mx.bfloat16),
             "pool": mx.zeros((64, 256), mx.bfloat16), "long": mx.ones((256 + args.nodes,), mx.bfloat16),
             "heads": mx.ones((1, 4, 1, 64), mx.bfloat16), "offset": mx.array([7]),
             "q": mx.ones((1, 4, 1, 64), mx.bfloat16), "k": mx.ones((1, 4, 128, 64), mx.bfloat16)}
    mx.eval(*state.values())
    print(f"MLX {mx.__version__} on {mx.default_device()}; {args.nodes} nodes a chain, "
          f"median of {args.repeats}")
    print(f"  {'kind':<16} {'build us/node':>14} {'eval us/node':>13}")
    for kind, chain in chains(mx, gemv).items():
        builds, evals = [], []
        for repeat in range(args.repeats + 3):
            t0 = time.perf_counter()
            out = chain(state, args.nodes) + 0
            t1 = time.perf_counter()
            mx.eval(out)
            t2 = time.perf_counter()
            if repeat >= 3:  # the first chains compile kernels
                builds.append(t1 - t0)
                evals.append(t2 - t1)
        # The eval includes the device's run of the chain; for views that is one kernel.
        print(f"  {kind:<16} {statistics.median(builds) / args.nodes * 1e6:>14.2f} "
              f"{statistics.median(evals) / args.nodes * 1e6:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
