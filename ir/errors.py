"""Errors raised while reading or validating a program."""
from __future__ import annotations


class FormatError(ValueError):
    """A .pte file or payload that cannot be read; the message names what is wrong."""


class UnknownOpError(FormatError):
    """An instruction names an op the catalog does not know (a newer exporter?)."""
