"""What a cache is built from: the model-given geometry and the runtime-given config.

The geometry says what each layer needs (its policy, head counts and dims) and comes
from the exported model; the config says how much room the runtime grants and comes
from the user. Both validate on construction, so a cache never sees a bad value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Sequence

from .errors import InvalidCacheConfig

KV_DTYPES = ("float32", "float16", "bfloat16")


def require_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or InvalidCacheConfig naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCacheConfig(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidCacheConfig(f"{name} must be >= {minimum}, got {value}")
    return value


class PolicyKind(str, Enum):
    FLAT = "flat"
    RING = "ring"


@dataclass(frozen=True)
class LayerPolicy:
    """How much history a layer keeps: ``flat`` keeps all of it, ``ring(w)`` the last w.

    A flat policy has window 0; a ring needs a window > 0.
    """

    kind: PolicyKind = PolicyKind.FLAT
    window: int = 0

    def __post_init__(self) -> None:
        try:
            kind = PolicyKind(self.kind)
        except ValueError:
            raise InvalidCacheConfig(
                f"layer policy kind must be 'flat' or 'ring', got {self.kind!r}"
            ) from None
        object.__setattr__(self, "kind", kind)
        if kind is PolicyKind.FLAT:
            if self.window != 0:
                raise InvalidCacheConfig(
                    f"a flat layer keeps all history and takes window 0, got {self.window!r}; "
                    "use LayerPolicy.ring(window) for a sliding window"
                )
        else:
            require_int("ring window", self.window, 1)

    @classmethod
    def flat(cls) -> "LayerPolicy":
        return cls(PolicyKind.FLAT, 0)

    @classmethod
    def ring(cls, window: int) -> "LayerPolicy":
        return cls(PolicyKind.RING, window)

    @classmethod
    def from_window(cls, window: int) -> "LayerPolicy":
        """The manifest's encoding: window 0 is flat, > 0 a ring of that window."""
        require_int("window", window, 0)
        return cls.flat() if window == 0 else cls.ring(window)

    @property
    def is_ring(self) -> bool:
        return self.kind is PolicyKind.RING


@dataclass(frozen=True)
class LayerGeometry:
    """One cache layer (one ``cache_id`` of the model): policy, KV heads, head dims."""

    policy: LayerPolicy
    n_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, LayerPolicy):
            raise InvalidCacheConfig(f"policy must be a LayerPolicy, got {self.policy!r}")
        require_int("n_kv_heads", self.n_kv_heads, 1)
        require_int("head_dim", self.head_dim, 1)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        require_int("v_head_dim", self.v_head_dim, 1)


@dataclass(frozen=True)
class CacheGeometry:
    """The model's cache layers, indexed by ``cache_id``."""

    layers: tuple[LayerGeometry, ...]

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise InvalidCacheConfig("a cache geometry needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerGeometry):
                raise InvalidCacheConfig(f"layer {i} must be a LayerGeometry, got {layer!r}")
        object.__setattr__(self, "layers", layers)

    @classmethod
    def uniform(
        cls,
        policies: Sequence[LayerPolicy],
        n_kv_heads: int,
        head_dim: int,
        v_head_dim: Optional[int] = None,
    ) -> "CacheGeometry":
        """One layer per policy, all with the same heads and dims."""
        return cls(tuple(LayerGeometry(p, n_kv_heads, head_dim, v_head_dim) for p in policies))

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def policies(self) -> tuple[LayerPolicy, ...]:
        return tuple(layer.policy for layer in self.layers)


@dataclass(frozen=True)
class CacheConfig:
    """The room the runtime grants a cache.

    ``capacity`` means, per kind:
      * ``single``: the most positions the one sequence may reach (position + T <= capacity);
      * ``batched-cell``: the number of cells in the shared pool (one cell per token held,
        shared by forks);
      * ``batched-sequence``: the total logical positions held by all sequences together
        (a fork is charged its prefix).

    ``max_write`` is the most tokens one step may write per sequence into a ring layer; a
    ring keeps ``window + max_write - 1`` slots. Unset, each ring uses its own window.
    ``initial_capacity`` is where flat pools start before doubling (clamped to capacity).
    ``kv_dtype`` names the storage dtype of K/V. ``max_seqs`` bounds live sequences in the
    batched kinds (unset: only room bounds them).
    """

    capacity: int
    max_write: Optional[int] = None
    initial_capacity: int = 512
    kv_dtype: str = "float32"
    max_seqs: Optional[int] = None

    def __post_init__(self) -> None:
        require_int("capacity", self.capacity, 1)
        if self.max_write is not None:
            require_int("max_write", self.max_write, 1)
        require_int("initial_capacity", self.initial_capacity, 0)
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidCacheConfig(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        if self.max_seqs is not None:
            require_int("max_seqs", self.max_seqs, 1)
