"""Checks: their results, their registry and how a harness runs them.

A check is a function of the harness returning a `Result` (or raising
`CheckFailed`), registered by the `check` decorator; pod_checks.py and
api_checks.py hold them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.e2e.kubelet.runner import Harness

# The groups, in the order they run and are reported, with their titles.
GROUPS = {"pod": "static pods", "api": "kubelet API"}


@dataclasses.dataclass(frozen=True)
class Result:
    ok: bool
    reason: str


class CheckFailed(Exception):
    """Raised by a check (or its helpers) to fail with a reason."""


def passed(reason: str) -> Result:
    return Result(True, reason)


def short(body: bytes, n: int = 200) -> str:
    text = body.decode(errors="replace").strip().replace("\n", "\\n")
    return text if len(text) <= n else text[:n] + "..."


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    group: str  # a key of GROUPS
    number: int
    fn: Callable[[Harness], Result]
    timeout: float
    doc: str
    # Started before every other check and judged after them: for what takes long to show.
    begin: Callable[[Harness], object] | None = None


CHECKS: list[Check] = []  # in GROUPS order, then by number


def check(
    group: str, number: int, timeout: float = 30.0, begin: Callable[[Harness], object] | None = None
) -> Callable[[Callable[[Harness], Result]], Any]:
    def register(fn: Callable[[Harness], Result]) -> Callable[[Harness], Result]:
        name = fn.__name__.removeprefix("check_").replace("_", "-")
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        CHECKS.append(Check(f"{group}-{name}", group, number, fn, timeout, doc, begin))
        CHECKS.sort(key=lambda c: (list(GROUPS).index(c.group), c.number))
        return fn

    return register


def run_checks(
    h: Harness, names: set[str] | None = None, budget: float = 180.0
) -> list[tuple[Check, Result, float]]:
    """Run the checks, one at a time; those that would start after `budget` seconds do not run."""
    end = time.monotonic() + budget
    selected = [c for c in CHECKS if names is None or c.name in names]
    for c in selected:
        if c.begin is not None:
            c.begin(h)
    ordered = sorted(selected, key=lambda c: c.begin is not None)
    results = []
    for c in ordered:
        t0 = time.monotonic()
        if t0 >= end:
            result = Result(False, f"not run: the checks' budget of {budget:.0f} s is spent")
        else:
            result = run_one(h, c, min(c.timeout, end - t0 + 5))
        elapsed = time.monotonic() - t0
        h.log(f"{c.name}: {'pass' if result.ok else 'FAIL'} ({elapsed:.1f} s) {result.reason}")
        results.append((c, result, elapsed))
    order = {c.name: i for i, c in enumerate(CHECKS)}
    return sorted(results, key=lambda r: order[r[0].name])


def run_one(h: Harness, c: Check, timeout: float) -> Result:
    """Run a check in a thread of its own, bounded by `timeout`."""
    box: list[Result] = []

    def target() -> None:
        try:
            box.append(c.fn(h))
        except CheckFailed as exc:
            box.append(Result(False, str(exc)))
        except Exception as exc:
            box.append(Result(False, f"{type(exc).__name__}: {exc}"))

    t = threading.Thread(target=target, name=c.name, daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        return Result(False, f"timed out after {timeout:.0f} s")
    return box[0]
