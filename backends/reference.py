"""Image references: the one parser of the project, from the OCI distribution grammar.

    reference   := name [ ":" tag ] [ "@" digest ]
    name        := [ domain "/" ] path           (at most 255 characters)
    domain      := host [ ":" port ]             host: DNS labels, IPv4, or [IPv6]
    path        := component ( "/" component )*
    component   := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
    tag         := [A-Za-z0-9_] [A-Za-z0-9_.-]{0,127}
    digest      := algorithm ":" hex             sha256: 64, sha512: 128 lower-case hex digits

Normalised as Docker and containerd do: a first component is a domain only if
it has a "." or a ":", or is "localhost" (else it is part of the path on
docker.io); a one-component path on docker.io gains "library/"; a reference
with neither tag nor digest means ":latest".
"""

from __future__ import annotations

import dataclasses
import re

DEFAULT_DOMAIN = "docker.io"
MAX_NAME = 255

_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGESTS = {"sha256": re.compile(r"[a-f0-9]{64}"), "sha512": re.compile(r"[a-f0-9]{128}")}


class BadReference(ValueError):
    """Not an image reference; the message says which part is wrong."""


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    domain: str  # as named: docker.io, 127.0.0.1:5000
    path: str  # library/busybox
    tag: str = ""
    digest: str = ""

    @property
    def repository(self) -> str:
        """domain/path: docker.io/library/busybox."""
        return f"{self.domain}/{self.path}"

    @property
    def name(self) -> str:
        """The canonical reference: repository@digest, else repository:tag."""
        return self.digested(self.digest) if self.digest else self.tagged

    @property
    def tagged(self) -> str:
        """repository:tag, or "" for a reference by digest alone."""
        return f"{self.repository}:{self.tag}" if self.tag else ""

    def digested(self, digest: str) -> str:
        return f"{self.repository}@{digest}"

    @property
    def api_host(self) -> str:
        """Where the registry API of the domain answers."""
        return "registry-1.docker.io" if self.domain == DEFAULT_DOMAIN else self.domain

    def __str__(self) -> str:
        return self.name


def parse(ref: str) -> Reference:
    if not ref or ref != ref.strip():
        raise BadReference(f"invalid image reference {ref!r}")
    name, digest = ref, ""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        algorithm, _, hexpart = digest.partition(":")
        check = _DIGESTS.get(algorithm)
        if check is None or not check.fullmatch(hexpart):
            raise BadReference(f"invalid digest {digest!r} in image reference {ref!r}")
    tag = ""
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise BadReference(f"invalid tag {tag!r} in image reference {ref!r}")
    if len(name) > MAX_NAME:
        raise BadReference(f"repository name of {ref[:64]!r}... is longer than {MAX_NAME} characters")
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        if not _DOMAIN.fullmatch(first):
            raise BadReference(f"invalid registry {first!r} in image reference {ref!r}")
        domain, path = first, rest
    else:
        domain, path = DEFAULT_DOMAIN, name
    if domain == DEFAULT_DOMAIN and "/" not in path:
        path = f"library/{path}"
    if not _PATH.fullmatch(path):
        raise BadReference(f"invalid repository name {path!r} in image reference {ref!r}")
    if not tag and not digest:
        tag = "latest"
    return Reference(domain, path, tag, digest)
