"""Benchmark of cri-shim on the fake backend, over its real unix socket.

Starts `cri-shim serve` (fake) in a child process and prints, without
asserting anything:
- p50/p99 of Version;
- pod + container create/start throughput;
- p50/p99 of ListPodSandbox and ListContainers at 1,000 pods / 3,000
  containers and at 10,000 / 30,000 (or the sizes given);
- the server's RSS at idle and with all pods created.

Usage: .venv/bin/python bench/fake_bench.py [--pods 1000,10000] [--per-pod 3] [--samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cri_api import api_pb2 as pb  # noqa: E402
from cri_api import api_pb2_grpc  # noqa: E402

CONCURRENCY = 16


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def timed(call: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()  # type: ignore[operator]
        out.append((time.perf_counter() - t0) * 1000)
    return out


def show(name: str, ms: list[float]) -> None:
    print(f"{name:<44} p50 {pct(ms, 0.5):8.2f} ms   p99 {pct(ms, 0.99):8.2f} ms   (n={len(ms)})")


async def create_pods(rt: api_pb2_grpc.RuntimeServiceStub, start: int, stop: int, per_pod: int) -> float:
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with sem:
            sc = pb.PodSandboxConfig(
                metadata=pb.PodSandboxMetadata(name=f"pod-{i}", namespace="bench", uid=f"uid-{i}"),
                labels={"app": f"a{i % 10}"},
            )
            pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
            for j in range(per_pod):
                cc = pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name=f"c{j}"),
                    image=pb.ImageSpec(image="busybox"),
                    labels={"app": f"a{i % 10}"},
                )
                req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
                cid = (await rt.CreateContainer(req)).container_id
                await rt.StartContainer(pb.StartContainerRequest(container_id=cid))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(start, stop)))
    return time.perf_counter() - t0


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", default="1000,10000")
    ap.add_argument("--per-pod", type=int, default=3)
    ap.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    sizes = [int(x) for x in args.pods.split(",")]

    tmp = tempfile.mkdtemp(prefix="csb-", dir="/tmp")
    sock = f"{tmp}/cri.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shim.cli",
            "serve",
            "--listen",
            f"unix://{sock}",
            "--state-dir",
            f"{tmp}/state",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stderr=open(f"{tmp}/server.log", "wb"),
    )
    try:
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(f"unix://{sock}", options=opts) as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)
            im = api_pb2_grpc.ImageServiceStub(ch)
            for _ in range(300):
                try:
                    await rt.Version(pb.VersionRequest(), timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(1)
            print(f"cri-shim fake backend, pid {proc.pid}, python {sys.version.split()[0]}")
            print(f"{'RSS idle':<44} {rss_mib(proc.pid):8.1f} MiB")
            show("Version", await timed(lambda: rt.Version(pb.VersionRequest()), args.samples * 5))
            await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
            done = 0
            for size in sizes:
                secs = await create_pods(rt, done, size, args.per_pod)
                made = size - done
                done = size
                print(
                    f"created {made} pods + {made * args.per_pod} started containers in {secs:.1f} s: "
                    f"{made / secs:.0f} pods/s, {made * (1 + 2 * args.per_pod) / secs:.0f} mutating RPCs/s"
                )
                n = max(20, args.samples // (size // 1000 or 1))
                show(
                    f"ListPodSandbox @ {size} pods",
                    await timed(lambda: rt.ListPodSandbox(pb.ListPodSandboxRequest()), n),
                )
                show(
                    f"ListContainers @ {size * args.per_pod} containers",
                    await timed(lambda: rt.ListContainers(pb.ListContainersRequest()), n),
                )
                raw = ch.unary_unary(
                    "/runtime.v1.RuntimeService/ListContainers",
                    request_serializer=lambda b: b,
                    response_deserializer=lambda b: b,
                )
                show(
                    f"ListContainers @ {size * args.per_pod}, undecoded",
                    await timed(lambda raw=raw: raw(b""), n),
                )  # type: ignore[misc]
                flt = pb.ListContainersRequest(filter=pb.ContainerFilter(label_selector={"app": "a3"}))
                show(
                    f"ListContainers label filter @ {size * args.per_pod}",
                    await timed(lambda flt=flt: rt.ListContainers(flt), n),  # type: ignore[misc]
                )
                print(f"{f'RSS at {size} pods':<44} {rss_mib(proc.pid):8.1f} MiB")
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
