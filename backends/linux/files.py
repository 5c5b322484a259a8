"""Files written so that a reader, or a restart after a crash, sees the old content or the new, whole;
and what a folder of per-record entries holds that no record claims any more."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO


@contextlib.contextmanager
def replacing(path: str) -> Iterator[BinaryIO]:
    """A file to write ``path``'s new content to: a temporary file beside it, which, when the
    block ends without an exception, is synced, renamed over ``path``, and the directory synced
    so that the rename survives a crash. An exception removes it and leaves ``path`` alone.

    The temporary file's name starts with a dot and ends in ``.tmp``, so that a directory
    scanned for ``*.json`` or ``*.conflist`` never takes it for one of its files.
    """
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` (see :func:`replacing`)."""
    with replacing(path) as f:
        f.write(data)


def unclaimed(folder: str, known: Iterable[str]) -> list[str]:
    """The names in ``folder`` that are not in ``known``: none when ``folder`` is "" or not there."""
    if not folder or not os.path.isdir(folder):
        return []
    keep = set(known)
    return [name for name in os.listdir(folder) if name not in keep]
