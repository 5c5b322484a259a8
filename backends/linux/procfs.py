"""Reading processes from /proc.

The one reader of ``/proc/PID/stat`` for the host side and the runv guest agent alike (the
agent ships ``backends/linux`` into the VM with its own code): standard library only.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Stat:
    """What is read of a process's ``/proc/PID/stat`` (proc(5) fields 3, 4 and 22)."""

    state: str  # R, S, D, Z (zombie: dead, not yet reaped), X, T, ...
    ppid: int
    start_time: int  # clock ticks since boot: with the PID, it tells a reused PID apart


def stat(pid: int) -> Stat | None:
    """The state, parent and start time of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # The command name (field 2) is parenthesised and may hold anything, ")" and spaces too:
    # the other fields follow its last ")".
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return Stat(fields[0].decode(), int(fields[1]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (its main thread's), [] when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return []
