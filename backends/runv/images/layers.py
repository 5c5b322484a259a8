"""The layers of a store's pulls: fetched, verified and unpacked as they stream, a few at a
time, and each fetched once however many pulls want it.

One layer is one pass over the registry's stream, in one thread: the bytes are counted against
the manifest's declared size (never more is read), hashed for the layer digest, decompressed,
hashed again for the diff ID and extracted (:class:`.unpack.Unpacker`) into a temporary
directory beside the snapshots. Only when both digests match is it renamed into place; any
failure (a digest, the registry, a stall, a cancelled pull) removes it. Verified snapshots stay
when the pull fails later, so that a retry fetches only the rest.

:class:`Flights` is the in-flight map by digest: a pull that wants a blob another pull is
fetching waits for that one instead of asking the registry again (and, if that one fails,
fetches it itself).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import http.client
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from backends.oci.registry import PullError, hex_of

from .unpack import Unpacker

T = TypeVar("T")
# Bytes asked of the registry's stream at a time.
READ_CHUNK = 1024 * 1024
UNPACK_PREFIX = ".unpack-"
# How often a thread waiting for another pull's download looks at its own pull's cancellation.
WAIT_POLL = 0.1


class BlobReader(Protocol):
    """What a blob is read from: backends.oci's BlobStream, or a file in tests."""

    def read(self, size: int = -1, /) -> bytes | None: ...


OpenBlob = Callable[[str], contextlib.AbstractContextManager[BlobReader]]


class PullCancelled(PullError):
    """The pull was cancelled (its caller went away)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Layer:
    digest: str  # of the compressed blob, as the manifest lists it
    size: int  # declared by the manifest
    diff_id: str  # of the tar, as the config lists it


class Flights:
    """Work by key (a digest) done once at a time: later callers wait for the first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, concurrent.futures.Future[Any]] = {}

    def run(self, key: str, work: Callable[[], T], cancel: threading.Event) -> T:
        """``work()``, or the result of the same key's work already running. A failure of
        another caller's work (its registry, its cancellation) is not ours: we try ourselves."""
        while True:
            with self._lock:
                running = self._running.get(key)
                if running is None:
                    mine: concurrent.futures.Future[Any] = concurrent.futures.Future()
                    self._running[key] = mine
            if running is None:
                break
            while True:
                if cancel.is_set():
                    raise PullCancelled("cancelled")
                try:
                    return running.result(timeout=WAIT_POLL)  # type: ignore[no-any-return]
                except concurrent.futures.TimeoutError:
                    continue
                except Exception:
                    break  # the other caller failed: our turn
        try:
            result = work()
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        else:
            mine.set_result(result)
            return result
        finally:
            with self._lock:
                del self._running[key]

    def busy(self) -> set[str]:
        with self._lock:
            return set(self._running)


def read_exactly(stream: BlobReader, size: int, what: str, cancel: threading.Event) -> Iterator[bytes]:
    """The ``size`` bytes of a blob's stream in chunks, never a byte more: a registry that
    announces more (Content-Length) or sends fewer is an error."""
    headers = getattr(stream, "headers", None)  # an http.client response (or a wrapper of one)
    length = headers.get("Content-Length") if headers is not None else None
    if length is not None and length.isdigit() and int(length) != size:
        raise PullError(f"{what}: the registry sends {length} bytes, the manifest says {size}")
    left = size
    while left:
        if cancel.is_set():
            raise PullCancelled(f"{what}: cancelled")
        try:
            chunk = stream.read(min(READ_CHUNK, left))
        except (OSError, http.client.HTTPException) as exc:
            raise PullError(f"{what}: reading from the registry: {exc!r}") from None
        if not chunk:
            raise PullError(f"{what}: the registry's stream ended after {size - left} of {size} bytes")
        left -= len(chunk)
        yield chunk


def fetch_bytes(open_blob: OpenBlob, digest: str, size: int, what: str, cancel: threading.Event) -> bytes:
    """A small blob (a config) in memory, verified."""
    h = hashlib.sha256()
    parts = []
    with open_blob(digest) as stream:
        for chunk in read_exactly(stream, size, what, cancel):
            h.update(chunk)
            parts.append(chunk)
    if h.hexdigest() != hex_of(digest):
        raise PullError(f"{what}: digest mismatch: got sha256:{h.hexdigest()}, want {digest}")
    return b"".join(parts)


def fetch_layer(open_blob: OpenBlob, layer: Layer, snapshot: str, cancel: threading.Event) -> None:
    """Stream ``layer`` into the directory ``snapshot`` (its ``fs`` below), verified."""
    parent = os.path.dirname(snapshot)
    tmp = tempfile.mkdtemp(dir=parent, prefix=UNPACK_PREFIX)
    try:
        unpacker = Unpacker(os.path.join(tmp, "fs"))
        blob_hash = hashlib.sha256()
        what = f"layer {layer.digest}"
        got = 0

        def unpacking(step: Callable[[], T]) -> T:
            try:
                return step()
            except (PullError, OSError) as exc:
                # All of it came and it does not unpack: most likely not the blob the manifest names.
                if got == layer.size and blob_hash.hexdigest() != hex_of(layer.digest):
                    raise PullError(f"{what}: digest mismatch: got sha256:{blob_hash.hexdigest()}") from None
                raise PullError(f"{what}: unpacking: {exc}") from None

        try:
            with open_blob(layer.digest) as stream:
                for chunk in read_exactly(stream, layer.size, what, cancel):
                    blob_hash.update(chunk)
                    got += len(chunk)
                    unpacking(lambda: unpacker.feed(chunk))  # noqa: B023 (called at once)
            diff_id = unpacking(unpacker.finish)
        finally:
            unpacker.close()
        if blob_hash.hexdigest() != hex_of(layer.digest):
            raise PullError(f"{what}: digest mismatch: got sha256:{blob_hash.hexdigest()}")
        if diff_id != layer.diff_id:
            raise PullError(
                f"layer {layer.digest}: diff ID {diff_id} does not match the config's {layer.diff_id}"
            )
        try:
            os.rename(tmp, snapshot)
            tmp = ""
        except OSError:
            # The same diff ID from another blob (the same tar compressed otherwise) came first.
            if not os.path.isdir(snapshot):
                raise
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def fetch_all(
    layers: list[Layer],
    work: Callable[[Layer], None],
    at_once: int,
    cancel: threading.Event,
) -> None:
    """``work`` on each layer, ``at_once`` at a time, the largest first (the pull ends with its
    largest layer otherwise). On a failure no further layer starts; those running finish (they
    are kept for a retry unless the pull is cancelled), then the first error is raised."""
    if not layers:
        return
    ordered = sorted(layers, key=lambda layer: -layer.size)
    if at_once <= 1 or len(ordered) == 1:
        for layer in ordered:
            work(layer)
        return
    failed = threading.Event()

    def guarded(layer: Layer) -> None:
        if failed.is_set() or cancel.is_set():
            return
        try:
            work(layer)
        except BaseException:
            failed.set()
            raise

    with concurrent.futures.ThreadPoolExecutor(
        max_workers=min(at_once, len(ordered)), thread_name_prefix="layer"
    ) as pool:
        futures = [pool.submit(guarded, layer) for layer in ordered]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if cancel.is_set():
        raise PullCancelled("cancelled")
    if errors:
        raise errors[0]  # type: ignore[misc]
