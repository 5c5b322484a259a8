"""Version latency while the streaming server is abused, from another process, side by side with idle.

cri-shim runs as a child process (`cri-shim serve`, default configuration: the
fake handler) with one running container. The abuse runs in a process of its
own, as a misbehaving client would, using the streaming abuse tests' clients
(tests/streaming/test_streaming_abuse.py): `yes` into SPDY and WebSocket
sessions that never read, PING floods on both transports, garbage after an
upgrade, spent tokens and frames cut in half. Meanwhile this process times
Version calls over gRPC. Rounds alternate an idle phase and an abused phase
(or one abuse at a time with --kinds), so that the machine's noise falls on
both alike; each round prints both p99s and their ratio, and the summary the
median ratio over the rounds (the issue's target: within 2x).

Figures only: nothing is asserted. Usage:
    .venv/bin/python bench/abuse_bench.py [--rounds 8] [--calls 300] [--kinds all,stuck,flood,garbage]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from endpoints import Cri  # noqa: E402
from soak_bench import FakeShim, proc_cpu  # noqa: E402

from cri_api import api_pb2 as pb  # noqa: E402
from cri_api import api_pb2_grpc  # noqa: E402
from tests.criutil import container_config, sandbox_config  # noqa: E402

KINDS = ("all", "stuck", "flood", "garbage")


def pct(samples: list[float], q: float) -> float:
    if not samples:
        return math.nan
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


# ---------------------------------------------------------------- the abusing process


def _abuse(sock: str, cid: str, kind: str, ready: Any, stop: Any, result: Any) -> None:
    """In its own process: abuse until ``stop`` is set; what it did goes to ``result``."""
    from tests.streaming import test_streaming_abuse as t

    async def main() -> dict[str, int]:
        channel = grpc.aio.insecure_channel(f"unix://{sock}")
        r = type("R", (), {"rt": api_pb2_grpc.RuntimeServiceStub(channel)})()  # type: ignore[no-untyped-call]

        async def until_stopped() -> None:
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

        try:
            _, dials = await t._under_abuse(r, cid, until_stopped(), kinds=kind)
        finally:
            await channel.close()
        return dials

    result.update(asyncio.run(main()))


# ---------------------------------------------------------------- the measuring process


def versions(rt: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        rt.Version(pb.VersionRequest(), timeout=10)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="idle + abused rounds per kind (8)")
    ap.add_argument("--calls", type=int, default=300, help="Version calls per phase (300)")
    ap.add_argument("--kinds", default="all", help=f"comma-separated, of {', '.join(KINDS)} (all)")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        print(f"unknown kinds {sorted(set(kinds) - set(KINDS))}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="crab-", dir="/tmp")
    shim = FakeShim(tmp)
    ctx = multiprocessing.get_context("spawn")
    try:
        cri = Cri("cri-shim", shim.sock, "abuse", os.path.join(tmp, "logs"))
        cri.wait_ready(30)
        rt, im = cri.rt, cri.im
        im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")), timeout=30)
        sc = sandbox_config(log_directory=os.path.join(tmp, "logs"))
        pod = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc), timeout=30).pod_sandbox_id
        req = pb.CreateContainerRequest(
            pod_sandbox_id=pod, config=container_config(log_path="c.log"), sandbox_config=sc
        )
        cid = rt.CreateContainer(req, timeout=30).container_id
        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=30)
        versions(rt, 50)  # warm up
        print(
            f"Version over gRPC, {args.calls} calls a phase, idle then abused from another process; "
            f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}"
        )
        summary = []
        for kind in kinds:
            ratios = []
            cpu_share = []
            for i in range(args.rounds):
                idle = versions(rt, args.calls)
                ready, stop = ctx.Event(), ctx.Event()
                result = ctx.Manager().dict()
                proc = ctx.Process(target=_abuse, args=(shim.sock, cid, kind, ready, stop, result))
                proc.start()
                if not ready.wait(30):
                    raise RuntimeError("the abusing process did not start")
                time.sleep(0.3)  # under way
                cpu0, t0 = proc_cpu(shim.proc.pid), time.monotonic()
                during = versions(rt, args.calls)
                cpu = (proc_cpu(shim.proc.pid) - cpu0) / (time.monotonic() - t0)
                stop.set()
                proc.join(30)
                ratio = pct(during, 0.99) / pct(idle, 0.99)
                ratios.append(ratio)
                cpu_share.append(cpu)
                print(
                    f"  {kind:<8} round {i + 1}: idle p50 {pct(idle, 0.5):5.2f} p99 {pct(idle, 0.99):6.2f} ms | "
                    f"abused p50 {pct(during, 0.5):5.2f} p99 {pct(during, 0.99):6.2f} ms | ratio {ratio:4.2f} | "
                    f"shim CPU {cpu * 100:3.0f}% | {dict(result)}",
                    flush=True,
                )
            summary.append(
                (kind, statistics.median(ratios), min(ratios), max(ratios), statistics.median(cpu_share))
            )
        print("\nkind     | median p99 ratio | min  | max  | shim CPU while abused (median)")
        for kind, med, lo, hi, cpu in summary:
            print(f"{kind:<8} | {med:16.2f} | {lo:4.2f} | {hi:4.2f} | {cpu * 100:.0f}% of a core")
        print("target: within 2x (the median ratio)")
        cri.close()
    finally:
        shim.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
