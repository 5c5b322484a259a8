"""The agent protocol's operations as typed messages, shared by the host and the guest.

Each operation of PROTOCOL.md is a request dataclass (its ``OP`` is the wire name, its
generic argument the result type) and a result dataclass. On the wire they are the JSON
objects PROTOCOL.md describes: ``to_dict`` writes one, ``from_dict`` reads and checks
one. A missing or wrongly typed field is an ``invalid`` :class:`AgentError` naming the
field (``spec.rootfs.lowers[2]: expected str, got int``); keys a message does not know
are ignored, so a newer peer may add optional fields within version 1.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Self, TypeVar, cast

from backends.contract.usage import Detail, Interface, Sample
from backends.runv.agent.protocol import AgentError

__all__ = [
    "EXIT_EVENT",
    "REQUESTS",
    "AttachRequest",
    "ContainerLimits",
    "ContainerList",
    "ContainerMetrics",
    "ContainerSpec",
    "ContainerState",
    "CreateRequest",
    "Created",
    "Dns",
    "Empty",
    "ExecKillRequest",
    "ExecReply",
    "ExecRequest",
    "Hello",
    "HelloRequest",
    "ListRequest",
    "Message",
    "MetricsReply",
    "MetricsRequest",
    "Mount",
    "NetworkRequest",
    "NetworkResult",
    "OutputRequest",
    "PortForwardRequest",
    "RemoveRequest",
    "Request",
    "ResizeRequest",
    "Rootfs",
    "Route",
    "Seccomp",
    "SetupRequest",
    "ShutdownRequest",
    "SignalRequest",
    "StartRequest",
    "StateRequest",
    "StatsReply",
    "StatsRequest",
    "UpdateRequest",
    "User",
    "WaitRequest",
]

EXIT_EVENT = "exit"  # body: ContainerState


# --------------------------------------------------------------------------- conversion


def _invalid(path: str, what: str) -> AgentError:
    return AgentError("invalid", f"{path}: {what}")


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


_FIELDS: dict[type[Any], tuple[tuple[str, Any, bool], ...]] = {}


def _fields(cls: type[Any]) -> tuple[tuple[str, Any, bool], ...]:
    """(name, resolved type, required) of a dataclass, resolved once per class."""
    found = _FIELDS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _FIELDS[cls] = tuple(
            (
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
            if f.init
        )
    return found


def _read(tp: Any, value: Any, path: str) -> Any:
    """``value`` (decoded JSON) as a ``tp``, checked; raise ``invalid`` naming ``path``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is types.UnionType or origin is typing.Union:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _read(inner, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise _invalid(path, f"expected bool, got {_kind(value)}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _invalid(path, f"expected int, got {_kind(value)}")
        return value
    if tp is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _invalid(path, f"expected number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _invalid(path, f"expected str, got {_kind(value)}")
        return value
    if origin is list or origin is tuple:
        if not isinstance(value, list | tuple):
            raise _invalid(path, f"expected list, got {_kind(value)}")
        item = typing.get_args(tp)[0]
        items = [_read(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise _invalid(path, f"expected object, got {_kind(value)}")
        item = typing.get_args(tp)[1]
        return {str(k): _read(item, v, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _read_object(tp, value, path)
    raise TypeError(f"{path}: no wire form for {tp!r}")  # a bug in a message definition


def _read_object(cls: type[Any], value: Any, path: str) -> Any:
    if not isinstance(value, Mapping):
        raise _invalid(path or cls.__name__, f"expected object, got {_kind(value)}")
    kwargs: dict[str, Any] = {}
    for name, tp, required in _fields(cls):
        where = f"{path}.{name}" if path else name
        if name not in value:
            if required:
                raise _invalid(where, "missing")
            continue
        kwargs[name] = _read(tp, value[name], where)
    return cls(**kwargs)


def _write(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _write(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_write(v) for v in value]
    if isinstance(value, dict):
        return {k: _write(v) for k, v in value.items()}
    return value


class Message:
    """A protocol object: a frozen dataclass with a JSON-object wire form."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _write(self)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """Read and check a wire object; ``invalid`` AgentError naming the bad field."""
        return cast(Self, _read_object(cls, data, ""))


R = TypeVar("R", bound=Message)


class Request(Message, Generic[R]):
    """A request of operation ``OP``, answered by a ``RESULT``."""

    __slots__ = ()
    OP: ClassVar[str]
    RESULT: ClassVar[type[Message]]

    def result(self, data: Any) -> R:
        return cast(R, self.RESULT.from_dict(data))


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True, slots=True)
class Empty(Message):
    """The result of an operation that only has an effect."""


@dataclasses.dataclass(frozen=True, slots=True)
class Hello(Message):
    version: int
    pid: int
    containers: int


@dataclasses.dataclass(frozen=True, slots=True)
class NetworkResult(Message):
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Created(Message):
    pid: int
    # The identity the container's processes run with, as the agent resolved it in the image.
    uid: int = 0
    gid: int = 0
    groups: list[int] = dataclasses.field(default_factory=list)  # supplementary, the primary gid too


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerState(Message):
    id: str
    status: str  # created | running | exited
    pid: int = 0
    exit_code: int = 0  # shell convention: 128 + signal
    started_at: int = 0  # ns
    finished_at: int = 0  # ns
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerList(Message):
    containers: list[ContainerState] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class ExecReply(Message):
    exit_code: int


@dataclasses.dataclass(frozen=True, slots=True)
class StatsReply(Message):
    cpu_ns: int = 0
    memory_bytes: int = 0
    working_set_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerMetrics(Message):
    sample: Sample
    detail: Detail | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsReply(Message):
    containers: dict[str, ContainerMetrics] = dataclasses.field(default_factory=dict)
    interfaces: list[Interface] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------- parts of requests


@dataclasses.dataclass(frozen=True, slots=True)
class Dns(Message):
    servers: list[str] = dataclasses.field(default_factory=list)
    searches: list[str] = dataclasses.field(default_factory=list)
    options: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerLimits(Message):
    cpu_quota: int = 0
    cpu_period: int = 0  # 0: 100000
    cpu_shares: int = 0
    memory: int = 0  # bytes
    oom_score_adj: int = 0  # the container's processes', -1000..1000 (the kubelet's by QoS class)


@dataclasses.dataclass(frozen=True, slots=True)
class Rootfs(Message):
    """An overlay (``lowers`` top to bottom, ``upper``, ``work``) or a bind of ``path``."""

    lowers: list[str] = dataclasses.field(default_factory=list)
    upper: str = ""
    work: str = ""
    path: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class User(Message):
    """Resolved in the image's /etc/passwd and /etc/group; a name wins over an ID."""

    uid: int | None = None
    name: str = ""
    gid: int | None = None
    group: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Mount(Message):
    source: str  # a guest path the hypervisor driver returned for a share
    destination: str
    readonly: bool = False
    propagation: str = "rprivate"  # or rslave, rshared
    recursive_readonly: bool = False  # read-only with every mount below it
    # Flags of the bind (Mount.mount_options but ro, which is readonly): noexec, nodev, nosuid.
    options: list[str] = dataclasses.field(default_factory=list)
    # An image volume: the image's layer shares (top first) the agent stacks read-only
    # (source is then unused), and the directory of it to mount ("" for its root).
    image_lowers: list[str] = dataclasses.field(default_factory=list)
    image_sub_path: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Seccomp(Message):
    """The agent's runtime default, or a Docker-format profile (kept as the JSON it is)."""

    default: bool = False
    profile: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class IdMap(Message):
    """One range of a user namespace: IDs container_id.. inside are host_id.. outside."""

    container_id: int
    host_id: int
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerSpec(Message):
    """What ``create`` runs; the agent turns it into an OCI config (``oci.build_config``)."""

    args: list[str]
    rootfs: Rootfs = Rootfs()
    env: list[str] = dataclasses.field(default_factory=list)  # K=V
    cwd: str = ""
    user: User = User()
    supplemental_groups: list[int] = dataclasses.field(default_factory=list)
    # "merge": also the groups of the image's /etc/group that list the user (the CRI default);
    # "strict": only the primary group and supplemental_groups.
    groups_policy: str = "merge"
    # A user namespace of the pod (both empty: the VM's own): the container's root is not the VM's.
    uid_mappings: list[IdMap] = dataclasses.field(default_factory=list)
    gid_mappings: list[IdMap] = dataclasses.field(default_factory=list)
    tty: bool = False
    stdin: bool = False
    stdin_once: bool = False
    privileged: bool = False
    readonly_rootfs: bool = False
    no_new_privs: bool = False
    add_caps: list[str] = dataclasses.field(default_factory=list)  # CAP_ALL: all
    drop_caps: list[str] = dataclasses.field(default_factory=list)
    resources: ContainerLimits = ContainerLimits()
    mounts: list[Mount] = dataclasses.field(default_factory=list)
    pid_mode: str = "container"  # container | pod | node | target
    pid_target: str = ""  # target: the container whose PID namespace it joins (an ephemeral container's)
    masked_paths: list[str] = dataclasses.field(default_factory=list)  # empty: the defaults
    readonly_paths: list[str] = dataclasses.field(default_factory=list)
    seccomp: Seccomp | None = None  # None: unconfined


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True, slots=True)
class HelloRequest(Request[Hello]):
    OP = "hello"
    RESULT = Hello


@dataclasses.dataclass(frozen=True, slots=True)
class SetupRequest(Request[Empty]):
    OP = "setup"
    RESULT = Empty
    hostname: str = ""
    dns: Dns = Dns()
    sysctls: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Route(Message):
    destination: str  # a CIDR, or "default"
    via: str = ""  # the gateway; empty: on the link


@dataclasses.dataclass(frozen=True, slots=True)
class NetworkRequest(Request[NetworkResult]):
    OP = "network"
    RESULT = NetworkResult
    interface: str
    address: str  # CIDR
    name: str = ""  # empty: keep the interface's name
    gateway: str = ""  # a default route via it
    mtu: int = 0
    # A pod on CNI: the interface as the plugins made it on the host side.
    more_addresses: list[str] = dataclasses.field(default_factory=list)  # CIDRs: IPv6, a second range
    routes: list[Route] = dataclasses.field(default_factory=list)
    mac: str = ""  # empty: keep the interface's own


@dataclasses.dataclass(frozen=True, slots=True)
class CreateRequest(Request[Created]):
    OP = "create"
    RESULT = Created
    id: str
    spec: ContainerSpec


@dataclasses.dataclass(frozen=True, slots=True)
class StartRequest(Request[ContainerState]):
    OP = "start"
    RESULT = ContainerState
    id: str


@dataclasses.dataclass(frozen=True, slots=True)
class SignalRequest(Request[Empty]):
    OP = "signal"
    RESULT = Empty
    id: str
    signal: int = 15


@dataclasses.dataclass(frozen=True, slots=True)
class WaitRequest(Request[ContainerState]):
    OP = "wait"
    RESULT = ContainerState
    id: str


@dataclasses.dataclass(frozen=True, slots=True)
class StateRequest(Request[ContainerState]):
    OP = "state"
    RESULT = ContainerState
    id: str


@dataclasses.dataclass(frozen=True, slots=True)
class ListRequest(Request[ContainerList]):
    OP = "list"
    RESULT = ContainerList


@dataclasses.dataclass(frozen=True, slots=True)
class RemoveRequest(Request[Empty]):
    OP = "remove"
    RESULT = Empty
    id: str


@dataclasses.dataclass(frozen=True, slots=True)
class OutputRequest(Request[Empty]):
    OP = "output"
    RESULT = Empty
    id: str
    stream: int
    stamped: bool = False  # each frame starts with its time (guest.STAMP), which the host logs
    # A host re-subscribing says what its log holds: per stream, the time of its last piece.
    resume: bool = False
    after_stdout: int = 0
    after_stderr: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class AttachRequest(Request[Empty]):
    OP = "attach"
    RESULT = Empty
    id: str
    stream: int
    stdin: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ExecRequest(Request[ExecReply]):
    OP = "exec"
    RESULT = ExecReply
    id: str
    stream: int
    args: list[str]
    env: list[str] = dataclasses.field(default_factory=list)
    stdin: bool = False
    tty: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ExecKillRequest(Request[Empty]):
    OP = "exec_kill"
    RESULT = Empty
    stream: int
    id: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ResizeRequest(Request[Empty]):
    """The terminal of an exec (``stream``) or of a TTY container (``id``)."""

    OP = "resize"
    RESULT = Empty
    width: int
    height: int
    stream: int = 0
    id: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateRequest(Request[Empty]):
    OP = "update"
    RESULT = Empty
    id: str
    resources: ContainerLimits = ContainerLimits()


@dataclasses.dataclass(frozen=True, slots=True)
class StatsRequest(Request[StatsReply]):
    OP = "stats"
    RESULT = StatsReply
    id: str


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsRequest(Request[MetricsReply]):
    OP = "metrics"
    RESULT = MetricsReply
    ids: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class PortForwardRequest(Request[Empty]):
    OP = "port_forward"
    RESULT = Empty
    port: int
    stream: int


@dataclasses.dataclass(frozen=True, slots=True)
class ShutdownRequest(Request[Empty]):
    OP = "shutdown"
    RESULT = Empty


REQUESTS: tuple[type[Request[Any]], ...] = (
    HelloRequest,
    SetupRequest,
    NetworkRequest,
    CreateRequest,
    StartRequest,
    SignalRequest,
    WaitRequest,
    StateRequest,
    ListRequest,
    RemoveRequest,
    OutputRequest,
    AttachRequest,
    ExecRequest,
    ExecKillRequest,
    ResizeRequest,
    UpdateRequest,
    StatsRequest,
    MetricsRequest,
    PortForwardRequest,
    ShutdownRequest,
)
