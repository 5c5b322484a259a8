"""A counter as the fake runs it, for the checkpoint tests: a scripted program that writes 1, 2,
3... one number a line every ``STEP`` seconds, and what a checkpoint of it says comes next (a
container restored from that checkpoint must continue from there, not from 1)."""

from __future__ import annotations

import json
import tarfile

STEP = 0.1  # seconds between two numbers
COUNT = 6000  # numbers it writes (10 minutes), then it runs on silently until stopped


def program() -> str:
    """The program, as the fake's annotation or ``programs`` table takes it."""
    return json.dumps(
        {"output": [{"line": str(i), "after": round((i - 1) * STEP, 3)} for i in range(1, COUNT + 1)]}
    )


def numbers(log: bytes) -> list[int]:
    """The numbers of a CRI log file (``TIME STREAM TAG TEXT`` a line)."""
    out = []
    for line in log.decode(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[3].isdigit():
            out.append(int(parts[3]))
    return out


def elapsed_in(archive: str) -> float:
    """How long the checkpointed program had run, as the fake's archive says."""
    with tarfile.open(archive) as tar:
        f = tar.extractfile("manifest.json")
        assert f is not None
        (container,) = json.loads(f.read())["containers"]
    return float(container["elapsed"])


def next_after(elapsed: float) -> int:
    """The first number a counter that had run ``elapsed`` seconds had not written yet."""
    return 1 + sum(1 for i in range(1, COUNT + 1) if round((i - 1) * STEP, 3) <= elapsed)
