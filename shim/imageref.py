"""Image references as Docker and containerd normalise them.

``busybox`` → ``docker.io/library/busybox:latest``; ``repo@sha256:…`` keeps
its digest; a first path component with a dot, a colon or ``localhost`` is
a registry host.
"""

from __future__ import annotations

import dataclasses
import re

DEFAULT_DOMAIN = "docker.io"
_DIGEST_RE = re.compile(r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_PATH_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")


class BadReference(ValueError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class ImageRef:
    repository: str  # domain/path
    tag: str = ""
    digest: str = ""

    @property
    def name(self) -> str:
        """The canonical name: repo:tag, or repo@digest."""
        if self.digest:
            return f"{self.repository}@{self.digest}"
        return f"{self.repository}:{self.tag or 'latest'}"

    @property
    def tagged(self) -> str:
        return f"{self.repository}:{self.tag or 'latest'}"


def parse(ref: str) -> ImageRef:
    if not ref or ref != ref.strip() or len(ref) > 4096:
        raise BadReference(f"invalid image reference {ref!r}")
    name, digest = ref, ""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise BadReference(f"invalid digest in image reference {ref!r}")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG_RE.match(tag):
            raise BadReference(f"invalid tag in image reference {ref!r}")
    parts = name.split("/", 1)
    if len(parts) == 2 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        domain, path = parts
    else:
        domain, path = DEFAULT_DOMAIN, name
    if domain == DEFAULT_DOMAIN and "/" not in path:
        path = "library/" + path
    if not _PATH_RE.match(path):
        raise BadReference(f"invalid repository name in image reference {ref!r}")
    if not tag and not digest:
        tag = "latest"
    return ImageRef(f"{domain}/{path}", tag, digest)
