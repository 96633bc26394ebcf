"""Typed errors of the cache layer. Every message says what to do about it."""
from __future__ import annotations


class CacheError(Exception):
    """Base class of every error the cache layer raises."""


class InvalidCacheConfig(CacheError, ValueError):
    """A geometry, config or policy that no cache can be built from."""


class InvalidStep(CacheError, ValueError):
    """A step that is malformed whatever the cache holds (empty, ragged, negative)."""


class CacheRefused(CacheError):
    """A verb or declaration the cache refused; the cache is exactly as it was.

    ``reason`` is a sentence a user can act on ("step needs 5 cells, 3 are free").
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StepStateError(CacheError, RuntimeError):
    """The step protocol was broken: attend/finish/abort without a declared step."""


class CacheKindNotFound(CacheError, LookupError):
    """No builder is registered for a ``(backend_id, kind)`` pair."""


class CacheRegistrationError(CacheError, ValueError):
    """A builder registration that the factory will not accept."""


class AttendError(CacheError, ValueError):
    """q/k/v that do not match the declared step or the layer's geometry."""
