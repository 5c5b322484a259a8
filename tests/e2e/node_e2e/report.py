"""The suite's ginkgo JSON report read into results, printed, and compared with a baseline.

One line a spec in the baseline format of ../shared/testenv/baseline
(``STATE<TAB>[It] full text``), so that two runs diff line by line.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, TextIO

# What ginkgo v2 calls a spec that ran and did not pass.
FAILED = ("failed", "panicked", "timedout", "interrupted", "aborted")


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str  # "[It] " + container texts + leaf text, as ginkgo prints it
    state: str  # passed, skipped, failed, ... (ginkgo's word)
    error: str  # the failure's (or skip's) first line
    seconds: float
    ran: bool  # False: not selected by the focus or label filter (or not reached)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def load(path: Path) -> list[Spec]:
    """The It specs of a ginkgo JSON report (a list of suite reports)."""
    suites: list[dict[str, Any]] = json.loads(path.read_text())
    specs = []
    for suite in suites:
        for r in suite.get("SpecReports") or []:
            if r.get("LeafNodeType") != "It":
                continue  # suite-level setup and teardown nodes
            texts = [*(r.get("ContainerHierarchyTexts") or []), r.get("LeafNodeText", "")]
            failure = r.get("Failure") or {}
            message = str(failure.get("Message", ""))
            specs.append(
                Spec(
                    name="[It] " + " ".join(t for t in texts if t),
                    state=str(r.get("State", "")),
                    error=_first_line(message),
                    seconds=float(r.get("RunTime") or 0) / 1e9,
                    # The focus and label filters skip a spec without a word; a Skip() in
                    # the spec (e2eskipper) always says why.
                    ran=r.get("State") != "skipped" or bool(message),
                )
            )
    return specs


def counts(specs: list[Spec]) -> collections.Counter[str]:
    """passed / failed / skipped among the specs that ran (failed covers panics and timeouts)."""
    return collections.Counter("failed" if s.state in FAILED else s.state for s in specs if s.ran)


def read_baseline(path: Path) -> dict[str, str]:
    """Spec name -> state of a baseline file (``#`` lines are comments)."""
    states = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#") and "\t" in line:
            state, name = line.split("\t", 1)
            states[name] = state
    return states


def write_lines(specs: list[Spec], path: Path) -> None:
    path.write_text("".join(f"{s.state}\t{s.name}\n" for s in sorted(specs, key=lambda s: s.name) if s.ran))


def print_report(
    title: str, specs: list[Spec], baseline: dict[str, str] | None, out: TextIO = sys.stdout
) -> None:
    n = counts(specs)
    print(f"\n== {title} ==", file=out)
    print(f"-- passed {n['passed']}, failed {n['failed']}, skipped {n['skipped']}", file=out)
    for s in specs:
        if s.ran and s.state in FAILED:
            print(f"  FAIL ({s.state}, {s.seconds:.0f}s) {s.name}\n       {s.error}", file=out)
    for s in specs:
        if s.ran and s.state == "skipped":
            print(f"  skip {s.name}\n       {s.error}", file=out)
    if baseline is None:
        return
    ran = {s.name: s.state for s in specs if s.ran}
    common = sorted(set(ran) & set(baseline))
    worse = [name for name in common if baseline[name] == "passed" and ran[name] != "passed"]
    better = [name for name in common if baseline[name] != "passed" and ran[name] == "passed"]
    print(f"-- against the baseline: {len(common)} specs in both", file=out)
    print(f"   baseline passed, this run did not: {len(worse)}", file=out)
    for name in worse:
        print(f"     {ran[name]}  {name}", file=out)
    print(f"   this run passed, baseline did not: {len(better)}", file=out)
    for name in better:
        print(f"     {baseline[name]}  {name}", file=out)
