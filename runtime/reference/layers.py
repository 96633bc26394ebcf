"""The K and V pools of every layer, sized per layer by its layout."""
from __future__ import annotations

from dataclasses import dataclass

from mlx_pte.runtime.cache import CacheConfig, CacheGeometry, PolicyTable, RingLayout

from .attention import STORAGE_DTYPES
from .pool import Pool


@dataclass
class LayerPools:
    k: Pool
    v: Pool


@dataclass(frozen=True)
class PoolSize:
    max_rows: int
    first_rows: int  # rows of the first allocation; doubling follows


def layer_pools(
    geometry: CacheGeometry, config: CacheConfig, sizes: tuple[PoolSize, ...]
) -> list[LayerPools]:
    """Fresh, empty pools in the config's storage dtype, layer ``l`` sized ``sizes[l]``."""
    dtype = STORAGE_DTYPES[config.kv_dtype]
    return [
        LayerPools(
            Pool(geo.n_kv_heads, geo.head_dim, dtype, size.max_rows, size.first_rows),
            Pool(geo.n_kv_heads, geo.v_head_dim, dtype, size.max_rows, size.first_rows),
        )
        for geo, size in zip(geometry.layers, sizes)
    ]


def sequence_sizes(policies: PolicyTable, config: CacheConfig) -> tuple[PoolSize, ...]:
    """One sequence's pool sizes: a ring is allocated whole, a flat layer doubles to capacity."""
    sizes = []
    for index in policies.layer_layout:
        layout = policies.layouts[index]
        if isinstance(layout, RingLayout):
            sizes.append(PoolSize(layout.slots, layout.slots))
        else:
            sizes.append(PoolSize(config.capacity, config.initial_capacity))
    return tuple(sizes)


def fork_pools(pools: list[LayerPools], policies: PolicyTable, upto: int) -> list[LayerPools]:
    """Independent copies for a fork at ``upto``: a flat layer's prefix, a ring whole.

    A ring keeps position q at slot ``q mod slots``, so its fork must keep every slot.
    """
    forked = []
    for lp, index in zip(pools, policies.layer_layout):
        layout = policies.layouts[index]
        rows = layout.slots if isinstance(layout, RingLayout) else upto
        forked.append(LayerPools(lp.k.copy_prefix(rows), lp.v.copy_prefix(rows)))
    return forked
