"""Choosing next tokens on the device: one batched MLX call for every row a step samples.

Greedy rows take the argmax. Sampled rows draw by Gumbel-max: the argmax of
``logits / T + G`` over the tokens top-k and top-p allow, ``G`` standard Gumbel noise.
That is the distribution of the host reference (``sampling.Sampler``: softmax of
``logits / T``, restricted, then drawn), but a draw depends on neither the vocabulary's
order nor the other rows of the batch, so a seeded sample repeats whatever it is batched
with. Each sample owns its key chain (``mx.random.key(seed)``, split once per draw);
no global random state is shared between requests. Only token ids leave the device.

Tokens whose logit ties the last one top-k or top-p keeps are all kept (the reference
breaks such ties by index); with untied logits the two agree exactly.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from mlx_pte.runtime.mlx.bootstrap import mx

from .params import SamplingParams

_split_rows = mx.vmap(lambda key: mx.random.split(key))


@dataclass
class TokenStream:
    """One sample's sampling parameters and, unless greedy, its key chain."""

    params: SamplingParams
    key: Optional[mx.array] = None

    @classmethod
    def start(cls, params: SamplingParams) -> "TokenStream":
        """A stream seeded by ``params.seed`` (a fresh random seed when None)."""
        if params.greedy:
            return cls(params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return cls(params, mx.random.key(seed))


def draw(logits: mx.array, streams: Sequence[TokenStream], rows: Optional[Sequence[int]] = None) -> mx.array:
    """Token ids (uint32 ``[N]``, lazy): draw ``i`` from row ``rows[i]`` of ``logits`` ``[R, V]``.

    ``rows`` defaults to one draw per row, in order; several streams may draw from one
    row (samples forked from one prompt). Advances each sampled stream's key.
    """
    rows = list(range(len(streams))) if rows is None else list(rows)
    if len(rows) != len(streams):
        raise ValueError(f"{len(rows)} rows for {len(streams)} streams")
    greedy = [i for i, s in enumerate(streams) if s.params.greedy]
    sampled = [i for i, s in enumerate(streams) if not s.params.greedy]
    parts = []
    if greedy:
        parts.append(mx.argmax(take_rows(logits, [rows[i] for i in greedy]), axis=-1))
    if sampled:
        picked = take_rows(logits, [rows[i] for i in sampled])
        parts.append(_sample(picked, [streams[i] for i in sampled]))
    if not sampled or not greedy:
        return parts[0]
    # Back to draw order: greedy draws were placed first.
    inverse = np.argsort(np.array(greedy + sampled))
    return mx.concatenate(parts)[mx.array(inverse)]


def take_rows(array: mx.array, rows: list[int]) -> mx.array:
    """``array[rows]`` along the first axis, without a gather when ``rows`` is every row in order."""
    if rows == list(range(array.shape[0])):
        return array
    return array[mx.array(rows)]


def _sample(logits: mx.array, streams: list[TokenStream]) -> mx.array:
    vocab = logits.shape[-1]
    pairs = _split_rows(mx.stack([s.key for s in streams]))  # [S, 2, 2]: next key, draw key
    for i, stream in enumerate(streams):
        stream.key = pairs[i, 0]
    noise = mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(pairs[:, 1])
    temperature = mx.array([s.params.temperature for s in streams], dtype=mx.float32)[:, None]
    # Shifting by the row max first keeps the scaled logits <= 0, so no tiny temperature
    # overflows them.
    scaled = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    scores = scaled + noise
    floor = _thresholds(scaled, [s.params for s in streams])
    if floor is not None:
        scores = mx.where(scaled >= floor, scores, -mx.inf)
    return mx.argmax(scores, axis=-1)


def _thresholds(scaled: mx.array, params: list[SamplingParams]) -> Optional[mx.array]:
    """Per row, the smallest scaled logit top-k and top-p keep (``[S, 1]``), or None when
    no row filters. Only as many of the largest logits are sorted as the rows need."""
    vocab = scaled.shape[-1]
    top_k = [p.top_k if p.top_k < vocab else 0 for p in params]  # k >= V keeps every token
    top_p = [p.top_p for p in params]
    filtered = [k > 0 or q < 1.0 for k, q in zip(top_k, top_p)]
    if not any(filtered):
        return None
    whole = any(q < 1.0 and k == 0 for k, q in zip(top_k, top_p))
    width = vocab if whole else max(top_k)
    top = mx.topk(scaled, width, axis=-1) if width < vocab else scaled
    top = -mx.sort(-top, axis=-1)  # descending
    keep = np.array([k if k else width for k in top_k], dtype=np.int32)
    kth = mx.take_along_axis(top, mx.array(keep - 1)[:, None], axis=-1)
    # Top-p works inside the top-k set; its mass is normalised over the whole row, so
    # tokens tied with the k-th beyond the sorted width still count.
    total = mx.sum(mx.where(scaled >= kth, mx.exp(scaled), 0.0), axis=-1, keepdims=True)
    in_k = top >= kth
    probs = mx.where(in_k, mx.exp(top), 0.0) / total
    before = mx.cumsum(probs, axis=-1) - probs
    p = mx.array(top_p, dtype=mx.float32)[:, None]
    count = mx.sum((before < p) & in_k, axis=-1, keepdims=True)
    nucleus = mx.take_along_axis(top, mx.maximum(count - 1, 0).astype(mx.int32), axis=-1)
    floor = mx.where(p < 1.0, nucleus, kth)
    return mx.where(mx.array(filtered)[:, None], floor, -mx.inf)
