"""How many real kubelets on hollow nodes fit on this machine under a real API server.

Runs the cluster harness's scale mode (tests/e2e/cluster/scale.py) at growing N: each step brings
up the control plane, one `cri-shim hollow --nodes N` and N kubelets v1.35, rolls out a
Deployment of N x P pods (default 30 per node), samples every process's CPU and memory, prints
that run's table and takes everything down before the next. It stops at the first step where a
kubelet does not become Ready within --ready-timeout, not every pod runs within
--running-timeout, the time to all Running grows more than --explode times faster than N did
since the previous step, the cluster's own processes take more than --max-busy % of all the
machine's CPUs in the steady phase (every pod Running, nothing changing: the machine cannot hold
N at rest), or the machine's available memory falls under --min-available MiB.
At the end, one summary table over the steps and what stopped the sweep. Figures only.

Run as root from the repository root, with the binaries (docs/cluster.md):
    CRI_SHIM_K8S_BIN_DIR=/work/tools/bin .venv/bin/python bench/cluster_scale.py \\
        [--steps 5,10,20,30,40,60] [--pods-per-node 30] [--rest 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.e2e.cluster import scale  # noqa: E402
from tests.e2e.cluster.layout import Binaries  # noqa: E402


def verdict(prev: dict[str, Any] | None, r: dict[str, Any], args: argparse.Namespace) -> str | None:
    """Why the sweep stops after run `r` (its predecessor `prev`), or None to go on."""
    if "error" in r:
        return f"N={r['nodes']}: {r['error'].splitlines()[0]}"
    if r.get("left_after_down"):
        return f"N={r['nodes']}: down left {len(r['left_after_down'])} things"
    if r["rollout"].get("timed_out"):
        return f"N={r['nodes']}: not every pod Running within {args.running_timeout:.0f} s"
    avail = min((p["host"]["mem_available_min"] for p in r["phases"].values() if p.get("host")), default=None)
    if avail is not None and avail < args.min_available:
        return f"N={r['nodes']}: available memory down to {avail:.0f} MiB"
    steady = r["phases"]["steady"]
    ours = sum(c["cpu"] for c in steady["components"].values()) + (steady["kubelets"] or {}).get("cpu_sum", 0)
    if ours > args.max_busy * (r.get("ncpu") or 1):
        return f"N={r['nodes']}: the cluster's processes take {ours:.0f} % of a core with every pod at rest"
    if prev is not None and "error" not in prev and prev["rollout"].get("all_running"):
        growth = r["rollout"]["all_running"] / max(prev["rollout"]["all_running"], 0.1)
        if growth > args.explode * r["nodes"] / prev["nodes"]:
            return (
                f"N={r['nodes']}: all Running in {r['rollout']['all_running']} s, "
                f"{growth:.1f}x N={prev['nodes']}'s for {r['nodes'] / prev['nodes']:.1f}x the nodes"
            )
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--steps", default="5,10,20,30,40,60,80", help="node counts, in order")
    p.add_argument("--pods-per-node", type=int, default=30)
    p.add_argument("--rest", type=float, default=30, help="seconds sampled before and after each rollout")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--running-timeout", type=float, default=900)
    p.add_argument("--explode", type=float, default=3.0, help="growth of the time to Running over N's")
    p.add_argument(
        "--max-busy", type=float, default=90, help="%% of all CPUs the cluster may take at rest (steady)"
    )
    p.add_argument("--min-available", type=float, default=2048, help="MiB of MemAvailable to keep")
    p.add_argument("--json", type=Path, help="every run's figures")
    args = p.parse_args()
    b = Binaries.from_env()
    steps = [int(x) for x in args.steps.split(",")]
    results: list[dict[str, Any]] = []
    stopped = "every step ran"
    prev = None
    for n in steps:
        opts = scale.Options(
            nodes=n,
            pods_per_node=args.pods_per_node,
            rest=args.rest,
            ready_timeout=args.ready_timeout,
            running_timeout=args.running_timeout,
        )
        problem = scale.environment_problem(b, opts)
        if problem:
            print(f"cannot run N={n}: {problem}", file=sys.stderr)
            return 2
        try:
            r = scale.run(b, opts)
            print(scale.table(r), flush=True)
        except (RuntimeError, TimeoutError) as exc:  # the bring-up took itself down
            r = {"nodes": n, "pods_per_node": args.pods_per_node, "error": str(exc)}
            print(f"N={n}: {exc}", flush=True)
        results.append(r)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        why = verdict(prev, r, args)
        if why:
            stopped = why
            break
        prev = r
        time.sleep(5)
    print()
    print("| N | pods | nodes Ready s | all Running s | API server CPU % / MiB | kubelets CPU % (sum) | "
          "kubelet MiB (mean) | hollow CPU % | host busy % | MemAvailable min MiB |")  # fmt: skip
    print("| --- " * 10 + "|")
    for r in results:
        if "error" in r:
            print(f"| {r['nodes']} | failed: {r['error'].splitlines()[0][:80]} |")
            continue
        s = scale.summary_row(r)
        f = scale.fmt
        print(
            f"| {s['nodes']} | {s['pods']} | {s['ready_s']} | {s['all_running_s']} | "
            f"{f(s['apiserver_cpu'])} / {f(s['apiserver_rss'], 0)} | {f(s['kubelets_cpu'])} | "
            f"{f(s['kubelet_rss_mean'], 0)} | {f(s['hollow_cpu'])} | {f(s['host_busy'])} | "
            f"{f(s['mem_available_min'], 0)} |"
        )
    print(f"stopped: {stopped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
