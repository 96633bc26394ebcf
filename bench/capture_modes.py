"""Decode step time of one program run three ways, to choose how ``Session`` captures:

- ``walk``: the prepared steps walked op by op (``Session(capture=False)``);
- ``segments``: ``mx.compile``d segments between attention calls, the cache's own
  attention in between (``Session(capture=True)``);
- ``whole``: the whole step as one ``mx.compile``d function with fixed-size K/V buffers
  as explicit state, written with ``slice_update`` at an array offset and read whole
  through an array mask (the alternative design; single sequence, flat layers only, so a
  measurement, not a runtime path).

    .venv/bin/python bench/capture_modes.py MODEL.pte [--steps 64 --prompt 16 --repeats 3]

Each mode decodes greedily from the same prompt; the figure is the median ms per decode
step of the best repeat (the machine may be shared: repeats interleave the modes). The
``whole`` mode's tokens are checked against ``walk``'s.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core: fast BLAS)
import mlx.core as mx

from mlx_pte import load
from mlx_pte.interpreter.handlers import RunContext
from mlx_pte.interpreter.program import Program
from mlx_pte.interpreter.session import Session
from mlx_pte.ir.manifest import Manifest


class WholeStep:
    """One sequence decoded by a single compiled function per step (flat layers only).

    State: per cache layer a K and a V buffer [1, H, capacity, D]. Inputs per step:
    tokens, positions, rows, the write offset (int32 [1]) and the mask (bool [1, 1, T,
    capacity]: slots already written, causally); both come from the host's position.
    """

    def __init__(self, program: Program, capacity: int) -> None:
        manifest = Manifest.from_dict(program.manifest)
        if any(c.window for c in manifest.cache):
            raise SystemExit("the whole-step prototype handles flat layers only")
        dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[manifest.dtype]
        self.k = [mx.zeros((1, c.n_kv_heads, capacity, c.head_dim), dtype) for c in manifest.cache]
        self.v = [mx.zeros((1, c.n_kv_heads, capacity, c.v_head_dim), dtype) for c in manifest.cache]
        self.capacity = capacity
        self.position = 0
        self.program = program
        # Weights go in as inputs: MLX checks a compiled function's captured arrays per call.
        self.weight_slots = sorted(program.weights)
        self.weight_list = [program.weights[s] for s in self.weight_slots]
        self.step = mx.compile(self._step)

    def _step(self, weights, tokens, positions, rows, offset, mask, ks, vs):
        program = self.program
        values = list(program._weight_slots)
        for slot, w in zip(self.weight_slots, weights):
            values[slot] = w
        for slot, a in zip(program.graph.inputs, (tokens, positions, rows)):
            values[slot] = a
        ks, vs = list(ks), list(vs)
        ctx = RunContext()
        for step in program.steps:
            if step.op != "update_and_attend":
                step.run(values, ctx)
                continue
            q, k, v, _ = (values[s] for s in step.inputs)
            attrs = step.attrs_for(values)
            layer = attrs["cache_id"]
            ks[layer] = mx.slice_update(ks[layer], k.astype(ks[layer].dtype), offset, axes=(2,))
            vs[layer] = mx.slice_update(vs[layer], v.astype(vs[layer].dtype), offset, axes=(2,))
            out = mx.fast.scaled_dot_product_attention(q, ks[layer], vs[layer], scale=attrs["scale"], mask=mask)
            values[step.outputs[0]] = out.astype(q.dtype)
        return [values[s] for s in program.graph.outputs][0], ks, vs

    def forward(self, tokens: list[int] | mx.array) -> mx.array:
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        count = tokens.size
        pos = np.arange(self.position, self.position + count)
        slot = np.arange(self.capacity)
        mask = mx.array((slot[None, :] <= pos[:, None])[None, None])
        logits, self.k, self.v = self.step(
            self.weight_list, tokens.astype(mx.int64).reshape(1, count), mx.array(pos), mx.array([count - 1]),
            mx.array([self.position], mx.int32), mask, self.k, self.v,
        )
        self.position += count
        return logits


def generate_whole(program: Program, prompt: list[int], n: int, capacity: int) -> tuple[float, float]:
    """Prefill and decode tok/s of ``WholeStep`` timed like ``generate()``: prefill covers
    the prompt's forward and the first token, decode the remaining ``n - 1`` tokens."""
    whole = WholeStep(program, capacity)
    t0 = time.perf_counter()
    token = mx.argmax(whole.forward(prompt)[0]).reshape(1)
    mx.eval(token)
    t1 = time.perf_counter()
    for _ in range(n - 1):
        following = mx.argmax(whole.forward(token)[0]).reshape(1)
        mx.async_eval(following)
        token = following
    mx.eval(token)
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), (n - 1) / (t2 - t1)


def decode(forward, prompt: list[int], steps: int) -> tuple[list[float], list[float], list[int]]:
    """Per-step seconds (whole step, host graph building only) and tokens of a greedy
    decode, pipelined like ``generate``."""
    logits = forward(prompt)
    token = mx.argmax(logits[0]).reshape(1)
    times, host, tokens = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = forward(token)
        following = mx.argmax(logits[0]).reshape(1)
        host.append(time.perf_counter() - t0)
        mx.async_eval(following)
        tokens.append(int(token.item()))
        token = following
        times.append(time.perf_counter() - t0)
    return times, host, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pte", type=Path)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=256, help="the whole step's buffer size")
    args = parser.parse_args()
    program = load(args.pte)
    vocab = Manifest.from_dict(program.manifest).vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()
    def session(capture: bool):
        forward = Session(program, capacity=args.capacity, capture=capture).forward
        return lambda tokens: forward(tokens, evaluate=False)

    modes = {
        "walk": lambda: session(False),
        "segments": lambda: session(True),
        "whole": lambda: WholeStep(program, args.capacity).forward,
    }
    best: dict[str, float] = {}
    best_host: dict[str, float] = {}
    best_cpu: dict[str, float] = {}  # process CPU time (all threads): work done, not waiting
    tokens: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, make in modes.items():
            decode(make(), prompt, 4)  # compile and warm up
            cpu0 = time.process_time()
            times, host, tokens[name] = decode(make(), prompt, args.steps)
            cpu_ms = 1e3 * (time.process_time() - cpu0) / args.steps
            ms, host_ms = 1e3 * statistics.median(times), 1e3 * statistics.median(host)
            best[name] = min(best.get(name, ms), ms)
            best_host[name] = min(best_host.get(name, host_ms), host_ms)
            best_cpu[name] = min(best_cpu.get(name, cpu_ms), cpu_ms)
    print(f"{args.pte.name}: prompt {args.prompt}, {args.steps} decode steps, {mx.default_device()}, "
          f"best of {args.repeats} (median ms per step; host = building the step's graph; "
          "cpu = process CPU time per step, all threads, prefill included)")
    for name, ms in best.items():
        same = "" if tokens[name] == tokens["walk"] else "  (tokens differ from walk!)"
        print(f"{name:<9} {ms:8.2f} ms/step {1e3 / ms:8.1f} tok/s  x{best['walk'] / ms:5.2f} vs walk"
              f"   host {best_host[name]:6.3f} ms   cpu {best_cpu[name]:7.2f} ms{same}")


if __name__ == "__main__":
    main()
