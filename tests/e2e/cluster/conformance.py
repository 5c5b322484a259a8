"""The Kubernetes conformance suite (e2e.test, ``[Conformance]``) on the harness's cluster.

Opt-in, as root, on a cluster that ``up`` left running: ``python -m tests.e2e.cluster conformance``.
Two phases, each the tree's ginkgo CLI over the tree's ``e2e.test`` (both from
CRI_SHIM_K8S_BIN_DIR): the ``[Conformance]`` specs that are not ``[Serial]`` in ``--procs``
processes, then the ``[Serial]`` ones in one. The fake node is tainted for the run (``TAINT``,
NoSchedule, and named to the suite as a non-blocking taint): its pods have no processes nor
network, so conformance pods go to the docker and runv nodes. The results are read from ginkgo's JSON reports by the node e2e
report module, one line a spec, so that two runs (a containerd node's, say) diff line by line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from tests.e2e.cluster import bringup
from tests.e2e.cluster.kubectl import Kubectl
from tests.e2e.cluster.layout import Binaries, node
from tests.e2e.cluster.pki import admin_kubeconfig
from tests.e2e.node_e2e import report
from tests.e2e.node_e2e.suite import run_suite

# The fake node carries this taint during the run; the suite is told not to wait for it.
TAINT = "cri-shim.io/conformance=skip:NoSchedule"
TAINT_KEY = TAINT.split("=", 1)[0]


@dataclasses.dataclass(frozen=True)
class Options:
    out: Path
    procs: int = 3
    focus: str = ""  # a regex narrowing the specs (the labels choose the [Conformance] ones)
    skip: str = ""  # more specs to leave out (a regular expression)
    phases: tuple[str, ...] = ("parallel", "serial")
    timeout: float = 4 * 3600  # per phase: then interrupted, and ginkgo writes what it has


def suite_problem(b: Binaries) -> str | None:
    for name in ("ginkgo", "e2e.test"):
        if not os.access(b.path(name), os.X_OK):
            return f"no {name} in {b.bin_dir} (CRI_SHIM_K8S_BIN_DIR): the tree's ginkgo CLI and e2e.test"
    return None


def suite_argv(b: Binaries, opts: Options, phase: str) -> list[str]:
    """ginkgo's command line for one phase; its JSON report is ``OUT/PHASE/report.json``.

    The tree gives each tag both forms, ``[Conformance]`` in the text and a label: the phases
    are chosen by label (``Conformance && !Serial``, ``Conformance && Serial``), which ANDs where
    ginkgo's --focus flags OR; ``opts.focus`` and ``opts.skip`` narrow both as regexes.
    """
    out = opts.out / phase
    labels = "Conformance && !Serial" if phase == "parallel" else "Conformance && Serial"
    procs = opts.procs if phase == "parallel" else 1
    return [
        b.path("ginkgo"),
        f"--procs={procs}",
        f"--label-filter={labels}",
        *([f"--focus={opts.focus}"] if opts.focus else []),
        *([f"--skip={opts.skip}"] if opts.skip else []),
        f"--json-report={out / 'report.json'}",
        "--no-color",
        "-v",
        # ginkgo's own limit (1 h by default) is above ours: the harness interrupts it instead.
        "--timeout=24h",
        b.path("e2e.test"),
        "--",
        f"--kubeconfig={admin_kubeconfig()}",
        "--provider=skeleton",
        # Else the kubectl on PATH: here the cloud SDK's v1.32 wrapper.
        f"--kubectl-path={b.path('kubectl')}",
        f"--non-blocking-taints=node-role.kubernetes.io/control-plane,{TAINT_KEY}",
        f"--report-dir={out}",
    ]


def set_fake_taint(k: Kubectl, on: bool) -> None:
    if node("fake") not in bringup.nodes():  # the containerd comparison has no fake node
        return
    name = node("fake").name
    if on:
        k.run("taint", "node", name, TAINT, "--overwrite")
    else:
        k.run("taint", "node", name, f"{TAINT_KEY}-", check=False)  # absent already: fine


def run(b: Binaries, opts: Options) -> tuple[list[int], list[report.Spec]]:
    """Every phase of `opts`, the fake node tainted meanwhile: the exit codes and the specs."""
    k = Kubectl(b)
    codes: list[int] = []
    specs: list[report.Spec] = []
    set_fake_taint(k, True)
    try:
        for phase in opts.phases:
            started = time.monotonic()
            argv = suite_argv(b, opts, phase)
            print(f"[conformance] {phase}: {' '.join(argv)}", file=sys.stderr)
            codes.append(run_suite(argv, opts.out / phase, opts.timeout, who="conformance"))
            path = opts.out / phase / "report.json"
            got = report.load(path) if path.exists() else []
            print(
                f"[conformance] {phase}: exit {codes[-1]} after {time.monotonic() - started:.0f} s, "
                f"{dict(report.counts(got))}",
                file=sys.stderr,
            )
            specs.extend(got)
    finally:
        set_fake_taint(k, False)
    return codes, specs
