"""Encoded answers to the polled RPCs: where the shim's speed tricks live, and only here.

A kubelet asks ListPodSandbox and ListContainers every second, PodSandboxStatus
and ContainerStatus for every container of a pod at each of its syncs, Version
and ImageFsInfo at each sync too. The services answer each with a message
built from the records (the plain path); building and encoding thousands of
protobuf messages a second would cost more than everything else the shim does.
So the servicer's table sends these RPCs here (:class:`EncodedAnswers`), which
gives the same bytes as the plain path's message encoded
(tests/shim/test_answers.py proves it for each), kept as long as what they were
built from is unchanged:

- a List entry is one element of the response's ``repeated ... = 1`` field,
  encoded once per record and kept on the record (``record.wire``) with the
  ``revision`` it was built at; a response is the concatenation of entries,
  which is a valid encoding of the response message;
- a whole List answer is kept by its filter while the table's ``version``
  (any change of any record of its kind, shim/cri/store.py) is the one it was
  built at (:class:`Answers`): a relist with nothing changed walks no record;
- a Status answer (not verbose) is kept per record while the record and its
  revision are the same (:class:`StatusCache`);
- Version is encoded once; ListImages and ImageFsInfo are answered from what
  image stores hold in memory, when they all can (shim/cri/image.py says how).

What comes back is bytes or, where the plain path must wait (an image store that
has to be asked), the plain path's coroutine; the servicer settles either.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from backends.contract import ImageInfo
from cri_api import api_pb2 as pb
from shim.cri.image import image_pb, merged_fs_info, wanted_handler, wanted_image
from shim.cri.messages import container_pb, sandbox_pb

if TYPE_CHECKING:
    from shim.cri.container import ContainerService
    from shim.cri.image import ImageService
    from shim.cri.runtime import RuntimeService
    from shim.cri.sandbox import SandboxService
    from shim.cri.store import Table


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
    revision: int
    wire: tuple[int, bytes] | None  # (the revision it was encoded at, the entry)


R = TypeVar("R", bound=Encoded)


class ListCache(Generic[R]):
    """Keeps each record's entry on the record itself, so it dies with the record."""

    def __init__(self, build: Callable[[R], Any]) -> None:
        self._build = build

    def entries(self, records: Iterable[R]) -> list[bytes]:
        """Each record's entry: the kept one while the record's revision is the one it was
        encoded at (one comprehension, no call per kept entry)."""
        miss = self._encode_one
        return [w[1] if (w := r.wire) is not None and w[0] == r.revision else miss(r) for r in records]

    def encode(self, records: Iterable[R]) -> bytes:
        return b"".join(self.entries(records))

    def _encode_one(self, r: R) -> bytes:
        entry = field1_entry(self._build(r).SerializeToString())
        r.wire = (r.revision, entry)
        return entry


class Answers:
    """Whole List answers by filter, all built at one ``version`` of their table. The first call
    after a change drops them all (none can be used again); at most ``size`` filters are kept,
    and only answers of at most ``max_bytes`` (a list of thousands of records costs more to send
    than to build, and a copy of it kept per filter would be memory the entries already hold)."""

    def __init__(self, size: int = 16, max_bytes: int = 1 << 20) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._version = -1
        self._entries: dict[object, bytes] = {}

    def get(self, key: object, version: int) -> bytes | None:
        if version != self._version:
            self._entries.clear()
            return None
        return self._entries.get(key)

    def put(self, key: object, version: int, data: bytes) -> None:
        """``version`` as read before the answer was built: a change meanwhile makes it stale at once."""
        if version != self._version:
            self._entries.clear()
            self._version = version
        if len(data) > self.max_bytes:
            return
        entries = self._entries
        if key not in entries and len(entries) >= self.size:
            del entries[next(iter(entries))]
        entries[key] = data

    def __len__(self) -> int:
        return len(self._entries)


class StatusCache:
    """Encoded status answers of the most recently asked records (at most ``size``), each used
    only for the very record it was built from (by identity) at the same revision."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._entries: dict[str, tuple[Encoded, int, bytes]] = {}

    def get(self, record: Encoded, build: Callable[[], bytes]) -> bytes:
        rid = record.id
        hit = self._entries.get(rid)
        if hit is not None and hit[0] is record and hit[1] == record.revision:
            return hit[2]
        data = build()
        entries = self._entries
        if hit is None and len(entries) >= self.size:
            del entries[next(iter(entries))]  # the oldest entry
        entries[rid] = (record, record.revision, data)
        return data

    def __len__(self) -> int:
        return len(self._entries)


def _filter_key(
    f: pb.ContainerFilter | pb.PodSandboxFilter,
) -> tuple[int | None, tuple[tuple[str, str], ...]]:
    selector = f.label_selector
    return (
        f.state.state if f.HasField("state") else None,
        tuple(sorted(selector.items())) if selector else (),
    )


class ListAnswers(Generic[R]):
    """One List RPC answered encoded: the entries of the records ``select`` picks by a filter
    (:class:`ListCache`), and whole answers kept by filter at ``table``'s version (:class:`Answers`)."""

    def __init__(
        self, table: Table[Any], select: Callable[[Any], Iterable[R]], build: Callable[[R], Any]
    ) -> None:
        self._table = table
        self._select = select
        self._entries: ListCache[R] = ListCache(build)
        self._answers = Answers()

    def entries(self, f: pb.PodSandboxFilter | pb.ContainerFilter) -> list[bytes]:
        return self._entries.entries(self._select(f))

    def answer(self, f: pb.PodSandboxFilter | pb.ContainerFilter, by_id: str) -> bytes:
        """The whole answer to filter ``f``; ``by_id``, the ID the filter names if it names one:
        such an answer walks few records and is built each time."""
        if by_id:
            return self._entries.encode(self._select(f))
        key = _filter_key(f)
        version = self._table.version
        kept = self._answers.get(key, version)
        if kept is None:
            kept = self._entries.encode(self._select(f))
            self._answers.put(key, version, kept)
        return kept


