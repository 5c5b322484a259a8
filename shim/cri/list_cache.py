"""Fast List* and *Status responses: encoded bytes, reused until the record changes.

The kubelet polls ListPodSandbox and ListContainers every second. Building
thousands of protobuf messages each time costs tens of milliseconds in
Python, so each record's entry is encoded once — as the bytes of one
element of the response's ``repeated ... = 1`` field — and kept until the
record's status object is replaced (statuses are frozen; any change makes a
new one). A response is then the concatenation of those entries, which is
a valid encoding of the response message.

A whole answer is kept too, by its filter, until any record of its kind
changes (:class:`Answers`): then a relist with nothing changed costs no walk
of the records at all.

ContainerStatus and PodSandboxStatus (not verbose) are polled too: the
kubelet asks them for every container of a pod at each of its syncs, and
building one costs about 0.1 ms, as much as the rest of the call. Their
encoded responses are kept in a :class:`StatusCache`, bounded, keyed by the
record and what the response is built from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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
    wire: tuple[object, bytes] | None  # (the status it was encoded from, the entry)

    @property
    def status(self) -> object:
        """Frozen: replaced, never changed, whenever the record changes."""


R = TypeVar("R", bound=Encoded)


class ListCache(Generic[R]):
    """Keeps each record's entry on the record itself, so it dies with the record."""

    def __init__(self, build: Callable[[R], Any]) -> None:
        self._build = build

    def encode(self, records: Iterable[R]) -> bytes:
        """The List response of ``records``: each one's kept entry while its status is the one it
        was encoded from (one comprehension, no call per record: a kubelet relists every second)."""
        miss = self._encode_one
        return b"".join(
            [w[1] if (w := r.wire) is not None and w[0] is r.status else miss(r) for r in records]
        )

    def _encode_one(self, r: R) -> bytes:
        entry = field1_entry(self._build(r).SerializeToString())
        r.wire = (r.status, entry)
        return entry


class Answers:
    """Whole List answers by filter, all built at one ``epoch`` of their record kind
    (backends/contract/records.py: a new number on every change of the records' set, of a
    record's status or of its ``committed``): a kubelet relists with the same filters every
    second, most often with nothing changed. The first call after a change drops them all (none
    can be used again); at most ``size`` filters are kept, and only answers of at most
    ``max_bytes`` (a list of thousands of records costs more to send than to build, and a copy of
    it kept per filter would be memory the entries already hold)."""

    def __init__(self, size: int = 16, max_bytes: int = 1 << 20) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._epoch = -1
        self._entries: dict[object, bytes] = {}

    def get(self, key: object, epoch: int) -> bytes | None:
        if epoch != self._epoch:
            self._entries.clear()
            return None
        return self._entries.get(key)

    def put(self, key: object, epoch: int, data: bytes) -> None:
        """``epoch`` as read before the answer was built: a change meanwhile makes it stale at once."""
        if epoch != self._epoch:
            self._entries.clear()
            self._epoch = epoch
        if len(data) > self.max_bytes:
            return
        entries = self._entries
        if key not in entries and len(entries) >= self.size:
            del entries[next(iter(entries))]
        entries[key] = data

    def __len__(self) -> int:
        return len(self._entries)

    def answer(
        self, want_state: int | None, selector: Mapping[str, str], epoch: int, build: Callable[[], bytes]
    ) -> bytes:
        """The answer to a List with this state filter and label selector, kept or built now
        (``epoch``: the record kind's, read before ``build`` runs)."""
        key = (want_state, tuple(sorted(selector.items())))
        kept = self.get(key, epoch)
        if kept is None:
            kept = build()
            self.put(key, epoch, kept)
        return kept


class StatusCache:
    """Encoded status responses of the most recently asked records (at most ``size``).

    An entry is used only for the very record it was built from (by identity)
    and while ``key`` — the objects and values the response is made of — is
    the same: statuses are frozen and replaced on every change, so identity
    is enough for them, and cheap.
    """

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._entries: dict[str, tuple[object, tuple[object, ...], bytes]] = {}

    def get(self, rid: str, record: object, key: tuple[object, ...], build: Callable[[], bytes]) -> bytes:
        hit = self._entries.get(rid)
        if hit is not None and hit[0] is record and _same(hit[1], key):
            return hit[2]
        data = build()
        entries = self._entries
        if hit is None and len(entries) >= self.size:
            del entries[next(iter(entries))]  # the oldest entry
        entries[rid] = (record, key, data)
        return data

    def __len__(self) -> int:
        return len(self._entries)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Element by element: identity for objects (frozen statuses, messages), equality for values."""
    if len(a) != len(b):
        return False
    # A loop, not all() over a generator: this runs on every polled status call.
    for x, y in zip(a, b, strict=True):
        if x is not y and not (type(x) in _VALUES and x == y):
            return False
    return True


_VALUES = (str, int, bool)


class Labelled(Protocol):
    label_map: dict[str, str] | None

    @property
    def config(self) -> Any: ...


def record_labels(r: Labelled) -> dict[str, str]:
    """The record's config.labels as a plain dict, kept on it: reading a protobuf map field
    costs about a microsecond a record, and a label-filtered List reads every record's."""
    labels = r.label_map
    if labels is None:
        labels = r.label_map = dict(r.config.labels)
    return labels


L = TypeVar("L", bound=Labelled)


def with_labels(records: list[L], selector: Mapping[str, str]) -> list[L]:
    """The records whose labels hold every pair of ``selector`` (all of them if it is empty),
    in one pass that makes no call per record on a kept label map."""
    if not selector:
        return records
    if len(selector) == 1:
        ((key, value),) = selector.items()
        return [r for r in records if (r.label_map or record_labels(r)).get(key) == value]
    pairs = tuple(selector.items())
    kept = []
    for r in records:
        labels = r.label_map or record_labels(r)
        for k, v in pairs:
            if labels.get(k) != v:
                break
        else:
            kept.append(r)
    return kept
