"""Host versus device time of a decode step, measured unpipelined: the step's lazy graph
is built (host ms), then evaluated with nothing else in flight (device ms: MLX's
scheduling and the kernels). A pipelined decode step takes about max(host, device) when
the two overlap, host + device when they do not.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def host_device_ms(forward: Callable, prompt: list[int], steps: int, chunk: int) -> tuple[float, float]:
    """Median (host, device) ms over ``steps`` greedy decode steps after ``prompt`` (fed in
    chunks of at most ``chunk`` tokens); ``forward(tokens)`` returns the logits of the
    step's last token unevaluated."""
    import mlx.core as mx

    for at in range(0, len(prompt), chunk):
        logits = forward(prompt[at : at + chunk])
    token = mx.argmax(logits[-1]).reshape(1)
    mx.eval(token)
    host, device = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = mx.argmax(forward(token)[-1]).reshape(1)
        t1 = time.perf_counter()
        mx.eval(token)
        host.append(t1 - t0)
        device.append(time.perf_counter() - t1)
    return 1e3 * statistics.median(host), 1e3 * statistics.median(device)
