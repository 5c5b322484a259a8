"""A client of the OCI distribution API for one pull: manifests and blobs by digest, from the
hosts the registry configuration names for the image's registry (:mod:`.hosts`: mirrors in
order, the server last), with the credentials and auth flows of :mod:`.auth`.

Each request goes to the hosts in order until one answers it: a mirror without the ``resolve``
capability is not asked for a manifest by tag; a host that fails (unreachable, TLS, silent for
the progress timeout, HTTP 5xx, not found, refused credentials, a redirect loop, a manifest that
does not verify) is logged with its reason and the next one is tried; a host unreachable once is
not asked again during the pull. When all fail, the error names every host and its reason, and
its kind follows the last (the authoritative server's) answer: NotFoundError for a 404,
UnavailableError for a host that could not be reached or answered 5xx, PullError otherwise.

It speaks http.client (stdlib): a handful of GETs, with the TLS context of each host and a
timeout on every socket read; keeping it here avoids a dependency whose redirect, auth and
timeout handling we would have to adapt anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import urllib.parse
from collections.abc import Callable, Collection, Iterator
from typing import TypeVar

import structlog

from backends import reference
from backends.contract.errors import NotFoundError, UnavailableError
from backends.linux.files import replacing
from backends.oci.auth import AuthError, Authorizer, Credentials
from backends.oci.hosts import RegistryHost
from backends.oci.settings import PullSettings
from backends.oci.transport import (
    BlobStream,
    PullError,
    RedirectError,
    Reply,
    StalledError,
    TooLargeError,
    Transport,
    TransportError,
)

__all__ = [
    "ACCEPT",
    "MEDIA_DOCKER_LIST",
    "MEDIA_DOCKER_MANIFEST",
    "MEDIA_OCI_INDEX",
    "MEDIA_OCI_MANIFEST",
    "Credentials",
    "PullError",
    "RegistryClient",
    "StalledError",
    "hex_of",
]

log = structlog.get_logger("cri-shim.oci.registry")

MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_MEDIA = (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST, MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST)
ACCEPT = ", ".join(MANIFEST_MEDIA)
MAX_MANIFEST = 4 * 1024 * 1024  # as containerd: a manifest is metadata, not a download

T = TypeVar("T")

# The kinds of a host's failure; the last host's decides the error of the request.
_NOT_FOUND, _UNAVAILABLE, _REFUSED = "not found", "unavailable", "refused"


class _Refused(PullError):
    """The host answered, with something that cannot be used (it does not verify, or parse)."""


def hex_of(digest: str) -> str:
    algo, _, value = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise PullError(f"unsupported digest {digest!r}")
    return value


class RegistryClient:
    """Distribution API client for one pull of ``ref`` (safe to use from several threads)."""

    def __init__(
        self,
        ref: reference.Reference,
        creds: Credentials | None,
        settings: PullSettings | Collection[str] | None = None,
    ) -> None:
        if not isinstance(settings, PullSettings):
            # A set of insecure registries, as before PullSettings: nothing else configured.
            settings = PullSettings(insecure=frozenset(settings)) if settings is not None else PullSettings()
        self.ref = ref
        self.settings = settings
        registries = settings.registries
        self.hosts = registries.hosts.for_domain(ref.domain, settings.insecure)
        self.transport = Transport(settings.progress_timeout)
        self.auth = Authorizer(
            ref.path, ref.domain, creds, registries.credentials, registries.tokens, self.transport
        )
        self._lock = threading.Lock()
        self._down: dict[str, str] = {}  # host URL -> why it could not be reached, for this pull

    # ------------------------------------------------------------------ the API

    def manifest(self, tag_or_digest: str) -> tuple[bytes, str, str]:
        """(raw bytes, media type, digest) of a manifest, verified when asked by digest; a tag is
        asked only of hosts with the ``resolve`` capability."""
        by_digest = tag_or_digest.startswith("sha256:")
        if by_digest:
            hex_of(tag_or_digest)

        def use(host: RegistryHost, reply: Reply) -> tuple[bytes, str, str]:
            try:
                if (reply.length or 0) > MAX_MANIFEST:
                    raise _Refused(f"manifest of {reply.length} bytes is over the {MAX_MANIFEST} byte limit")
                try:
                    raw = reply.read_all(MAX_MANIFEST, self.transport.progress_timeout)
                except TooLargeError:
                    raise _Refused(f"manifest is over the {MAX_MANIFEST} byte limit") from None
                media = str(reply.headers.get("Content-Type", "")).split(";")[0].strip()
                header_digest = str(reply.headers.get("Docker-Content-Digest", ""))
            finally:
                reply.close()
            digest = "sha256:" + hashlib.sha256(raw).hexdigest()
            if by_digest and digest != tag_or_digest:
                raise _Refused(f"manifest digest mismatch: got {digest}, want {tag_or_digest}")
            if header_digest.startswith("sha256:") and header_digest != digest:
                raise _Refused(f"manifest digest mismatch: got {digest}, the registry says {header_digest}")
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                raise _Refused("manifest is not a JSON object")
            if media not in MANIFEST_MEDIA and isinstance(doc.get("mediaType"), str):
                media = doc["mediaType"]
            return raw, media, digest

        return self._each_host(
            f"manifest {tag_or_digest}",
            "manifests",
            tag_or_digest,
            ACCEPT,
            "pull" if by_digest else "resolve",
            use,
        )

    @contextlib.contextmanager
    def open_blob(self, digest: str, size: int | None = None) -> Iterator[BlobStream]:
        """The blob ``digest`` as a stream to read (not verified: the reader hashes what it reads).
        A read that waits ``progress_timeout`` for a byte raises StalledError (a PullError)
        naming the blob and the host; with ``size`` (the manifest's), more bytes raise too."""
        hex_of(digest)

        def use(host: RegistryHost, reply: Reply) -> BlobStream:
            if size is not None and reply.length is not None and reply.length > size:
                reply.close()
                raise _Refused(f"blob of {reply.length} bytes where the manifest declares {size}")
            return BlobStream(reply, digest, host.url, self.transport.progress_timeout, size)

        stream = self._each_host(f"blob {digest}", "blobs", digest, "", "pull", use)
        try:
            yield stream
        finally:
            stream.close()

    def blob(self, digest: str, dest: str, size: int | None = None) -> None:
        """Download a blob to ``dest``, verifying its digest (nothing is left at ``dest`` on error)."""
        want = hex_of(digest)
        h = hashlib.sha256()
        with replacing(dest) as out, self.open_blob(digest, size) as stream:
            while chunk := stream.read(1024 * 1024):
                h.update(chunk)
                out.write(chunk)
            if h.hexdigest() != want:
                raise PullError(f"blob digest mismatch for {digest} from {stream.host}")

    # ------------------------------------------------------------------ hosts in order

    def url(self, host: RegistryHost, kind: str, tag_or_digest: str) -> str:
        url = f"{host.scheme}://{host.netloc}{host.root}/{self.ref.path}/{kind}/{tag_or_digest}"
        if host.mirror:
            url += "?" + urllib.parse.urlencode({"ns": self.ref.domain})
        return url

    def _each_host(
        self,
        what: str,
        kind: str,
        tag_or_digest: str,
        accept: str,
        capability: str,
        use: Callable[[RegistryHost, Reply], T],
    ) -> T:
        hosts = [h for h in self.hosts if h.can("pull") and h.can(capability)]
        if not hosts:
            raise PullError(
                f"{what} of {self.ref.repository}: no configured host has the {capability!r} capability"
            )
        failures: list[tuple[RegistryHost, str, str]] = []
        for i, host in enumerate(hosts):
            with self._lock:
                down = self._down.get(host.url)
            if down is not None:
                failures.append((host, _UNAVAILABLE, f"not asked again: {down}"))
                continue
            try:
                reply = self._ask(host, self.url(host, kind, tag_or_digest), accept)
                if reply.status == 200:
                    return use(host, reply)
                kind_, reason = _status(reply)
                reply.close()
            except (AuthError, RedirectError, _Refused) as exc:
                kind_, reason = _REFUSED, str(exc)
            except TransportError as exc:
                kind_, reason = _UNAVAILABLE, str(exc)
                with self._lock:
                    self._down[host.url] = reason
            except PullError as exc:
                kind_, reason = _REFUSED, str(exc)
            failures.append((host, kind_, reason))
            log.warning(
                "registry.host_failed",
                host=host.url,
                reason=reason,
                image=str(self.ref),
                request=what,
                next=hosts[i + 1].url if i + 1 < len(hosts) else "",
            )
        raise _all_failed(f"{what} of {self.ref.repository}", failures)

    def _ask(self, host: RegistryHost, url: str, accept: str) -> Reply:
        """GET ``url`` of ``host``, answering its auth challenges; the reply (any status but 401)."""
        headers = [("Accept", accept)] if accept else []
        for _ in range(3):
            sent = self.auth.header(host)
            private = [*host.headers, *((("Authorization", sent),) if sent else ())]
            reply = self.transport.request(host, url, headers, private=private)
            if reply.status != 401:
                return reply
            challenge = str(reply.headers.get("WWW-Authenticate", ""))
            reply.close()
            self.auth.unauthorized(host, challenge, sent)
        raise AuthError("still unauthorized after authenticating (HTTP 401)")


def _status(reply: Reply) -> tuple[str, str]:
    """The kind and reason of a failed answer, with the registry's own error code if it gives one."""
    detail = ""
    if reply.status != 404:
        try:
            body = reply.read_all(64 * 1024, 5.0)
            errors = json.loads(body).get("errors") or []
            detail = "; ".join(f"{e.get('code', '')}: {e.get('message', '')}"[:200] for e in errors[:3])
        except (PullError, ValueError, AttributeError, TypeError):
            detail = ""
    reason = f"HTTP {reply.status}" + (f" ({detail})" if detail else f" {reply.resp.reason}".rstrip())
    if reply.status == 404:
        return _NOT_FOUND, "not found (HTTP 404)"
    if reply.status >= 500 or reply.status == 429:
        return _UNAVAILABLE, reason
    return _REFUSED, reason


def _all_failed(what: str, failures: list[tuple[RegistryHost, str, str]]) -> Exception:
    every = "every host failed: " if len(failures) > 1 else ""
    text = f"{what}: {every}" + "; ".join(f"{host.url}: {reason}" for host, _, reason in failures)
    last = failures[-1][1]
    if last == _NOT_FOUND:
        return NotFoundError(text)
    if last == _UNAVAILABLE:
        return UnavailableError(text)
    return PullError(text)
