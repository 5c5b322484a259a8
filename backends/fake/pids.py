"""The fake's PID namespaces: which processes a container's ``ps``, ``pgrep`` and ``pidof`` see.

A running container's main process is one entry here, in the namespace its CRI config names: its
own (it is PID 1), the pod's (shared with the pod's other containers; the pause process is PID 1),
the node's, or its target's (an ephemeral container's). Nothing else runs: the fake has no processes.
"""

from __future__ import annotations

import dataclasses
import posixpath
import sys
from collections.abc import Sequence

from backends.contract import ContainerRecord
from cri_api import api_pb2 as pb

# What is PID 1 of a namespace the container's main process does not head.
_INIT = {"pod": "pause", "node": "init"}


@dataclasses.dataclass(frozen=True, slots=True)
class _Process:
    namespace: str  # the container's ID for its own; "pod:SANDBOX", "node"
    pid: int
    name: str  # its command's name, as /proc/PID/comm has it


class PidNamespaces:
    """The main processes of the running containers, by container ID, with their PIDs. Each start
    and stop costs O(1): a node of the fake runs tens of thousands of containers."""

    def __init__(self) -> None:
        self._processes: dict[str, _Process] = {}
        self._members: dict[str, set[str]] = {}  # namespace: the IDs of its containers
        self._last_pid: dict[str, int] = {}  # per namespace: PIDs are not reused while it lives

    def start(self, c: ContainerRecord, argv: Sequence[str]) -> int:
        """Records ``c``'s main process, running ``argv``; returns its PID in its namespace."""
        self.stop(c.id)
        options = c.config.linux.security_context.namespace_options
        target = self._processes.get(options.target_id) if options.target_id else None
        if options.pid == pb.TARGET and target is not None:
            namespace = target.namespace
        elif options.pid == pb.NODE:
            namespace = "node"
        elif options.pid == pb.POD:
            namespace = sys.intern("pod:" + c.sandbox_id)  # one string for the pod's containers
        else:
            namespace = c.id
        # PID 1 is the namespace's own init, the target's main process, or this one (its own).
        pid = self._last_pid[namespace] = self._last_pid.get(namespace, 0 if namespace == c.id else 1) + 1
        name = posixpath.basename(argv[0])[:15] if argv else ""
        self._processes[c.id] = _Process(namespace, pid, name)
        self._members.setdefault(namespace, set()).add(c.id)
        return pid

    def stop(self, cid: str) -> None:
        gone = self._processes.pop(cid, None)
        if gone is None:
            return
        members = self._members[gone.namespace]
        members.discard(cid)
        if not members:  # the namespace ends with its last process
            del self._members[gone.namespace]
            del self._last_pid[gone.namespace]

    def seen_from(self, cid: str) -> list[tuple[int, str]]:
        """(PID, name) of the processes container ``cid`` sees, by PID; none when it is not running."""
        own = self._processes.get(cid)
        if own is None:
            return []
        seen = [(self._processes[m].pid, self._processes[m].name) for m in self._members[own.namespace]]
        init = _INIT.get(own.namespace.partition(":")[0])
        if init is not None:
            seen.append((1, init))
        return sorted(seen)
