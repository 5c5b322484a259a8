"""What backends report: value types with no behaviour."""

from __future__ import annotations

import dataclasses
import json
import signal

from backends.contract.errors import InvalidArgumentError
from backends.contract.records import ContainerRecord, SandboxStatus
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


@dataclasses.dataclass(frozen=True, slots=True)
class PodCheckpoint:
    """A pod checkpoint a backend has read and verified for RestorePod: the metadata names of
    its containers (which the request's container configs must name exactly) and what the
    backend needs to restore them (its own, opaque to the shim)."""

    container_names: tuple[str, ...]
    data: object = None


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerCheckpoint:
    """A container checkpoint (the archive CheckpointContainer wrote, or an image made from it) a
    backend has read and verified for a CreateContainer whose image names it: the checkpointed
    container's config (what the request leaves empty is taken from it) and what the backend
    needs to restore it (its own, opaque to the shim)."""

    config: pb.ContainerConfig
    data: object = None


def image_user(config_user: str) -> tuple[int | None, str]:
    """(uid, username) of an OCI image config's ``User`` ("1002", "www-data", "1003:1004"...)."""
    user = config_user.partition(":")[0]
    if not user:
        return None, ""
    if user.isdigit():
        return int(user), ""
    return None, user


_PREFIX = "SIGNAL_"  # every CRI Signal value's name starts with it (since cri-api 2026-07)


def _bare_name(cri_signal: int) -> str:
    """A CRI ``Signal``'s name without the enum's prefix: SIGTERM, SIGRTMINPLUS3 (ValueError
    for a number the enum has no name for)."""
    return pb.Signal.Name(cri_signal).removeprefix(_PREFIX)


def signal_by_name(name: str) -> int:
    """The CRI ``Signal`` a record names, as written now (SIGNAL_SIGTERM) or before the enum's
    values were renamed (SIGTERM, RUNTIME_DEFAULT); 0 (RUNTIME_DEFAULT) for "" or no such name."""
    for candidate in (name, _PREFIX + name):
        if candidate in pb.Signal.keys():
            return int(pb.Signal.Value(candidate))
    return pb.SIGNAL_RUNTIME_DEFAULT


def host_signal(cri_signal: int) -> int | None:
    """The host's number for a CRI ``Signal`` (a container's stop signal); None for
    RUNTIME_DEFAULT, or a value this host has no signal for. The real-time ones count from
    the C library's SIGRTMIN and SIGRTMAX, as ``kill -l`` names them."""
    if not cri_signal:
        return None
    try:
        name = _bare_name(cri_signal)
    except ValueError:
        return None
    if name.startswith("SIGRTMINPLUS"):
        return int(signal.SIGRTMIN) + int(name.removeprefix("SIGRTMINPLUS"))
    if name.startswith("SIGRTMAXMINUS"):
        return int(signal.SIGRTMAX) - int(name.removeprefix("SIGRTMAXMINUS"))
    found = getattr(signal, name, None)
    return int(found) if isinstance(found, signal.Signals) else None


def signal_name(cri_signal: int) -> str:
    """A CRI ``Signal`` as people, images and the Docker Engine write it: SIGTERM, SIGRTMIN+3,
    SIGRTMAX-1; "" for RUNTIME_DEFAULT or a value this host has no signal for."""
    if host_signal(cri_signal) is None:
        return ""
    name = _bare_name(cri_signal)
    return name.replace("PLUS", "+").replace("MINUS", "-")


def _by_number() -> dict[int, int]:
    """Host signal number -> the CRI ``Signal`` naming it (the first name of aliases: SIGABRT
    before SIGIOT, SIGCHLD before SIGCLD, SIGIO before SIGPOLL)."""
    out: dict[int, int] = {}
    for value in pb.Signal.values():
        number = host_signal(value)
        if number is not None:
            out.setdefault(number, value)
    return out


_CRI_BY_NUMBER = _by_number()


def cri_signal(text: str) -> int:
    """The CRI ``Signal`` of a signal as an image config's STOPSIGNAL names it (SIGQUIT, QUIT,
    3, SIGRTMIN+3, RTMAX-1; any case); RUNTIME_DEFAULT (0) when it names none this host has."""
    text = text.strip().upper()
    if text.isdecimal():
        return _CRI_BY_NUMBER.get(int(text), pb.SIGNAL_RUNTIME_DEFAULT)
    name = text if text.startswith("SIG") else "SIG" + text
    name = _PREFIX + name.replace("+", "PLUS").replace("-", "MINUS")
    try:
        value = int(pb.Signal.Value(name))
    except ValueError:
        return pb.SIGNAL_RUNTIME_DEFAULT
    return value if host_signal(value) is not None else pb.SIGNAL_RUNTIME_DEFAULT


def decide_stop_signal(container: ContainerRecord, image_signal: str) -> int:
    """The signal the runtime stops ``container`` with, as a CRI ``Signal``, recorded in its
    ``stop_signal`` for ContainerStatus: its config's ``stop_signal``, else the image's
    STOPSIGNAL (``image_signal``, as the image config writes it), else SIGTERM, as every
    runtime does."""
    chosen: int = container.config.stop_signal
    if host_signal(chosen) is None:
        chosen = cri_signal(image_signal) or pb.SIGNAL_SIGTERM
    container.stop_signal = chosen
    return chosen


def recorded_stop_signal(container: ContainerRecord) -> int:
    """The stop signal :func:`decide_stop_signal` recorded; for a container created before
    records held one, its config's, else SIGTERM."""
    if container.stop_signal:
        return container.stop_signal
    chosen: int = container.config.stop_signal
    return chosen if host_signal(chosen) is not None else pb.SIGNAL_SIGTERM


@dataclasses.dataclass(frozen=True, slots=True)
class Seccomp:
    """What seccomp a container asked for: "unconfined", "default" (the runtime's own profile)
    or "localhost" with the profile file's JSON text (checked to be a JSON object)."""

    kind: str
    profile: str = ""


def seccomp_of(
    profile: pb.SecurityProfile | None, deprecated_path: str = "", privileged: bool = False
) -> Seccomp:
    """A container's (or pod's) seccomp, from its ``seccomp`` field or else the deprecated
    ``seccomp_profile_path`` string. As containerd: nothing asked for is unconfined, and so is
    a privileged container. A profile that cannot be read is INVALID_ARGUMENT."""
    if privileged:
        return Seccomp("unconfined")
    if profile is None:
        path = deprecated_path
        if path in ("", "unconfined"):
            return Seccomp("unconfined")
        if path in ("runtime/default", "docker/default"):
            return Seccomp("default")
        if not path.startswith("localhost/"):
            raise InvalidArgumentError(f"unknown seccomp profile {path!r}")
        profile = pb.SecurityProfile(profile_type=pb.SecurityProfile.Localhost, localhost_ref=path[10:])
    if profile.profile_type == pb.SecurityProfile.Unconfined:
        return Seccomp("unconfined")
    if profile.profile_type == pb.SecurityProfile.RuntimeDefault:
        return Seccomp("default")
    ref = profile.localhost_ref
    try:
        with open(ref) as fh:
            text = fh.read()
        parsed = json.loads(text)
    except OSError as exc:
        raise InvalidArgumentError(f"seccomp profile {ref!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidArgumentError(f"seccomp profile {ref!r}: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgumentError(f"seccomp profile {ref!r} is not a JSON object")
    return Seccomp("localhost", text)
