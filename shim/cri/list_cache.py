"""Fast List* responses: per-record encoded entries, reused until the record changes.

The kubelet polls ListPodSandbox and ListContainers every second. Building
thousands of protobuf messages each time costs tens of milliseconds in
Python, so each record's entry is encoded once — as the bytes of one
element of the response's ``repeated ... = 1`` field — and kept until the
record's status object is replaced (statuses are frozen; any change makes a
new one). A response is then the concatenation of those entries, which is
a valid encoding of the response message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field1_entry(payload: bytes) -> bytes:
    """Field 1, wire type 2 (length-delimited), as the element of a repeated message field."""
    return b"\x0a" + _varint(len(payload)) + payload


class Encoded(Protocol):
    id: str
    wire: tuple[object, bytes] | None


R = TypeVar("R", bound=Encoded)


class ListCache(Generic[R]):
    """Keeps each record's entry on the record itself, so it dies with the record."""

    def __init__(self, build: Callable[[R], Any]) -> None:
        self._build = build

    def encode(self, records: Sequence[R], version: Callable[[R], object]) -> bytes:
        parts = []
        build = self._build
        for r in records:
            v = version(r)
            hit = r.wire
            if hit is not None and hit[0] is v:
                parts.append(hit[1])
                continue
            entry = field1_entry(build(r).SerializeToString())
            r.wire = (v, entry)
            parts.append(entry)
        return b"".join(parts)


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    for k, v in selector.items():
        if labels.get(k) != v:
            return False
    return True
