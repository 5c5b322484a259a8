"""The kubelet's and the shim's logs, their problems grouped and counted for the report."""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from pathlib import Path

KLOG_ERROR = re.compile(r"^E\d{4} \d{2}:\d{2}:\d{2}\.\d+\s+\d+ (?P<msg>.*)$")
_NORMALIZE = [
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uid>"),
    (re.compile(r"\b[0-9a-f]{12,64}\b"), "<id>"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?"), "<time>"),
    (re.compile(r"/tmp/k-[A-Za-z0-9_]+"), "<dir>"),
    (re.compile(r"\b\d+(\.\d+)?(ms|s|µs)\b"), "<dur>"),
    (re.compile(r"attempt=\d+|Attempt:\d+"), "attempt=<n>"),
    (re.compile(r"127\.0\.0\.1:(?!5000\b)\d+"), "127.0.0.1:<port>"),
    # kuberuntime_manager's dump of a whole container spec: its name is enough
    (re.compile(r"&Container\{Name:([^,]+),.*\} (start failed)"), r"&Container{Name:\1,...} \2"),
]


def _normalize(line: str, limit: int = 260) -> str:
    for pattern, repl in _NORMALIZE:
        line = pattern.sub(repl, line)
    return line if len(line) <= limit else line[:limit] + "..."


def _grouped(path: Path, key: Callable[[str], str | None]) -> collections.Counter[str]:
    """The lines of a log that ``key`` picks, under the key it gives them, counted."""
    counts: collections.Counter[str] = collections.Counter()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return counts
    for line in text.splitlines():
        picked = key(line)
        if picked is not None:
            counts[_normalize(picked)] += 1
    return counts


def shim_problems(path: Path) -> collections.Counter[str]:
    """The shim's warnings and errors, and its RPCs that did not answer OK, grouped."""

    def key(line: str) -> str | None:
        if re.search(r"\[(warning|error|critical)\s*\]|\b(Traceback|ERROR|WARNING)\b", line) or (
            " rpc " in line and "code=OK" not in line
        ):
            line = re.sub(r"^\S+Z \[(\w+)\s*\]\s+", r"\1 ", line)
            return re.sub(r"\s+ms=\S+", "", line)
        return None

    return _grouped(path, key)


def klog_errors(path: Path) -> collections.Counter[str]:
    """klog lines at level E, grouped by source location and message (IDs and times folded)."""

    def key(line: str) -> str | None:
        m = KLOG_ERROR.match(line)
        return m.group("msg") if m else None

    return _grouped(path, key)
