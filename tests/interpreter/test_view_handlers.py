"""The head-layout handlers (``view_permute``, ``permute_view``, ``split_heads``) and the
fused ``glu`` against numpy over random shapes and permutations, and the fused rope's
layout (its values: ``tests/export/test_fusion.py``). Where a permutation
moves only axes of size 1 (a decode step's one token), the handler must issue no
transpose: a GPU step's host time grows with its graph nodes."""
import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.interpreter.handlers import HANDLERS, RunContext
from mlx_pte.interpreter.rope_handlers import rope_fast

shapes = st.lists(st.sampled_from([1, 1, 2, 3]), min_size=4, max_size=4).map(tuple)
permutations = st.permutations(range(4)).map(tuple)


def primitives(outputs, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), outputs)
    return re.findall(r'label ="(\w+)"', path.read_text())


def order_kept(shape, dims) -> bool:
    """The oracle: numpy's transposed copy lists the elements in their original order."""
    x = np.arange(int(np.prod(shape))).reshape(shape)
    return bool((np.transpose(x, dims).reshape(-1) == x.reshape(-1)).all())


def fresh(a: np.ndarray) -> mx.array:
    out = mx.array(a)
    mx.eval(out)
    return out


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dims=permutations)
def test_permute_view_matches_numpy(tmp_path_factory, shape, dims):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    got = HANDLERS["permute_view"]([fresh(x)], {"dims": dims, "shape": (1, -1)}, RunContext())
    assert ("Transpose" in primitives(got, tmp_path_factory.mktemp("g"))) == (not order_kept(shape, dims))
    np.testing.assert_array_equal(np.array(got), np.transpose(x, dims).reshape(1, -1))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dims=permutations, infer=st.integers(-1, 3))
def test_view_permute_matches_numpy(tmp_path_factory, shape, dims, infer):
    flat = np.arange(int(np.prod(shape)), dtype=np.float32)
    view = tuple(-1 if i == infer else n for i, n in enumerate(shape))
    got = HANDLERS["view_permute"]([fresh(flat)], {"shape": view, "dims": dims}, RunContext())
    nodes = primitives(got, tmp_path_factory.mktemp("g"))  # before the values evaluate the graph
    assert nodes in ([], ["Reshape"]) if order_kept(shape, dims) else "Transpose" in nodes
    np.testing.assert_array_equal(np.array(got), np.transpose(flat.reshape(shape), dims))


@settings(max_examples=40, deadline=None)
@given(tokens=st.sampled_from([1, 1, 3]), heads=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       dim=st.sampled_from([1, 4]))
def test_split_heads_matches_numpy(tmp_path_factory, tokens, heads, dim):
    width = sum(heads) * dim
    x = np.arange(2 * tokens * width, dtype=np.float32).reshape(2, tokens, width)[:1]
    got = HANDLERS["split_heads"]([fresh(x)], {"heads": tuple(heads), "head_dim": dim}, RunContext())
    nodes = primitives(list(got), tmp_path_factory.mktemp("g"))
    assert ("Transpose" in nodes) == (tokens > 1 and sum(heads) > 1)
    grouped = np.transpose(x.reshape(1, tokens, sum(heads), dim), (0, 2, 1, 3))
    bounds = np.cumsum(heads)[:-1]
    for part, want in zip(got, np.split(grouped, bounds, axis=1), strict=True):
        np.testing.assert_array_equal(np.array(part), want)


@settings(max_examples=20, deadline=None)
@given(width=st.integers(1, 6), padding=st.integers(0, 3), tokens=st.integers(1, 3))
def test_fused_glu_matches_numpy(width, padding, tokens):
    rng = np.random.default_rng(width * 16 + padding)
    fused = rng.standard_normal((1, tokens, 2 * width + padding)).astype(np.float32)
    got = HANDLERS["glu"]([fresh(fused)], {"width": width, "activation": "silu"}, RunContext())
    gate, up = fused[..., :width].astype(np.float64), fused[..., -width:].astype(np.float64)
    np.testing.assert_allclose(np.array(got), gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def test_the_fused_rope_moves_tokens_to_the_batch_axis_only_when_there_are_several(tmp_path):
    for tokens, transposes in ((1, 0), (3, 2)):
        x, positions = fresh(np.ones((1, 4, tokens, 8), np.float32)), fresh(np.arange(tokens, dtype=np.int32) + 5)
        nodes = primitives(rope_fast(x, positions, None, 2, base=10000.0), tmp_path)
        assert nodes.count("Transpose") == transposes and "Reshape" not in nodes
