"""The command line: ``python -m tests.e2e.node_e2e --handler docker [--focus REGEX] [--procs N]``, as root.

``--endpoint unix:///run/containerd-cri/containerd.sock`` (instead of a handler) runs
the same suite, kubelet and flags on another runtime, for the side-by-side figure.

Exits 0 when every spec that ran passed, 1 when one failed (or the suite
gave no report), 2 when the suite cannot run here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tests.e2e import node_e2e
from tests.e2e.kubelet.runner import HANDLERS
from tests.e2e.node_e2e import report
from tests.e2e.node_e2e.suite import LABELS, Binaries, RunOptions, environment_problem, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.e2e.node_e2e", description=(node_e2e.__doc__ or "").split("\n")[0]
    )
    p.add_argument("--handler", choices=HANDLERS, default="docker", help="the shim's default handler")
    p.add_argument(
        "--endpoint", help="run on this runtime (unix://...) instead of a private cri-shim (the comparison)"
    )
    p.add_argument("--driver", choices=("stub", "qemu"), default="stub", help="runv: the hypervisor driver")
    p.add_argument(
        "--procs", type=int, default=1, help="parallel processes of the suite (needs E2E_NODE_GINKGO)"
    )
    p.add_argument("--focus", help="ginkgo --focus: a regular expression on the spec names")
    p.add_argument("--label-filter", default=LABELS, help=f"ginkgo --label-filter (default: {LABELS!r})")
    p.add_argument(
        "--out", type=Path, help="where the logs, the report and the results go (default: /tmp/...)"
    )
    p.add_argument(
        "--baseline", type=Path, help="a results file to compare with (../shared/testenv/baseline/)"
    )
    p.add_argument("--max-seconds", type=float, default=5400, help="interrupt the suite after this long")
    args = p.parse_args(argv)
    binaries = Binaries.from_env()
    handler = None if args.endpoint else args.handler
    problem = environment_problem(handler, binaries, args.procs, args.endpoint)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    who = handler or "peer"
    out = args.out or Path(f"/tmp/node-e2e-{who}-{time.strftime('%Y%m%d-%H%M%S')}")
    opts = RunOptions(args.max_seconds, args.label_filter, args.focus, args.procs, args.driver)
    rc, left = run(handler, binaries, out, opts, endpoint=args.endpoint)
    json_report = out / "report.json"
    if not json_report.exists():
        print(f"the suite (exit {rc}) wrote no report: see {out / 'suite.log'}", file=sys.stderr)
        return 1
    specs = report.load(json_report)
    report.write_lines(specs, out / "results.txt")
    baseline = report.read_baseline(args.baseline) if args.baseline else None
    title = f"handler {handler}" if handler else f"runtime {args.endpoint}"
    report.print_report(f"node e2e, {title}, suite exit {rc}", specs, baseline)
    print(f"-- sandboxes left by the suite, removed: {len(left)}")
    for m in left:
        print(f"     {m.namespace}/{m.name}")
    print(f"-- logs and results: {out}")
    return 0 if report.counts(specs)["failed"] == 0 and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
