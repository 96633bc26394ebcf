"""The cache factory (insert-only registry) and the runner-facing faces."""
from __future__ import annotations

import pytest

from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    KINDS,
    BatchedSequenceCache,
    CacheControl,
    CacheConfig,
    CacheError,
    CacheFactory,
    CacheKindNotFound,
    CacheRegistrationError,
    CellCache,
    InvalidCacheConfig,
    SingleCache,
    StepControl,
)

from .helpers import geometry

GEO = geometry()
CONFIG = CacheConfig(32)


def test_builds_a_registered_kind_else_not_found():
    factory = CacheFactory()
    factory.register("TestBackend", "single", SingleCache)
    cache = factory.build("TestBackend", "single", GEO, CONFIG)
    assert isinstance(cache, SingleCache) and cache.capacity == 32
    with pytest.raises(CacheKindNotFound, match="registered: single"):
        factory.build("TestBackend", "batched-cell", GEO, CONFIG)
    with pytest.raises(CacheKindNotFound, match=r"registered: \(none\)"):
        factory.build("Other", "single", GEO, CONFIG)


def test_not_found_lists_every_registered_kind_sorted():
    factory = CacheFactory()
    for kind, cls in (("single", SingleCache), ("batched-cell", CellCache)):
        factory.register("B", kind, cls)
    with pytest.raises(CacheKindNotFound, match="registered: batched-cell, single$"):
        factory.build("B", "nope", GEO, CONFIG)
    assert factory.kinds("B") == ("batched-cell", "single")


def test_a_bad_geometry_or_config_fails_after_the_lookup():
    factory = CacheFactory()
    factory.register("B", "single", SingleCache)
    with pytest.raises(InvalidCacheConfig, match="CacheGeometry"):
        factory.build("B", "single", [], CONFIG)
    with pytest.raises(InvalidCacheConfig, match="CacheConfig"):
        factory.build("B", "single", GEO, {"capacity": 32})
    # The lookup comes first: an unknown kind with a bad config reports the kind.
    with pytest.raises(CacheKindNotFound):
        factory.build("B", "nope", GEO, None)


def test_registration_is_insert_only():
    factory = CacheFactory()
    factory.register("B", "single", SingleCache)
    with pytest.raises(CacheRegistrationError, match="insert-only"):
        factory.register("B", "single", CellCache)
    assert isinstance(factory.build("B", "single", GEO, CONFIG), CacheControl)


def test_a_non_callable_builder_is_rejected_and_not_registered():
    factory = CacheFactory()
    with pytest.raises(CacheRegistrationError, match="callable"):
        factory.register("B", "single", None)
    with pytest.raises(CacheKindNotFound):
        factory.build("B", "single", GEO, CONFIG)


def test_a_builder_returning_nothing_is_an_error():
    factory = CacheFactory()
    factory.register("B", "single", lambda geometry, config: None)
    with pytest.raises(CacheError, match="returned no cache"):
        factory.build("B", "single", GEO, CONFIG)


def test_the_neutral_kinds_are_registered():
    for kind, cls in zip(KINDS, (SingleCache, CellCache, BatchedSequenceCache)):
        cache = CACHE_FACTORY.build("neutral", kind, GEO, CONFIG)
        assert type(cache) is cls and cache.kind == kind


@pytest.mark.parametrize("cls", [SingleCache, CellCache, BatchedSequenceCache])
def test_every_kind_offers_the_one_face(cls):
    cache = cls(GEO, CONFIG)
    assert isinstance(cache, StepControl) and isinstance(cache, CacheControl)
