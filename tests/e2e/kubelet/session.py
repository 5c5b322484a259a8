"""One run: start the shim and the kubelet, run the checks, stop everything, print the report."""

from __future__ import annotations

import sys
from typing import Any

# Imported for their @check registrations.
from tests.e2e.kubelet import api_checks, cni_checks, pod_checks  # noqa: F401
from tests.e2e.kubelet.checks import GROUPS, Check, Result, in_order, run_checks
from tests.e2e.kubelet.runner import Harness


def report(
    handler: str, results: list[tuple[Check, Result, float]], h: Harness, out: Any = sys.stdout
) -> None:
    width = max(len(c.name) for c, _, _ in results) if results else 10
    network = f", CNI network {h.cni.net.subnet} on {h.cni.net.bridge}" if h.cni is not None else ""
    print(f"\n== kubelet e2e, handler {handler} (node {h.node}{network}) ==", file=out)
    for group, title in GROUPS.items():
        rows = [r for r in results if r[0].group == group]
        if not rows:
            continue
        n_ok = sum(1 for _, r, _ in rows if r.ok)
        print(f"-- {title}: {n_ok}/{len(rows)} passed", file=out)
        for c, r, elapsed in rows:
            word = "pass" if r.ok else "FAIL"
            print(f"  {c.number:>2} {c.name:<{width}}  {word}  {elapsed:5.1f}s  {r.reason}", file=out)
    for title, counts in (
        ("kubelet E-lines", h.kubelet_errors()),
        ("cri-shim warnings, errors, non-OK RPCs", h.shim_errors()),
    ):
        total = sum(counts.values())
        print(f"-- {title}: {total} lines, {len(counts)} distinct", file=out)
        for line, n in counts.most_common():
            print(f"  {n:>5}  {line}", file=out)


def run(
    handler: str,
    keep: bool = False,
    names: set[str] | None = None,
    out: Any = sys.stdout,
    warm: int = 0,
    driver: str = "stub",
    guest_dir: str = "",
    transport: str = "native",
    hollow: int = 0,
    cni: bool = False,
    qos: bool = False,
) -> tuple[list[tuple[Check, Result, float]], Harness]:
    """Start everything, run the checks, stop everything, judge what the stop left, print the report."""
    h = Harness(
        handler,
        keep=keep,
        warm=warm,
        driver=driver,
        guest_dir=guest_dir,
        transport=transport,
        hollow=hollow,
        cni=cni,
        qos=qos,
    )
    results: list[tuple[Check, Result, float]] = []
    checked = False
    try:
        h.start(settle_timeout=900.0 if driver == "qemu" else 90.0)
        results = run_checks(h, names)
        checked = True
    finally:
        try:
            h.stop()
            if checked:
                results = in_order(results + run_checks(h, names, after_stop=True))
        finally:
            report(handler, results, h, out)
            if keep:
                print(f"-- logs: {h.kubelet_log} {h.shim_log}", file=out)
    return results, h
