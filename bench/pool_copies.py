"""Does a pipelined decode step copy whole K/V pools? Decode tok/s of the same prompt with
the pools allocated at 512 slots and at 32,768 slots, interleaved round by round.

A slice update writes in place only when MLX may donate the pool's buffer: no other array
may hold it. A step is encoded while the previous one still runs, and that step's
attention read a view of the same buffer, which MLX keeps alive (as a temporary of the
kernel that reads it) until the kernel completes; if that blocks the donation, every
write copies its whole pool, and decode slows with the pools' size. Equal rates: no copy.

    python3 bench/pool_copies.py .gpu/llama1b-bf16.pte.gz [--site /tmp/site] [--rounds 3] [--launch thread]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

SLOTS = (512, 32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pte", type=Path, help="an exported .pte or .pte.gz")
    parser.add_argument("--site", type=Path, help="where MLX's wheels were installed (gpu_decode.py --site)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/pool_copies"), help="scratch folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launch", default="inline", choices=("inline", "thread"))
    args = parser.parse_args()
    from gpu_setup import gunzip, project_root  # bench/, beside this script

    args.work.mkdir(parents=True, exist_ok=True)
    # The device machine has no install of mlx_pte: gpu_setup lays this checkout out as one.
    sys.path[:0] = [str(p) for p in (args.site, project_root(args.work / "src")) if p is not None]
    import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
    from mlx_pte import Session, generate, load

    program = load(gunzip(args.pte, args.work))
    prompt = list(range(1, 129))
    rates: dict[int, list[float]] = {slots: [] for slots in SLOTS}
    for number in range(args.rounds):
        for slots in SLOTS:
            session = Session(program, capacity=slots, initial_capacity=slots, launch=args.launch)
            generate(session, prompt, max_new_tokens=8, stop_on_eos=False)  # compiles, allocates
            rate = generate(session, prompt, max_new_tokens=128, stop_on_eos=False).decode_tps
            rates[slots].append(rate)
            print(f"round {number + 1}: {slots} slots: decode {rate:.1f} tok/s", flush=True)
    ratios = [big / small for small, big in zip(rates[SLOTS[0]], rates[SLOTS[1]])]
    print(f"decode at {SLOTS[1]} slots / at {SLOTS[0]} slots, median of per-round ratios: "
          f"{statistics.median(ratios):.2f} (1.00: no copy of whole pools)")


if __name__ == "__main__":
    main()
