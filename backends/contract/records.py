"""The shim's records of pods and containers, as backends receive them.

The shim owns every CRI rule (IDs, names, the state machine, validation,
filters, idempotency, persistence, log paths); a backend performs effects and
may keep its own small bookkeeping in ``record.backend_data``, which the shim
persists and never reads. What the shim reports of a backend's work is in typed
fields the backend sets (a container's ``stop_signal``, ``image_volume_refs``,
``effective_user``). Records carry the original CRI config messages.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

from cri_api import api_pb2 as pb

# Every change of what a List answer is made of gets a number never used before: the shim keeps
# whole List answers while their kind's ``epoch`` is the one they were built at (shim/cri/list_cache.py).
_CHANGES = itertools.count(1)
# The fields a List answer or its filter reads that are ever set after a record is made (its
# entry is rebuilt when ``status`` is replaced; ``committed`` and the state filter decide if it is in).
_LISTED = frozenset({"status", "committed"})


def changed(kind: type[SandboxRecord] | type[ContainerRecord]) -> None:
    """Says that the set of ``kind``'s records, or what a List answer holds of one, changed."""
    kind.epoch = next(_CHANGES)


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxStatus:
    """The mutable part of a sandbox, replaced as a whole."""

    ready: bool = True
    ip: str = ""
    additional_ips: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True, eq=False)
class SandboxRecord:
    id: str
    handler: str  # runtime handler name as the client asked for it ("" resolved)
    backend: str  # name of the backend serving it
    config: pb.PodSandboxConfig
    created_at: int  # ns since the epoch
    status: SandboxStatus = SandboxStatus(ready=False)
    backend_data: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Set once the backend's run_sandbox returned; a record without it at
    # recovery is a half-created leftover.
    committed: bool = False
    # The shim's encoded List entry and the status it was built from (shim/cri/list_cache.py).
    wire: tuple[object, bytes] | None = dataclasses.field(default=None, repr=False, compare=False)
    # config.labels as a dict, made at the first label-filtered List (shim/cri/list_cache.py).
    label_map: dict[str, str] | None = dataclasses.field(default=None, repr=False, compare=False)
    epoch: ClassVar[int] = 0

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in _LISTED:
            changed(SandboxRecord)

    @property
    def state(self) -> pb.PodSandboxState:
        return pb.SANDBOX_READY if self.status.ready else pb.SANDBOX_NOTREADY


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerStatus:
    """The mutable part of a container; the CRI state is derived from it.

    finished_at set -> EXITED, started_at set -> RUNNING, else CREATED.
    """

    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0
    reason: str = ""
    message: str = ""
    pid: int = 0  # informational, for backends whose processes are on the host
    unknown: bool = False  # the runtime lost track of it

    @property
    def state(self) -> pb.ContainerState:
        if self.unknown:
            return pb.CONTAINER_UNKNOWN
        if self.finished_at:
            return pb.CONTAINER_EXITED
        if self.started_at:
            return pb.CONTAINER_RUNNING
        return pb.CONTAINER_CREATED


@dataclasses.dataclass(frozen=True, slots=True)
class EffectiveUser:
    """Who a container's processes are, as the runtime resolved it in the image: the uid, the
    gid and the supplementary groups (ContainerStatus.user)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True, eq=False)
class ContainerRecord:
    id: str
    sandbox_id: str
    backend: str
    config: pb.ContainerConfig
    created_at: int
    log_path: str  # absolute; "" when the kubelet asked for no log
    image_ref: str = ""  # image ID the container was created from
    image_name: str = ""  # the image as the client named it
    status: ContainerStatus = ContainerStatus()
    resources: pb.ContainerResources | None = None  # after UpdateContainerResources
    # What the backend decided at create, which the shim reports (ContainerStatus) and keeps:
    stop_signal: int = 0  # the CRI Signal it is stopped with (decide_stop_signal); 0: none decided
    image_volume_refs: dict[str, str] = dataclasses.field(default_factory=dict)  # container path -> image ID
    effective_user: EffectiveUser | None = None  # None: not resolved by the runtime
    backend_data: dict[str, Any] = dataclasses.field(default_factory=dict)
    committed: bool = False
    wire: tuple[object, bytes] | None = dataclasses.field(default=None, repr=False, compare=False)
    label_map: dict[str, str] | None = dataclasses.field(default=None, repr=False, compare=False)
    epoch: ClassVar[int] = 0

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in _LISTED:
            changed(ContainerRecord)

    @property
    def state(self) -> pb.ContainerState:
        return self.status.state
