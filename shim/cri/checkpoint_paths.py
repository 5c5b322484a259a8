"""Where the runtime may write and read a checkpoint (CheckpointContainer, CheckpointPod,
RestorePod, and CreateContainer from a checkpoint archive).

An absolute path, written without ``..``, ``.`` or doubled slashes, that is not ``/`` and not
under ``/proc``, ``/sys``, ``/dev`` nor the shim's own state directory; what must be there (a
directory, an existing or empty one, a regular file) is checked per call. Anything else is
INVALID_ARGUMENT, said with the field's name. The checks of what is on disk block: they run in
a worker thread.
"""

from __future__ import annotations

import os
import posixpath

from shim.cri.errors import InvalidArgumentError
from shim.cri.state import Shim

# Where no checkpoint is written nor read: the kernel's and the devices' file systems.
_FORBIDDEN = ("/proc", "/sys", "/dev")


def _under(path: str, top: str) -> bool:
    top = top.rstrip("/") or "/"
    return path == top or path.startswith(top + "/")


def allowed_path(shim: Shim, field: str, path: str) -> str:
    """``path`` if the runtime may write or read a checkpoint there, else InvalidArgument naming
    ``field`` (see the module's doc)."""
    if not path:
        raise InvalidArgumentError(f"{field} must not be empty")
    if "\0" in path:
        raise InvalidArgumentError(f"{field} must not contain a NUL byte")
    if not path.startswith("/"):
        raise InvalidArgumentError(f"{field} {path!r} must be an absolute path")
    if ".." in path.split("/"):
        raise InvalidArgumentError(f"{field} {path!r} must not contain '..'")
    trimmed = path.rstrip("/") or "/"
    if posixpath.normpath(trimmed) != trimmed:
        raise InvalidArgumentError(f"{field} {path!r} must be a normal path (no '.' nor '//')")
    if trimmed == "/":
        raise InvalidArgumentError(f"{field} must not be the root directory")
    forbidden = (*_FORBIDDEN, os.path.abspath(shim.config.server.state_dir))
    for top in forbidden:
        if _under(trimmed, top):
            raise InvalidArgumentError(f"{field} {path!r} is under {top}, where no checkpoint may be written")
    return trimmed


def directory(field: str, path: str, empty: bool) -> None:
    """``path`` is an existing directory (not a link), ``empty`` if asked."""
    if os.path.islink(path) or not os.path.isdir(path):
        raise InvalidArgumentError(f"{field} {path!r} is not an existing directory")
    if empty and os.listdir(path):
        raise InvalidArgumentError(f"{field} {path!r} is not empty")


def archive_to_write(field: str, path: str) -> None:
    """``path`` names a file in an existing directory (not a directory itself)."""
    if not os.path.isdir(os.path.dirname(path)):
        raise InvalidArgumentError(f"{field} {path!r}: its directory does not exist")
    if os.path.isdir(path):
        raise InvalidArgumentError(f"{field} {path!r} is a directory; it names the archive to write")


def archive_to_read(field: str, path: str) -> None:
    """``path`` is an existing regular file (not a link)."""
    if not os.path.lexists(path):
        raise InvalidArgumentError(f"{field}: checkpoint archive {path!r} does not exist")
    if os.path.islink(path) or not os.path.isfile(path):
        raise InvalidArgumentError(f"{field}: checkpoint archive {path!r} is not a regular file")
