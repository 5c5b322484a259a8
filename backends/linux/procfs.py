"""Reading processes from /proc."""

from __future__ import annotations


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (its main thread's), [] when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return []
