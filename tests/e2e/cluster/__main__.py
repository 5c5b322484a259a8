"""``python -m tests.e2e.cluster up [--runtime cri-shim|containerd] [--runv-driver stub|qemu]|down|check [--keep]``, ``... conformance [--focus RE] ...``,
``... scale --nodes N [--pods-per-node 30]``, as root.

up: exits 0 with the cluster running (the admin kubeconfig printed), 1 when the bring-up failed
(what came up is taken down again unless --keep), 2 when it cannot run here. down: exits 0 when
nothing is left, 1 otherwise (each leftover printed). check: lists what is left, exits 1 if any.
conformance: the [Conformance] specs of e2e.test on the running cluster (``conformance`` module),
printed as passed/failed/skipped with each failure's first line; exits 0 when none failed.
scale: the control plane, one ``cri-shim hollow`` and N kubelets, a Deployment of P pods per node,
the figures printed (``scale`` module), then everything taken down (--keep: left up); exits 0 when
every pod ran and nothing was left, 1 otherwise, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.e2e import cluster
from tests.e2e.cluster import bringup, conformance, scale
from tests.e2e.cluster.layout import LOGS, RUNV_DRIVERS, Binaries
from tests.e2e.node_e2e import report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.e2e.cluster", description=(cluster.__doc__ or "").split("\n")[0]
    )
    p.add_argument("command", choices=("up", "down", "check", "conformance", "scale"))
    p.add_argument(
        "--keep",
        action="store_true",
        help="up: keep what came up when the bring-up fails; down: keep the logs (copied to /tmp); "
        "scale: leave the cluster up after the figures",
    )
    p.add_argument(
        "--runtime",
        choices=("cri-shim", "containerd"),
        default="cri-shim",
        help="up: the nodes' runtime: cri-shim (docker, runv and fake nodes) or, as the comparison, "
        "containerd (two nodes, each on a containerd of its own)",
    )
    p.add_argument(
        "--runv-driver",
        choices=RUNV_DRIVERS,
        default="stub",
        help="up: the runv node's driver: stub (processes) or qemu (real QEMU VMs, TCG here: slow; "
        "templates and virtio-fs on); the pytest module reads CRI_SHIM_CLUSTER_RUNV_DRIVER",
    )
    c = p.add_argument_group("conformance")
    c.add_argument(
        "--focus", default="", help="a regex narrowing the specs (default: every [Conformance] one)"
    )
    c.add_argument("--skip", default="", help="a regex of specs to leave out")
    c.add_argument("--procs", type=int, default=3, help="processes for the specs that are not [Serial]")
    c.add_argument(
        "--phase", choices=("parallel", "serial", "both"), default="both", help="[Serial] ones apart"
    )
    c.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per phase before interrupting")
    c.add_argument("--out", type=Path, help="logs, reports, results.txt (default: /tmp/...)")
    c.add_argument("--baseline", type=Path, help="a results.txt of another run to compare with")
    s = p.add_argument_group("scale")
    s.add_argument("--nodes", type=int, default=5, help="hollow nodes, each with a real kubelet")
    s.add_argument("--pods-per-node", type=int, default=30, help="the Deployment's pods per node")
    s.add_argument("--rest", type=float, default=30, help="seconds sampled before and after the rollout")
    s.add_argument("--ready-timeout", type=float, default=300, help="seconds for every node to be Ready")
    s.add_argument("--running-timeout", type=float, default=900, help="seconds for every pod to run")
    s.add_argument("--json", type=Path, help="write the figures there too")
    args = p.parse_args(argv)
    b = Binaries.from_env()
    if args.command == "scale":
        return _scale(b, args)
    if args.command == "conformance":
        return _conformance(b, args)
    if args.command == "check":
        left = bringup.check()
        for line in left:
            print(line)
        return 1 if left else 0
    if args.command == "down":
        left = bringup.down(b, keep_logs=args.keep)
        for line in left:
            print(f"left: {line}")
        return 1 if left else 0
    problem = bringup.environment_problem(b, args.runtime, args.runv_driver)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    try:
        state = bringup.up(b, keep_on_failure=args.keep, runtime=args.runtime, runv_driver=args.runv_driver)
    except (RuntimeError, TimeoutError) as exc:
        where = f"\nlogs: {LOGS}" if args.keep else ""  # else copied to /tmp by the take-down
        print(f"bring-up failed: {exc}{where}", file=sys.stderr)
        return 1
    shown = {k: state.get(k) for k in ("runtime", "runv_driver", "timings", "cni")}
    print(json.dumps(shown, indent=2))
    print(f"up in {state.get('up_seconds')} s; kubectl --kubeconfig={cluster.admin_kubeconfig()} get nodes")
    return 0


def _scale(b: Binaries, args: argparse.Namespace) -> int:
    opts = scale.Options(
        nodes=args.nodes,
        pods_per_node=args.pods_per_node,
        rest=args.rest,
        ready_timeout=args.ready_timeout,
        running_timeout=args.running_timeout,
    )
    problem = scale.environment_problem(b, opts)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    try:
        result = scale.run(b, opts, keep=args.keep)
    except (RuntimeError, TimeoutError) as exc:
        print(f"scale run failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(scale.table(result))
    left = result.get("left_after_down", [])
    for line in left:
        print(f"left: {line}")
    return 1 if left or result.get("rollout", {}).get("timed_out") else 0


def _conformance(b: Binaries, args: argparse.Namespace) -> int:
    problem = b.problem() or conformance.suite_problem(b)
    if problem or not bringup.is_up():
        print(
            f"cannot run: {problem or 'no cluster is up (python -m tests.e2e.cluster up)'}", file=sys.stderr
        )
        return 2
    out = args.out or Path(f"/tmp/crishim-conformance-{time.strftime('%Y%m%dT%H%M%S')}")
    phases = ("parallel", "serial") if args.phase == "both" else (args.phase,)
    opts = conformance.Options(
        out=out, procs=args.procs, focus=args.focus, skip=args.skip, phases=phases, timeout=args.timeout
    )
    codes, specs = conformance.run(b, opts)
    report.write_lines(specs, out / "results.txt")
    baseline = report.read_baseline(args.baseline) if args.baseline else None
    runtime = bringup.state().get("runtime") or "cri-shim"
    title = f"conformance on the {runtime} cluster ({', '.join(phases)}), suite exits {codes}"
    report.print_report(title, specs, baseline)
    print(f"results: {out / 'results.txt'}; logs: {out}/PHASE/suite.log")
    return 0 if report.counts(specs)["failed"] == 0 and not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
