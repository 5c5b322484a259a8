"""What backends report: value types with no behaviour."""

from __future__ import annotations

import dataclasses
import signal

from backends.contract.records import SandboxStatus
from cri_api import api_pb2 as pb


@dataclasses.dataclass(frozen=True, slots=True)
class Health:
    runtime_ready: bool
    network_ready: bool
    reason: str = ""
    message: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxNetwork:
    ip: str = ""
    additional_ips: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class ExitInfo:
    exit_code: int
    finished_at: int  # ns
    reason: str = ""  # Completed / Error / OOMKilled / ...
    message: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    """What a backend found of one record during recovery."""

    exists: bool
    running: bool = False
    exit: ExitInfo | None = None
    started_at: int = 0
    status: SandboxStatus | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TerminalSize:
    width: int
    height: int


@dataclasses.dataclass(frozen=True, slots=True)
class ImageInfo:
    """An image as a backend's store knows it; the CRI layer builds the protobuf from it."""

    id: str
    repo_tags: tuple[str, ...] = ()
    repo_digests: tuple[str, ...] = ()
    size: int = 0
    uid: int | None = None  # the image config's user, when numeric
    username: str = ""  # the image config's user, when a name
    pinned: bool = False  # the sandbox image: never garbage-collected


def image_user(config_user: str) -> tuple[int | None, str]:
    """(uid, username) of an OCI image config's ``User`` ("1002", "www-data", "1003:1004"...)."""
    user = config_user.partition(":")[0]
    if not user:
        return None, ""
    if user.isdigit():
        return int(user), ""
    return None, user


def host_signal(cri_signal: int) -> signal.Signals | None:
    """The host signal a CRI ``Signal`` names (a container's stop signal); None for
    RUNTIME_DEFAULT, or a value this host has no signal for."""
    if not cri_signal:
        return None
    try:
        name = pb.Signal.Name(cri_signal)
    except ValueError:
        return None
    found = getattr(signal, name, None)
    return found if isinstance(found, signal.Signals) else None