class EncodedAnswers:
    """The polled RPCs of pods, containers and the runtime, answered as encoded bytes."""

    def __init__(
        self, runtime: RuntimeService, sandboxes: SandboxService, containers: ContainerService
    ) -> None:
        self._sandboxes = sandboxes
        self._containers = containers
        store = sandboxes.shim.store
        self._version = runtime.version(pb.VersionRequest()).SerializeToString()
        self._sandbox_lists: ListAnswers[Any] = ListAnswers(store.sandboxes, sandboxes.select, sandbox_pb)
        self._container_lists: ListAnswers[Any] = ListAnswers(
            store.containers, containers.select, container_pb
        )
        self._sandbox_status = StatusCache()
        self._container_status = StatusCache()

    def version(self, req: pb.VersionRequest) -> bytes:
        return self._version

    # ---- Lists: the entries (for the Stream* twins) and the whole answer
    def pod_sandbox_entries(self, req: pb.ListPodSandboxRequest) -> list[bytes]:
        return self._sandbox_lists.entries(req.filter)

    def container_entries(self, req: pb.ListContainersRequest) -> list[bytes]:
        return self._container_lists.entries(req.filter)

    def list_pod_sandbox(self, req: pb.ListPodSandboxRequest) -> bytes:
        f = req.filter
        return self._sandbox_lists.answer(f, f.id)

    def list_containers(self, req: pb.ListContainersRequest) -> bytes:
        f = req.filter
        return self._container_lists.answer(f, f.id or f.pod_sandbox_id)

    # ---- Status (a verbose one is built each time: its info is for a human)
    def pod_sandbox_status(self, req: pb.PodSandboxStatusRequest) -> pb.PodSandboxStatusResponse | bytes:
        if req.verbose:
            return self._sandboxes.status(req)
        sb = self._sandboxes.find(req.pod_sandbox_id)
        return self._sandbox_status.get(sb, lambda: self._sandboxes.status(req).SerializeToString())

    def container_status(self, req: pb.ContainerStatusRequest) -> pb.ContainerStatusResponse | bytes:
        if req.verbose:
            return self._containers.status(req)
        c = self._containers.find(req.container_id)
        return self._container_status.get(c, lambda: self._containers.status(req).SerializeToString())


class EncodedImages:
    """ListImages and ImageFsInfo answered from what the image stores hold in memory (docker's
    mirror of the engine's list and its usage figures, the fake's store) when every store can,
    without waiting: else the image service's coroutine."""

    def __init__(self, images: ImageService) -> None:
        self._images = images
        self._entries: dict[str, tuple[ImageInfo, bytes]] = {}  # by image ID
        # The last ImageFsInfo answered from memory: the stores' answers, and it encoded.
        self._fs_kept: tuple[list[pb.ImageFsInfoResponse], bytes] | None = None

    def list_images(self, req: pb.ListImagesRequest) -> bytes | Coroutine[Any, Any, pb.ListImagesResponse]:
        stores = self._images.stores()
        if len(stores) == 1 and not wanted_image(req) and not wanted_handler(req):
            infos = stores[0].list_images_now()
            if infos is not None:
                encoded = self._encode(infos)
                if encoded is not None:
                    return encoded
        return self._images.list_(req)

    def _encode(self, infos: list[ImageInfo]) -> bytes | None:
        """Each image's entry, encoded once and reused while the store hands out the same image;
        None when an ID comes twice (merged by the service)."""
        entries: dict[str, tuple[ImageInfo, bytes]] = {}
        for info in infos:
            if info.id in entries:
                return None
            hit = self._entries.get(info.id)
            if hit is None or (hit[0] is not info and hit[0] != info):
                hit = (info, field1_entry(image_pb(info).SerializeToString()))
            entries[info.id] = hit
        self._entries = entries
        return b"".join(entry for _info, entry in entries.values())

    def image_fs_info(
        self, req: pb.ImageFsInfoRequest
    ) -> bytes | Coroutine[Any, Any, pb.ImageFsInfoResponse]:
        """Kept encoded while the stores hand out the same figures (docker's change every ten
        seconds or so, and the kubelet asks far more often)."""
        infos = [s.image_fs_info_now() for s in self._images.stores()]
        if not infos or any(info is None for info in infos):
            return self._images.fs_info(req)
        figures: list[pb.ImageFsInfoResponse] = infos  # type: ignore[assignment]
        kept = self._fs_kept
        if kept is not None and len(kept[0]) == len(figures) and all(map(operator.is_, kept[0], figures)):
            return kept[1]
        data = merged_fs_info(figures).SerializeToString()
        self._fs_kept = (figures, data)
        return data
