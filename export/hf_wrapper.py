"""The module ``torch.export`` traces: an HF causal LM as ``(tokens, positions, rows) -> logits``.

``rows`` picks which token rows reach the LM head, so a prefill computes one row of
logits per sequence instead of T x vocab. The KV cache is not in the graph: every
attention layer calls ``llm::update_and_attend`` (see ``hf_attention``).
"""
from __future__ import annotations

import torch
from torch.export import Dim, ExportedProgram

from .hf_attention import LAYOUT_KWARG
from .hf_errors import CheckpointError, ExportOptionError
from .hf_geometry import HFCacheLayout

# Example sizes for tracing: >= 2 so neither axis specializes to 0/1, and distinct so
# the tracer does not assume T == R.
_EXAMPLE_T = 3
_EXAMPLE_R = 2
MIN_MAX_STEP = _EXAMPLE_T


class HFWrapper(torch.nn.Module):
    """``forward(tokens int64[1,T], positions int64[T], rows int64[R]) -> float32[R,V]``.

    Args:
        model: an HF causal LM loaded with ``attn_implementation=ATTN_IMPLEMENTATION``.
        layout: its cache layout (routes each layer to its ``cache_id``).
    """

    def __init__(self, model: torch.nn.Module, layout: HFCacheLayout) -> None:
        super().__init__()
        self.body = model.base_model
        self.head = model.get_output_embeddings()
        self.layout = layout
        text = model.config.get_text_config()
        self.final_softcap = float(getattr(text, "final_logit_softcapping", None) or 0.0)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.body(
            input_ids=tokens,
            position_ids=positions[None],
            use_cache=False,
            **{LAYOUT_KWARG: self.layout},
        ).last_hidden_state
        logits = self.head(hidden[0].index_select(0, rows))
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


def check_max_step(max_step: object) -> None:
    """ExportOptionError unless ``max_step`` is an int the tracer can make dynamic."""
    if isinstance(max_step, bool) or not isinstance(max_step, int) or max_step < MIN_MAX_STEP:
        raise ExportOptionError(f"max_step must be an integer >= {MIN_MAX_STEP}, got {max_step!r}")


def trace(wrapper: HFWrapper, max_step: int) -> ExportedProgram:
    """``torch.export`` the wrapper with T and R dynamic in ``[1, max_step]``.

    Raises:
        ExportOptionError: ``max_step`` below MIN_MAX_STEP.
        CheckpointError: the traced graph's attention calls disagree with the cache layout.
    """
    check_max_step(max_step)
    tokens = torch.zeros((1, _EXAMPLE_T), dtype=torch.long)
    positions = torch.arange(_EXAMPLE_T, dtype=torch.long)
    rows = torch.arange(_EXAMPLE_R, dtype=torch.long)
    t = Dim("tokens", min=1, max=max_step)
    r = Dim("rows", min=1, max=max_step)
    with torch.no_grad():
        ep = torch.export.export(
            wrapper,
            (tokens, positions, rows),
            dynamic_shapes=({1: t}, {0: t}, {0: r}),
            strict=False,
        )
    check_attention_calls(ep, wrapper.layout)
    return ep


def check_attention_calls(ep: ExportedProgram, layout: HFCacheLayout) -> None:
    """Every HF layer reached ``update_and_attend`` once, on its cache, with its geometry.

    A family whose attention bypasses transformers' attention registry, or whose config
    the geometry misreads, fails here instead of producing a wrong model.
    """
    calls = [
        node
        for node in ep.graph.nodes
        if node.op == "call_function" and node.target == torch.ops.llm.update_and_attend.default
    ]
    cache_ids = tuple(int(node.args[4]) for node in calls)
    if cache_ids != layout.layer_cache_ids:
        raise CheckpointError(
            f"the traced model attends through caches {list(cache_ids)}, but its config gives "
            f"{list(layout.layer_cache_ids)}; this family's attention does not route through "
            "transformers' attention registry"
        )
    for node, cache_id in zip(calls, cache_ids):
        want = layout.geometry.layers[cache_id]
        k, v = node.args[1].meta["val"], node.args[2].meta["val"]
        got = (int(k.shape[1]), int(k.shape[3]), int(v.shape[3]))
        if got != (want.n_kv_heads, want.head_dim, want.v_head_dim):
            raise CheckpointError(
                f"cache {cache_id} receives (kv heads, head_dim, v_head_dim) = {got}, but the "
                f"config gives {(want.n_kv_heads, want.head_dim, want.v_head_dim)}; this "
                "family's config is not understood"
            )
