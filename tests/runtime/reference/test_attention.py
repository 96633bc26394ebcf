"""The reference attention and its masks against brute force."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mlx_pte.runtime.cache import FlatLayout, MaskKind, RingLayout
from mlx_pte.runtime.reference import attend, lower_right_mask
from mlx_pte.runtime.reference.attention import run_mask


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("1" if x else "0" for x in row) for row in mask.tolist()]


def test_band_of_three_queries_over_five_keys() -> None:
    assert rows(lower_right_mask(3, 5, 3)) == ["11100", "01110", "00111"]


def test_window_covering_the_keys_is_plain_lower_right_causal() -> None:
    assert rows(lower_right_mask(3, 5, 5)) == ["11100", "11110", "11111"]
    assert rows(lower_right_mask(3, 5)) == ["11100", "11110", "11111"]


def test_square_causal_is_lower_triangular() -> None:
    assert torch.equal(lower_right_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


def test_continuation_is_the_lower_right_band() -> None:
    assert torch.equal(lower_right_mask(3, 7), torch.ones(3, 7, dtype=torch.bool).tril(4))


@pytest.mark.parametrize(
    "layout, position, count, kind, expected",
    [
        (FlatLayout(), 5, 1, MaskKind.NONE, None),
        (FlatLayout(), 0, 4, MaskKind.CAUSAL, ["1000", "1100", "1110", "1111"]),
        (RingLayout(4, 4), 0, 4, MaskKind.CAUSAL, ["1000", "1100", "1110", "1111"]),
        # ring(2) at 4..6 reads positions 3..6; each query sees itself and one before.
        (RingLayout(2, 3), 4, 3, MaskKind.BAND, ["1100", "0110", "0011"]),
    ],
)
def test_run_mask_follows_the_plan(layout, position, count, kind, expected) -> None:
    run = layout.plan(position, count)
    assert run.mask is kind
    mask = run_mask(run)
    assert (mask is None) if expected is None else rows(mask) == expected


def brute_force(q, k, v, scale, softcap, mask) -> np.ndarray:
    q, k, v = (x.double().numpy() for x in (q, k, v))
    n_q, n_kv, T, S = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    out = np.zeros((1, n_q, T, v.shape[3]))
    for h in range(n_q):
        g = h * n_kv // n_q
        for i in range(T):
            seen = [j for j in range(S) if mask is None or bool(mask[i, j])]
            s = np.array([q[0, h, i] @ k[0, g, j] * scale for j in seen])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[0, h, i] = (w[:, None] * v[0, g, seen]).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("n_q, n_kv", [(4, 4), (4, 2), (6, 1)])
def test_attend_matches_brute_force(n_q: int, n_kv: int, softcap: float) -> None:
    g = torch.Generator().manual_seed(n_q * 10 + n_kv)
    q = torch.randn(1, n_q, 3, 8, generator=g) * 2
    k = torch.randn(1, n_kv, 5, 8, generator=g) * 2
    v = torch.randn(1, n_kv, 5, 3, generator=g)
    mask = lower_right_mask(3, 5, 2)
    out = attend(q, k, v, 0.4, softcap, mask)
    assert out.shape == (1, n_q, 3, 3)
    np.testing.assert_allclose(out.numpy(), brute_force(q, k, v, 0.4, softcap, mask), atol=1e-5)


def test_masking_keys_equals_attending_only_the_kept_keys() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 8, generator=g)
    k, v = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    mask = torch.tensor([[True, False, True]])
    kept = torch.tensor([0, 2])
    torch.testing.assert_close(
        attend(q, k, v, 0.3, 0.0, mask), attend(q, k[:, :, kept], v[:, :, kept], 0.3, 0.0, None)
    )


def test_output_follows_q_dtype_and_computes_in_fp32() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 2, 4, generator=g).bfloat16()
    k = torch.randn(1, 2, 2, 4, generator=g).bfloat16()
    v = torch.randn(1, 2, 2, 4, generator=g).bfloat16()
    out = attend(q, k, v, 0.5, 0.0, None)
    assert out.dtype == torch.bfloat16
    want = brute_force(q, k, v, 0.5, 0.0, None)
    np.testing.assert_allclose(out.float().numpy(), want, atol=1e-2)
    # fp32 compute: rounding happens once, at the end.
    assert torch.equal(out, torch.from_numpy(want).float().bfloat16())
