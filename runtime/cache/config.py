"""What a cache is built from: the model-given geometry and the runtime-given config.

The geometry says what each layer needs (its policy, head counts and dims) and comes
from the exported model; the config says how much room the runtime grants and comes
from the user. Both validate on construction, so a cache never sees a bad value.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence

from .errors import InvalidCacheConfig
from .step import MAX_INDEX, integer

KV_DTYPES = ("float32", "float16", "bfloat16")


def require_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int in ``[minimum, MAX_INDEX]``, or InvalidCacheConfig naming ``name``."""
    i = integer(value)
    if i is None:
        raise InvalidCacheConfig(f"{name} must be an integer, got {value!r}")
    if not minimum <= i <= MAX_INDEX:
        raise InvalidCacheConfig(f"{name} must lie in [{minimum}, {MAX_INDEX}], got {i}")
    return i


def _set_int(obj: object, field_name: str, minimum: int, label: Optional[str] = None) -> None:
    """Validate an int field of a frozen dataclass and store it as a Python int."""
    value = require_int(label or field_name, getattr(obj, field_name), minimum)
    object.__setattr__(obj, field_name, value)


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
            if integer(self.window) != 0:
                raise InvalidCacheConfig(
                    f"a flat layer keeps all history and takes window 0, got {self.window!r}; "
                    "use LayerPolicy.ring(window) for a sliding window"
                )
            object.__setattr__(self, "window", 0)
        else:
            _set_int(self, "window", 1, "ring window")

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
        _set_int(self, "n_kv_heads", 1)
        _set_int(self, "head_dim", 1)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        _set_int(self, "v_head_dim", 1)


@dataclass(frozen=True)
class CacheGeometry:
    """The model's cache layers, indexed by ``cache_id``."""

    layers: tuple[LayerGeometry, ...]

    def __post_init__(self) -> None:
        try:
            layers = tuple(self.layers)
        except TypeError:
            raise InvalidCacheConfig(
                f"a cache geometry takes a sequence of LayerGeometry, got {self.layers!r}"
            ) from None
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
        _set_int(self, "capacity", 1)
        if self.max_write is not None:
            _set_int(self, "max_write", 1)
        _set_int(self, "initial_capacity", 0)
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidCacheConfig(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        if self.max_seqs is not None:
            _set_int(self, "max_seqs", 1)


def check_cache_inputs(geometry: object, config: object) -> None:
    """InvalidCacheConfig unless a cache can be built from ``geometry`` and ``config``."""
    if not isinstance(geometry, CacheGeometry):
        raise InvalidCacheConfig(
            f"geometry must be a CacheGeometry, got {type(geometry).__name__}"
        )
    if not isinstance(config, CacheConfig):
        raise InvalidCacheConfig(f"config must be a CacheConfig, got {type(config).__name__}")
