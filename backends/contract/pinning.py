"""Which images a store reports ``pinned`` (exempt from the kubelet's image garbage collection):
the sandbox image and the ``[images] pinned`` patterns, matched the same way by every backend.

A pattern is either a reference, normalised as a pull normalises it (``busybox:1.36`` is
``docker.io/library/busybox:1.36``; ``busybox`` is ``...:latest``), which must equal one of an
image's repo tags or repo digests; or a glob, where ``*`` stands for any run of characters
(``/`` and ``:`` too) and nothing else is special, matched in full and without regard to case
against each tag and digest, written in full and in the short form Docker prints
(``busybox:1.36`` for ``docker.io/library/busybox:1.36``). CRI-O's ``pinned_images`` forms all fit:
exact (``quay.io/x/y:1``), prefix (``quay.io/x/*``) and keyword (``*pause*``).

The CRI calls ``pinned`` a recommendation: a client may still remove a pinned image, and the
runtime must oblige (api.proto, ``Image.pinned``), as CRI-O does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from backends.contract.errors import InvalidArgumentError
from backends.reference import DEFAULT_DOMAIN, BadReference, parse

# What a glob may hold: the characters of references, and "*".
_GLOB = re.compile(r"[A-Za-z0-9._:/@\[\]*-]+")


@dataclasses.dataclass(frozen=True, slots=True)
class PinnedImages:
    exact: frozenset[str] = frozenset()
    globs: tuple[re.Pattern[str], ...] = ()

    @classmethod
    def of(cls, patterns: Iterable[str], sandbox_image: str = "") -> PinnedImages:
        """The matcher of ``patterns`` and the sandbox image (when it is a reference);
        InvalidArgumentError naming a pattern that is neither a reference nor a glob."""
        exact: set[str] = set()
        globs: list[re.Pattern[str]] = []
        for pattern in patterns:
            if "*" in pattern:
                if not _GLOB.fullmatch(pattern):
                    raise InvalidArgumentError(
                        f"pinned: {pattern!r} is not an image reference or a glob of one (only * is special)"
                    )
                body = ".*".join(re.escape(part) for part in pattern.split("*"))
                globs.append(re.compile(body, re.IGNORECASE))
                continue
            try:
                exact.add(parse(pattern).name)
            except BadReference as exc:
                raise InvalidArgumentError(f"pinned: {pattern!r} is not an image reference: {exc}") from None
        if sandbox_image:
            try:
                exact.add(parse(sandbox_image).name)
            except BadReference:
                pass  # a backend without a usable sandbox image pins none
        return cls(frozenset(exact), tuple(globs))

    def __bool__(self) -> bool:
        return bool(self.exact or self.globs)

    def matches(self, repo_tags: Iterable[str], repo_digests: Iterable[str]) -> bool:
        """Whether an image of these tags and digests is pinned."""
        if not self:
            return False
        for name in (*repo_tags, *repo_digests):
            if name in self.exact:
                return True
            if self.globs and any(g.fullmatch(form) for g in self.globs for form in _forms(name)):
                return True
        return False


def _forms(name: str) -> tuple[str, ...]:
    """A name in full and, on Docker Hub, as Docker prints it."""
    hub = DEFAULT_DOMAIN + "/"
    if not name.startswith(hub):
        return (name,)
    short = name[len(hub) :]
    return (name, short.removeprefix("library/"), short) if short.startswith("library/") else (name, short)
