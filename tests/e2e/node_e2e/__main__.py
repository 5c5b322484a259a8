"""The command line: ``python -m tests.e2e.node_e2e --handler docker [--focus REGEX]``, as root.

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
from tests.e2e.node_e2e.suite import LABELS, Binaries, environment_problem, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.e2e.node_e2e", description=(node_e2e.__doc__ or "").split("\n")[0]
    )
    p.add_argument("--handler", choices=HANDLERS, default="docker", help="the shim's default handler")
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
    problem = environment_problem(args.handler, binaries)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    out = args.out or Path(f"/tmp/node-e2e-{args.handler}-{time.strftime('%Y%m%d-%H%M%S')}")
    rc, left = run(
        args.handler, binaries, out, labels=args.label_filter, focus=args.focus, timeout=args.max_seconds
    )
    json_report = out / "report.json"
    if not json_report.exists():
        print(f"the suite (exit {rc}) wrote no report: see {out / 'suite.log'}", file=sys.stderr)
        return 1
    specs = report.load(json_report)
    report.write_lines(specs, out / "results.txt")
    baseline = report.read_baseline(args.baseline) if args.baseline else None
    report.print_report(f"node e2e, handler {args.handler}, suite exit {rc}", specs, baseline)
    print(f"-- sandboxes left by the suite, removed: {len(left)}")
    for m in left:
        print(f"     {m.namespace}/{m.name}")
    print(f"-- logs and results: {out}")
    return 0 if report.counts(specs)["failed"] == 0 and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
