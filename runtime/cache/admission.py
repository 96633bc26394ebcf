"""Admission arithmetic per cache kind: how much of a cache's capacity requests may take.

A sequence layout (``single``, ``batched-sequence``) charges every sequence, forks
included, its whole history; a cell pool (``batched-cell``) stores a shared prefix once,
so forks of one prompt pay only for what each adds after it.
"""
from __future__ import annotations

from .registry import KIND_BATCHED_CELL

__all__ = ["footprint", "sample_share"]


def sample_share(kind: str, capacity: int, prompt_len: int, n: int) -> int:
    """Positions each of ``n`` samples of one prompt may grow to, so that together they
    never outgrow ``capacity`` units."""
    if kind == KIND_BATCHED_CELL:
        return prompt_len + (capacity - prompt_len) // n
    return capacity // n


def footprint(kind: str, prompt_len: int, n: int, final_len: int) -> int:
    """Capacity units ``n`` samples of a prompt hold once each reaches ``final_len``."""
    if kind == KIND_BATCHED_CELL:
        return prompt_len + n * (final_len - prompt_len)
    return n * final_len
