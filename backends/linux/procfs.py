"""Reading processes from /proc.

The one reader of ``/proc/PID/stat`` and of ``/proc/PID/mountinfo`` for the host side and
the runv guest agent alike (the agent ships ``backends/linux`` into the VM with its own
code): standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import re


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


@dataclasses.dataclass(frozen=True, slots=True)
class Mount:
    """What is read of a line of ``/proc/PID/mountinfo`` (proc(5))."""

    point: str  # the mount point, unescaped
    fstype: str
    super_options: str  # "rw,memory" for a cgroup v1 hierarchy


_OCTAL = re.compile(rb"\\([0-7]{3})")  # how mountinfo writes a space, tab, newline or backslash


def mounts(pid: int | str = "self") -> list[Mount]:
    """The mounts ``pid`` sees, in its mount namespace (OSError if it is gone)."""
    out = []
    with open(f"/proc/{pid}/mountinfo", "rb") as fh:
        for line in fh:
            left, _, right = line.partition(b" - ")
            fstype, _source, *options = right.split()
            point = _OCTAL.sub(lambda o: bytes([int(o[1], 8)]), left.split()[4])
            out.append(Mount(os.fsdecode(point), fstype.decode(), (options[0] if options else b"").decode()))
    return out
