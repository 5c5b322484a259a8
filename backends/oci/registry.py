"""A client of the OCI distribution API for one pull: manifests and blobs by digest, the
registry's auth challenges (Basic, and Bearer tokens from the realm it names).

It speaks plain urllib (stdlib): a handful of GETs, and keeping it here avoids a dependency
whose auth and redirect handling we would have to adapt anyway.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from backends import reference
from backends.contract.errors import NotFoundError, UnavailableError
from backends.linux.files import replacing

MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
ACCEPT = ", ".join((MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST, MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST))


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    username: str = ""
    password: str = ""
    auth: str = ""  # base64 user:pass
    identity_token: str = ""
    registry_token: str = ""


class PullError(Exception):
    pass


def hex_of(digest: str) -> str:
    algo, _, value = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise PullError(f"unsupported digest {digest!r}")
    return value


class RegistryClient:
    """Distribution API client for one pull (keeps the bearer token it obtained)."""

    def __init__(self, ref: reference.Reference, creds: Credentials | None, insecure: set[str]) -> None:
        self.ref = ref
        self.creds = creds or Credentials()
        self.scheme = "http" if ref.domain in insecure else "https"
        self._auth_header = ""
        if self.creds.registry_token:
            self._auth_header = f"Bearer {self.creds.registry_token}"

    def _url(self, kind: str, digest_or_tag: str) -> str:
        return f"{self.scheme}://{self.ref.api_host}/v2/{self.ref.path}/{kind}/{digest_or_tag}"

    def _basic(self) -> str:
        if self.creds.auth:
            return f"Basic {self.creds.auth}"
        if self.creds.username:
            raw = f"{self.creds.username}:{self.creds.password}".encode()
            return f"Basic {base64.b64encode(raw).decode()}"
        return ""

    def _authenticate(self, challenge: str) -> None:
        scheme, _, params = challenge.partition(" ")
        if scheme.lower() == "basic":
            self._auth_header = self._basic()
            if not self._auth_header:
                raise PullError("registry requires credentials")
            return
        if scheme.lower() != "bearer":
            raise PullError(f"unsupported auth challenge {challenge!r}")
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        realm = fields.pop("realm", "")
        if not realm:
            raise PullError("bearer challenge without realm")
        query = {k: v for k, v in fields.items() if k in ("service", "scope")}
        query.setdefault("scope", f"repository:{self.ref.path}:pull")
        req = urllib.request.Request(f"{realm}?{urllib.parse.urlencode(query)}")
        basic = self._basic()
        if basic:
            req.add_header("Authorization", basic)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            exc.close()
            raise PullError(f"token request failed: HTTP {exc.code}") from None
        token = body.get("token") or body.get("access_token")
        if not token:
            raise PullError("token endpoint returned no token")
        self._auth_header = f"Bearer {token}"

    @contextlib.contextmanager
    def get(self, url: str, accept: str = "") -> Iterator[Any]:
        for attempt in range(2):
            req = urllib.request.Request(url)
            if accept:
                req.add_header("Accept", accept)
            if self._auth_header:
                req.add_header("Authorization", self._auth_header)
            try:
                resp = urllib.request.urlopen(req, timeout=60)
            except urllib.error.HTTPError as exc:
                exc.close()  # it holds the response socket
                if exc.code == 401 and attempt == 0:
                    self._authenticate(exc.headers.get("WWW-Authenticate", ""))
                    continue
                if exc.code == 404:
                    raise NotFoundError(f"{url}: not found") from None
                raise PullError(f"{url}: HTTP {exc.code}") from None
            except (urllib.error.URLError, OSError) as exc:
                raise UnavailableError(f"registry {self.ref.domain} unreachable: {exc}") from None
            with resp:
                yield resp
            return
        raise PullError(f"{url}: unauthorized")

    def manifest(self, tag_or_digest: str) -> tuple[bytes, str, str]:
        """(raw bytes, media type, digest) of a manifest, verified when asked by digest."""
        with self.get(self._url("manifests", tag_or_digest), ACCEPT) as resp:
            raw: bytes = resp.read(4 * 1024 * 1024)
            media = str(resp.headers.get("Content-Type", "")).split(";")[0].strip()
            header_digest = str(resp.headers.get("Docker-Content-Digest", ""))
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if tag_or_digest.startswith("sha256:") and digest != tag_or_digest:
            raise PullError(f"manifest digest mismatch: got {digest}, want {tag_or_digest}")
        if header_digest.startswith("sha256:") and header_digest != digest:
            raise PullError(f"manifest digest mismatch: got {digest}, registry says {header_digest}")
        if not media:
            media = str(json.loads(raw).get("mediaType", ""))
        return raw, media, digest

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[Any]:
        """The blob ``digest`` as a stream to read (not verified: the reader hashes what it reads)."""
        with self.get(self._url("blobs", digest)) as resp:
            yield resp

    def blob(self, digest: str, dest: str) -> None:
        """Download a blob to ``dest``, verifying its digest."""
        want = hex_of(digest)
        h = hashlib.sha256()
        with replacing(dest) as out, self.open_blob(digest) as resp:
            while chunk := resp.read(1024 * 1024):
                h.update(chunk)
                out.write(chunk)
            if h.hexdigest() != want:
                raise PullError(f"blob digest mismatch for {digest}")
