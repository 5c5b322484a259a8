"""The shim's records of pods and containers, as backends receive them.

The shim owns every CRI rule (IDs, names, the state machine, validation,
filters, idempotency, persistence, log paths); a backend performs effects and
may keep its own small bookkeeping in ``record.backend_data``, which the shim
persists and never reads. What the shim reports of a backend's work is in typed
fields the backend sets (a container's ``stop_signal``, ``image_volume_refs``,
``effective_user``). Records carry the original CRI config messages.

Only the shim's store changes a record once it is made (``shim/cri/store.py``
says in which order); a backend fills in its own fields (``image_ref``, the
typed fields above, ``backend_data``) of a record it is creating or starting,
and the shim's write that follows records them. ``revision`` counts the store's
changes of a record: whatever is built from a record (an encoded answer) is
good while the revision it was built at is the record's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cri_api import api_pb2 as pb


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
    revision: int = dataclasses.field(default=0, repr=False, compare=False)  # the store's changes of it
    # Kept on the record so that they die with it, for the shim's edge (shim/cri/answers.py): the
    # encoded List entry and the revision it was built at; config.labels as a dict.
    wire: tuple[int, bytes] | None = dataclasses.field(default=None, repr=False, compare=False)
    label_map: dict[str, str] | None = dataclasses.field(default=None, repr=False, compare=False)

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
    revision: int = dataclasses.field(default=0, repr=False, compare=False)
    wire: tuple[int, bytes] | None = dataclasses.field(default=None, repr=False, compare=False)
    label_map: dict[str, str] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def state(self) -> pb.ContainerState:
        return self.status.state
