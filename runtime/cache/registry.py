"""Cache builders registered by ``(backend_id, kind)``.

The factory finds a builder; the caller holds the cache it builds. Registration is
insert-only, so a backend cannot silently replace another's builder.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from .config import CacheConfig, CacheGeometry, check_cache_inputs
from .errors import CacheError, CacheKindNotFound, CacheRegistrationError

KIND_SINGLE = "single"
KIND_BATCHED_CELL = "batched-cell"
KIND_BATCHED_SEQUENCE = "batched-sequence"
KINDS = (KIND_SINGLE, KIND_BATCHED_CELL, KIND_BATCHED_SEQUENCE)

Builder = Callable[[CacheGeometry, CacheConfig], Any]


class CacheFactory:
    def __init__(self) -> None:
        self._builders: dict[tuple[str, str], Builder] = {}
        self._lock = threading.Lock()

    def register(self, backend_id: str, kind: str, builder: Builder) -> None:
        if not callable(builder):
            raise CacheRegistrationError(
                f"builder for ({backend_id!r}, {kind!r}) must be callable, got {builder!r}"
            )
        with self._lock:
            if (backend_id, kind) in self._builders:
                raise CacheRegistrationError(
                    f"a '{kind}' cache is already registered for '{backend_id}'; "
                    "registration is insert-only"
                )
            self._builders[(backend_id, kind)] = builder

    def register_backend(
        self, backend_id: str, single: Builder, batched_cell: Builder, batched_sequence: Builder
    ) -> None:
        """Register a backend's builder for each of the three kinds."""
        for kind, builder in zip(KINDS, (single, batched_cell, batched_sequence)):
            self.register(backend_id, kind, builder)

    def kinds(self, backend_id: str) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(k for b, k in self._builders if b == backend_id))

    def build(self, backend_id: str, kind: str, geometry: CacheGeometry, config: CacheConfig) -> Any:
        with self._lock:
            builder = self._builders.get((backend_id, kind))
        if builder is None:
            registered = ", ".join(self.kinds(backend_id)) or "(none)"
            raise CacheKindNotFound(
                f"no '{kind}' cache registered for '{backend_id}'; registered: {registered}"
            )
        # Checked here too: a builder need not be one of the kinds, which check themselves.
        check_cache_inputs(geometry, config)
        cache = builder(geometry, config)
        if cache is None:
            raise CacheError(f"the '{kind}' builder for '{backend_id}' returned no cache")
        return cache


CACHE_FACTORY = CacheFactory()
