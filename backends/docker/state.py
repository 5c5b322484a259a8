"""What the backend knows of each live sandbox and container, beyond the shim's records.

One object per CRI ID, kept in one table and dropped in one place when the
object is removed: nothing of a removed container lingers (its output pump,
its OOM flag, its layer's usage).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from backends.contract import ExitInfo, ExitLatch

from .engine_api import EngineStream


class Followed(Protocol):
    """What the table holds of a running container's process: :class:`.logs.DockerProcess`,
    which imports this module (this one does not import it back)."""

    @property
    def exit(self) -> ExitLatch: ...

    def exited(self, info: ExitInfo) -> None: ...

    def stopped(self) -> None: ...


@dataclasses.dataclass(eq=False)
class LogFollow:
    """A log pump's followed stream, and whether it is to finish without following."""

    tty: bool
    resp: EngineStream | None = None
    finishing: bool = False


@dataclasses.dataclass(eq=False)
class Tracked:
    """A sandbox's pause container or an app container, as the backend follows it."""

    cri_id: str
    engine_id: str
    watched: bool = False  # running: an exit it was not asked for is reported
    stopping: bool = False  # being stopped on request: its exit is not an event
    reporting: bool = False  # its exit is being looked into
    retrying: bool = False  # to be looked at again once the engine answers
    died: bool = False  # the engine said it died while it was not watched yet (a start in progress)


@dataclasses.dataclass(eq=False)
class SandboxState(Tracked):
    warm_id: str = ""  # a warm pause container's label ID, which is not the pod's (see warm.py)


@dataclasses.dataclass(eq=False)
class ContainerState(Tracked):
    process: Followed | None = None  # while it runs: what the shim follows
    follow: LogFollow | None = None  # the open stream of its process's output
    tty: bool = False
    exit: ExitInfo | None = None  # how it ended, heard before anything followed it
    oom: bool = False  # the engine reported an OOM kill in it
    layer_usage: tuple[float, int, int] | None = None  # (monotonic when, bytes, inodes) of its layer


class States:
    """The table of :class:`Tracked` objects by CRI ID."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, SandboxState] = {}
        self.containers: dict[str, ContainerState] = {}
        self.warm_ids: dict[str, str] = {}  # label ID of a warm pause container -> its pod's CRI ID

    def get(self, cri_id: str) -> Tracked | None:
        """By CRI ID, or by the label ID an engine event carries (a warm pod's differs)."""
        cri_id = self.warm_ids.get(cri_id, cri_id)
        return self.containers.get(cri_id) or self.sandboxes.get(cri_id)

    def sandbox(self, cri_id: str, engine_id: str, warm_id: str = "") -> SandboxState:
        st = self.sandboxes.get(cri_id)
        if st is None:
            st = self.sandboxes[cri_id] = SandboxState(cri_id, engine_id)
        st.engine_id = engine_id
        if warm_id:
            st.warm_id = warm_id
            self.warm_ids[warm_id] = cri_id
        return st

    def container(self, cri_id: str, engine_id: str) -> ContainerState:
        st = self.containers.get(cri_id)
        if st is None:
            st = self.containers[cri_id] = ContainerState(cri_id, engine_id)
        st.engine_id = engine_id
        return st

    def watched(self) -> list[Tracked]:
        return [st for st in (*self.sandboxes.values(), *self.containers.values()) if st.watched]

    def drop_sandbox(self, cri_id: str) -> None:
        st = self.sandboxes.pop(cri_id, None)
        if st is not None:
            st.watched = False
            self.warm_ids.pop(st.warm_id, None)

    def drop_container(self, cri_id: str) -> None:
        """Forget a removed container."""
        st = self.containers.pop(cri_id, None)
        if st is None:
            return
        st.watched = False
