"""What one batched decode step's K/V writes cost, by the form of the write.

    python3 bench/kv_write.py [--site /tmp/site] [--rows 64 --batch 32 --layers 16]

A step of ``--batch`` sequences (one token each, rows 0..B-1, random slots) writes K and
V into every layer's pools ``[rows, heads, slots, dim]`` (Llama-3.2-1B's 8 KV heads of 64,
bfloat16). K arrives as RoPE's output (contiguous ``[1, H, B, D]``), V as a transposed
view of the projection (``[1, B, H, D]`` seen as ``[1, H, B, D]``), as in the exported
graph. The forms:

  tokens   ``Pool.write`` with both indices tokens first: the values must be ``[B*H, D]``,
           a reshape that copies K (contiguous heads first)
  matched  ``Pool.write`` as the caches call it: K's index heads first, V's tokens first,
           so both reshapes are views
  scatter  one general scatter on (row, slot) with the values ``[B, H, D]`` as a strided
           view (measured slower on the H200: 0.89 ms and 160 kernels per step against
           0.44 ms and 48 for ``tokens``; it broadcasts its indices in kernels of its own)

Each form is checked against the first, then timed (median of ``--repeats`` steps, each
evaluated). With torch's profiler present (the GPU image), the kernels per step are
counted too (CUPTI records MLX's CUDA kernels).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", default=None, help="a folder holding MLX's CUDA install (bench/gpu_decode.py)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if not 0 < args.batch <= args.rows:
        parser.error(f"--batch must be 1..--rows ({args.rows}): each token writes its own row")
    if args.site:
        sys.path.insert(0, args.site)
    import numpy as np
    import mlx.core as mx

    heads, dim, dtype = 8, 64, mx.bfloat16
    rows_, slots_, batch = args.rows, args.slots, args.batch
    rng = np.random.default_rng(0)
    rows = mx.arange(batch, dtype=mx.int32)
    slots = mx.array(rng.integers(0, slots_, batch), mx.int32)
    k = mx.fast.rope(mx.random.normal((1, heads, batch, dim)).astype(dtype), dim, traditional=False,
                     base=500000.0, scale=1.0, offset=0)
    v = mx.random.normal((1, batch, heads * dim)).astype(dtype).reshape(1, batch, heads, dim).transpose(0, 2, 1, 3)
    from gpu_setup import project_root

    sys.path.insert(1, str(project_root(Path(tempfile.mkdtemp(prefix="kv_write-")))))
    from mlx_pte.runtime.mlx import Pool

    def pool_of(data: mx.array) -> Pool:
        pool = Pool(heads, dim, dtype, slots_, slots_, rows_)
        pool.data = data
        return pool

    probe = pool_of(mx.zeros((rows_, heads, slots_, dim), dtype))
    index = {order: probe.scatter_index(slots, rows, batch - 1, order) for order in (False, True)}
    mx.eval(k, v, index)

    def by_pool(heads_first_for_k: bool):
        def write(data: mx.array, update: mx.array) -> mx.array:
            heads_first = heads_first_for_k and update is k
            pool = pool_of(data)
            pool.write(index[heads_first], update, heads_first)
            return pool.data
        return write

    def scatter(pool: mx.array, update: mx.array) -> mx.array:
        fresh = pool[...]
        fresh[rows, :, slots] = update.squeeze(0).transpose(1, 0, 2)
        return fresh

    forms = {"tokens": by_pool(False), "matched": by_pool(True), "scatter": scatter}
    zeros = mx.zeros((rows_, heads, slots_, dim), dtype)
    results = {name: (form(zeros, k), form(zeros, v)) for name, form in forms.items()}
    mx.eval(results)
    for name, (rk, rv) in results.items():
        expected = results["tokens"]
        assert mx.array_equal(rk, expected[0]).item() and mx.array_equal(rv, expected[1]).item(), name
    print(f"forms agree; pools [{rows_}, {heads}, {slots_}, {dim}] bf16 x {2 * args.layers}, "
          f"{batch} tokens per step, on {mx.default_device()}")

    def stepper(form):
        pools = [mx.zeros((rows_, heads, slots_, dim), dtype) for _ in range(2 * args.layers)]
        mx.eval(pools)

        def step() -> None:
            for i in range(args.layers):
                pools[2 * i] = form(pools[2 * i], k)
                pools[2 * i + 1] = form(pools[2 * i + 1], v)
            mx.eval(pools)
        return step

    steps = {name: stepper(form) for name, form in forms.items()}
    for step in steps.values():
        for _ in range(5):
            step()
    per_round: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.repeats):  # interleaved, one step of each form in turn
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            per_round[name].append(time.perf_counter() - t0)
    kernels = count_kernels(steps)
    print(f"{'form':<9} {'ms/step':>8} {'kernels/step':>13}  top kernels")
    for name in forms:
        counted = kernels.get(name)
        top = ", ".join(f"{k[:40]} x{c}" for k, c in counted.most_common(4)) if counted else "-"
        total = f"{sum(counted.values()):>13}" if counted else f"{'-':>13}"
        print(f"{name:<9} {1e3 * statistics.median(per_round[name]):>8.3f} {total}  {top}")


def count_kernels(steps: dict) -> dict[str, Counter]:
    """Kernel launches of one step of each form, by name; empty without torch's CUDA profiler."""
    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    out = {}
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        out[name] = Counter(e.name for e in prof.events()
                            if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))
    return out


if __name__ == "__main__":
    main()
