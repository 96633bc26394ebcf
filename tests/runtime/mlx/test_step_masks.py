"""Masks are built once per step per layout and shared by every layer of that layout."""
from __future__ import annotations

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.mlx import padded

from .helpers import make_driver


def test_ring_layers_share_one_band_per_step(sdpa_masks):
    d = make_driver("single", [2, 2, 0], max_write=3)
    d.prefill(0, 0, 3)
    d.prefill(0, 3, 3)
    first = sdpa_masks[-3:]
    assert isinstance(first[0], mx.array) and first[1] is first[0]
    assert first[2] == "causal"
    d.prefill(0, 6, 3)
    assert sdpa_masks[-3] is sdpa_masks[-2] and sdpa_masks[-3] is not first[0]


def test_cell_layers_share_one_mask_per_window(sdpa_masks):
    d = make_driver("batched-cell", [0, 3, 0, 3])
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, a, b], [0, 1, 0])
    flat0, ring1, flat2, ring3 = sdpa_masks
    assert flat2 is flat0 and ring3 is ring1 and ring1 is not flat0
    d.check([a, b], [2, 1])
    assert sdpa_masks[4] is not flat0 and sdpa_masks[6] is sdpa_masks[4]


def test_padded_batch_layers_share_one_mask(sdpa_masks, monkeypatch):
    monkeypatch.setattr(padded, "SPAN_OVERHEAD_PAIRS", 10**9)
    d = make_driver("batched-sequence", [0, 3, 0, 3], max_write=3)
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, a, a, b], [0, 1, 2, 0])
    assert [s[0] for s in sdpa_masks.shapes] == [2, 2, 2, 2]  # one call, batch of 2 rows
    flat0, ring1, flat2, ring3 = sdpa_masks
    assert flat2 is flat0 and ring3 is ring1 and ring1 is not flat0
    d.check([a, b, b], [3, 1, 2])
    assert sdpa_masks[6] is sdpa_masks[4] and sdpa_masks[4] is not flat0


def test_a_decode_step_of_equal_histories_attends_mask_free(sdpa_masks, monkeypatch):
    # Every row's query sees its whole row, so the fused kernel runs without a mask, also
    # when a sequence in the middle of the rows sits the step out (its output is dropped).
    monkeypatch.setattr(padded, "SPAN_OVERHEAD_PAIRS", 10**9)
    d = make_driver("batched-sequence", [0, 0], max_write=3)
    a, b, c = d.cache.seq_new(), d.cache.seq_new(), d.cache.seq_new()
    for seq in (a, b, c):
        d.prefill(seq, 0, 3)
    del sdpa_masks[:], sdpa_masks.shapes[:]
    d.check([a, b, c], [3, 3, 3])
    assert [s[0] for s in sdpa_masks.shapes] == [3, 3] and sdpa_masks[:] == [None, None]
    d.check([a, c], [4, 4])
    assert [s[0] for s in sdpa_masks.shapes[2:]] == [3, 3] and sdpa_masks[2:] == [None, None]
    d.check([a, b], [5, 4])  # unequal histories: the rows need the mask
    assert isinstance(sdpa_masks[4], mx.array)
