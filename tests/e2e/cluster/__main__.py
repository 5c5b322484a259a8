"""``python -m tests.e2e.cluster up|down|check [--keep]``, as root.

up: exits 0 with the cluster running (the admin kubeconfig printed), 1 when the bring-up failed
(what came up is taken down again unless --keep), 2 when it cannot run here. down: exits 0 when
nothing is left, 1 otherwise (each leftover printed). check: lists what is left, exits 1 if any.
"""

from __future__ import annotations

import argparse
import json
import sys

from tests.e2e import cluster
from tests.e2e.cluster import bringup
from tests.e2e.cluster.layout import LOGS, Binaries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.e2e.cluster", description=(cluster.__doc__ or "").split("\n")[0]
    )
    p.add_argument("command", choices=("up", "down", "check"))
    p.add_argument(
        "--keep",
        action="store_true",
        help="up: keep what came up when the bring-up fails; down: keep the logs (copied to /tmp)",
    )
    args = p.parse_args(argv)
    b = Binaries.from_env()
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
    problem = bringup.environment_problem(b)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    try:
        state = bringup.up(b, keep_on_failure=args.keep)
    except (RuntimeError, TimeoutError) as exc:
        where = f"\nlogs: {LOGS}" if args.keep else ""  # else copied to /tmp by the take-down
        print(f"bring-up failed: {exc}{where}", file=sys.stderr)
        return 1
    print(json.dumps({"timings": state.get("timings"), "cni": state.get("cni")}, indent=2))
    print(f"up in {state.get('up_seconds')} s; kubectl --kubeconfig={cluster.admin_kubeconfig()} get nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
