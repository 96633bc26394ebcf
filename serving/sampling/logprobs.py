"""Token log-probabilities, computed on the device beside the draw.

What they are: ``log_softmax`` of the logits row the sampler drew from, after the grammar
mask (a constrained request's forbidden tokens are -inf, so its distribution is over the
tokens it could take) and **before** temperature, top-k and top-p, in float32. So, like
OpenAI's, the figures describe the model's distribution and do not change with the
sampling parameters; a greedy and a sampled request over the same prefix report the same
numbers, and an unconstrained request reports the plain ``log_softmax`` of the model's
logits. Only ``1 + k`` floats and ``k`` ids a draw leave the device.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlx_pte.runtime.mlx.bootstrap import mx

@dataclass(frozen=True)
class TokenLogprob:
    """The drawn token's log-probability and the ``top`` most likely tokens, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprob_arrays(logits: mx.array, tokens: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """Lazy ``(chosen [N], top_ids [N, k], top_logprobs [N, k])`` of rows ``logits`` ``[N, V]``
    and the ``tokens`` ``[N]`` drawn from them; the top ``k`` sorted most likely first."""
    rows = logits.astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    if k == 0:
        empty = mx.zeros((rows.shape[0], 0))
        return chosen, empty.astype(mx.uint32), empty
    k = min(k, rows.shape[-1])
    top = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return chosen, mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def read(tokens: list[int], arrays: tuple[mx.array, mx.array, mx.array], wants: list[int]) -> list[TokenLogprob]:
    """The host's records from evaluated ``logprob_arrays``; draw ``i`` keeps its top ``wants[i]``."""
    chosen, ids, values = (a.tolist() for a in arrays)
    return [
        TokenLogprob(token, chosen[i], tuple(zip(ids[i][: wants[i]], values[i][: wants[i]])))
        for i, token in enumerate(tokens)
    ]
