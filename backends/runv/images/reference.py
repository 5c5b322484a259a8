"""Docker-style image references: ``[registry/]repo[:tag][@digest]`` normalised."""

from __future__ import annotations

import dataclasses
import re

DEFAULT_REGISTRY = "docker.io"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    registry: str  # as named: docker.io, 127.0.0.1:5000
    repository: str  # library/busybox
    tag: str = ""
    digest: str = ""

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    @property
    def api_host(self) -> str:
        return "registry-1.docker.io" if self.registry == DEFAULT_REGISTRY else self.registry

    def tagged(self) -> str:
        return f"{self.name}:{self.tag}" if self.tag else ""

    def digested(self, digest: str) -> str:
        return f"{self.name}@{digest}"

    def __str__(self) -> str:
        return self.digested(self.digest) if self.digest else self.tagged()


def parse(ref: str) -> Reference:
    if not ref or ref != ref.strip():
        raise ValueError(f"invalid image reference {ref!r}")
    digest = ""
    if "@" in ref:
        ref, digest = ref.split("@", 1)
        if not _DIGEST.match(digest):
            raise ValueError(f"invalid digest {digest!r}")
    tag = ""
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        ref, tag = ref[:colon], ref[colon + 1 :]
        if not re.match(r"^[\w][\w.-]{0,127}$", tag):
            raise ValueError(f"invalid tag {tag!r}")
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, repo = first, rest
    else:
        registry, repo = DEFAULT_REGISTRY, ref
    if registry == DEFAULT_REGISTRY and "/" not in repo:
        repo = f"library/{repo}"
    if not re.match(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$", repo):
        raise ValueError(f"invalid repository {repo!r}")
    if not tag and not digest:
        tag = "latest"
    return Reference(registry, repo, tag, digest)
