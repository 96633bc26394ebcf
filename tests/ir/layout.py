"""The payload layout written out independently of ir/payload.py (from its documented
header), to take valid payloads apart and put altered ones back together."""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

HEADER = struct.Struct("<4sI6QII")


@dataclass
class Parts:
    magic: bytes
    version: int
    graph: bytes
    manifest: bytes
    data: bytes


def split(blob: bytes) -> Parts:
    magic, version, g_at, g_size, m_at, m_size, d_at, d_size, _, _ = HEADER.unpack_from(blob)
    return Parts(magic, version, blob[g_at : g_at + g_size], blob[m_at : m_at + m_size], blob[d_at : d_at + d_size])


def join(parts: Parts) -> bytes:
    """A payload from its sections, with a correct checksum."""
    g_at = HEADER.size
    m_at = g_at + len(parts.graph)
    d_at = (m_at + len(parts.manifest) + 63) // 64 * 64
    fields = (parts.magic, parts.version, g_at, len(parts.graph), m_at, len(parts.manifest), d_at, len(parts.data))
    crc = zlib.crc32(HEADER.pack(*fields, 0, 0)[:56] + parts.graph + parts.manifest)
    head = HEADER.pack(*fields, crc, 0) + parts.graph + parts.manifest
    return head + bytes(d_at - len(head)) + parts.data
