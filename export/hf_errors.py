"""Errors of the Hugging Face export path. Every message says what to do about it."""
from __future__ import annotations

from .errors import ExportError


class HFExportError(ExportError, ValueError):
    """A Hugging Face model that cannot be exported as asked."""


class CheckpointError(HFExportError):
    """A checkpoint directory that is incomplete, unreadable or of an unsupported architecture."""


class ExportOptionError(HFExportError):
    """An export option out of range (dtype, max_step)."""


class AttentionRoutingError(HFExportError):
    """The rewritten attention ran outside the export wrapper."""
