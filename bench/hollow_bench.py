"""Benchmark of hollow nodes: one `cri-shim hollow` process serving many fake nodes.

Starts `cri-shim hollow --nodes N` in a child process, once per transport
(`--transports native,grpcio`: the native HTTP/2 server and grpcio's, one after
the other in the same run), and before them a single `cri-shim serve` for
comparison, and prints for each, without asserting anything:
- the RSS of one idle `cri-shim serve`;
- the time for all N nodes to answer, and the hollow process's idle RSS;
- the time to create and start N x P pods (one container each, a bounded
  number of RPC chains in flight), and the RSS with all of them;
- ListPodSandbox and ListContainers p50/p99 while every node is polled once a
  second by its own poller (N pollers at random phases, as N kubelets' PLEG
  relists would be): over all nodes, and the spread of the per-node p99s.
  The pollers run in this process, by default twice: through grpcio's client
  (`grpcio`) and through a small HTTP/2 client written for this bench
  (`h2`: a frame per call, no threads). A kubelet's Go client costs far less
  per call than grpcio's Python one, whose own pauses show up in its figures
  (the "client's loop lag" line says how much); the `h2` figures are closer to
  what the shim itself adds. The client's garbage collector is off while it
  polls, for the same reason;
- the shim's CPU use during the polling, and the RSS after it.

Targets (from the issue): RSS ≤ 300 MiB in all for 100 x 30; list p99 ≤ 10 ms per node.

Usage: .venv/bin/python bench/hollow_bench.py [--nodes 100] [--pods 30] [--poll-seconds 20]
       [--concurrency 32] [--transports native,grpcio] [--clients h2,grpcio] [--per-node]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hpack import Decoder  # noqa: E402

from cri_api import api_pb2 as pb  # noqa: E402
from cri_api import api_pb2_grpc  # noqa: E402
from shim.transport.native import PREFACE, encode_frame, literal_header, next_frame  # noqa: E402

TARGET_RSS_MIB = 300
TARGET_P99_MS = 10.0


def proc_status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def rss_mib(pid: int) -> float:
    return proc_status(pid, "VmRSS") / 1024


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """(all, steal) ticks of every CPU so far: what the hypervisor took is steal."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def pct(samples: list[float], q: float) -> float:
    """The nearest-rank percentile: with fewer than 100 samples, the p99 is the slowest."""
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else float("nan")


def line(name: str, value: str) -> None:
    print(f"{name:<52} {value}")


def start(args: list[str], log: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "shim.cli", *args, "--log-level", "warning"],
        cwd=ROOT,
        stderr=open(log, "wb"),
    )


def stop(proc: subprocess.Popen[bytes]) -> float:
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.perf_counter() - t0


async def wait_ready(sock: str, proc: subprocess.Popen[bytes], log: str) -> None:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        for _ in range(600):
            if proc.poll() is not None:
                with open(log) as f:
                    raise SystemExit(f"the shim exited ({proc.returncode}):\n{f.read()[-2000:]}")
            try:
                await rt.Version(pb.VersionRequest(), timeout=1)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
    raise SystemExit(f"{sock} never answered")


async def single_serve_rss(tmp: str) -> float:
    sock = f"{tmp}/single.sock"
    log = f"{tmp}/single.log"
    proc = start(["serve", "--listen", f"unix://{sock}", "--state-dir", f"{tmp}/single"], log)
    try:
        await wait_ready(sock, proc, log)
        await asyncio.sleep(1)
        return rss_mib(proc.pid)
    finally:
        stop(proc)


class Node:
    def __init__(self, index: int, sock: str) -> None:
        self.index = index
        self.channel = grpc.aio.insecure_channel(
            f"unix://{sock}", options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)
        self.pod_ms: list[float] = []
        self.container_ms: list[float] = []
        self.pods_seen = 0
        self.containers_seen = 0
        self.sock = sock
        self.h2: H2Client | None = None

    async def connect_h2(self) -> None:
        _, self.h2 = await asyncio.get_running_loop().create_unix_connection(H2Client, self.sock)

    async def list_pods(self, client: str) -> int:
        if client == "h2":
            assert self.h2 is not None
            data = await self.h2.call("ListPodSandbox", b"")
            return len(pb.ListPodSandboxResponse.FromString(data).items)
        return len((await self.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items)

    async def list_containers(self, client: str) -> int:
        if client == "h2":
            assert self.h2 is not None
            data = await self.h2.call("ListContainers", b"")
            return len(pb.ListContainersResponse.FromString(data).containers)
        return len((await self.rt.ListContainers(pb.ListContainersRequest())).containers)


class H2Client(asyncio.Protocol):
    """Unary gRPC calls over one HTTP/2 connection, answered from the read callback.

    Just enough of HTTP/2 for a poller: no header compression of its own
    (literal fields), the server's windows taken as large enough for a
    request, every DATA frame given back at once, PINGs answered.
    """

    PATHS = {
        "ListPodSandbox": b"/runtime.v1.RuntimeService/ListPodSandbox",
        "ListContainers": b"/runtime.v1.RuntimeService/ListContainers",
    }

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.next_sid = 1
        self.calls: dict[int, tuple[asyncio.Future[bytes], list[bytes], list[bytes]]] = {}
        self.decoder = Decoder()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = struct.pack(">HI", 4, 1 << 24)
        transport.write(  # type: ignore[attr-defined]
            PREFACE + encode_frame(4, 0, 0, settings) + encode_frame(8, 0, 0, (1 << 30).to_bytes(4, "big"))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        for fut, _, _ in self.calls.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"connection lost: {exc}"))

    def call(self, method: str, request: bytes) -> asyncio.Future[bytes]:
        sid = self.next_sid
        self.next_sid += 2
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.calls[sid] = (fut, [], [])
        headers = (
            b"\x83\x86"  # :method POST, :scheme http
            + literal_header(b":path", self.PATHS[method])
            + literal_header(b":authority", b"localhost")
            + literal_header(b"content-type", b"application/grpc")
            + literal_header(b"te", b"trailers")
        )
        body = b"\x00" + len(request).to_bytes(4, "big") + request
        assert self.transport is not None
        self.transport.write(encode_frame(1, 4, sid, headers) + encode_frame(0, 1, sid, body))
        return fut

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, out = 0, []
        while (frame := next_frame(buf, pos, 1 << 24)) is not None:
            kind, flags, sid, payload, pos = frame
            length = len(payload)
            call = self.calls.get(sid)
            if kind == 0:  # DATA
                if length:
                    out.append(encode_frame(8, 0, 0, length.to_bytes(4, "big")))
                if call is not None:
                    call[1].append(payload[1 : len(payload) - payload[0]] if flags & 0x8 else payload)
            elif kind == 1:  # HEADERS (padding and priority are not sent by the shim)
                for name, value in self.decoder.decode(payload, raw=True):
                    if name == b"grpc-status" and call is not None:
                        call[2].append(value)
            elif kind == 4 and not flags & 1:  # SETTINGS
                out.append(encode_frame(4, 1, 0))
            elif kind == 6 and not flags & 1:  # PING
                out.append(encode_frame(6, 1, 0, payload))
            elif kind == 3 and call is not None:  # RST_STREAM
                del self.calls[sid]
                call[0].set_exception(ConnectionError(f"stream {sid} reset"))
            if call is not None and flags & 1 and kind in (0, 1):
                del self.calls[sid]
                body = b"".join(call[1])
                if call[2] != [b"0"]:
                    call[0].set_exception(RuntimeError(f"grpc-status {call[2]}"))
                else:
                    call[0].set_result(body[5:])
        del buf[:pos]
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def create_pods(nodes: list[Node], per_node: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(node: Node, i: int) -> None:
        async with sem:
            sc = pb.PodSandboxConfig(
                metadata=pb.PodSandboxMetadata(name=f"pod-{i}", namespace="bench", uid=f"uid-{i}"),
                labels={"app": f"a{i % 10}"},
            )
            pod = (await node.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
            cc = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="c"), image=pb.ImageSpec(image="busybox")
            )
            req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
            cid = (await node.rt.CreateContainer(req)).container_id
            await node.rt.StartContainer(pb.StartContainerRequest(container_id=cid))

    t0 = time.perf_counter()
    # Interleaved across nodes, as pods scheduled onto a cluster arrive.
    await asyncio.gather(*(one(node, i) for i in range(per_node) for node in nodes))
    return time.perf_counter() - t0


async def poll(nodes: list[Node], seconds: float, client: str) -> list[float]:
    """Every node relisted once a second by its own poller, starting at a random phase.

    Returns this client's own event-loop lag meanwhile (ms): what of the
    latencies is the benchmark's rather than the shim's.
    """
    deadline = time.monotonic() + seconds
    lags: list[float] = []

    async def lag() -> None:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append((time.perf_counter() - t0 - 0.01) * 1000)

    async def timed(call: Callable[[], Awaitable[int]], into: list[float]) -> int:
        t0 = time.perf_counter()
        count = await call()
        into.append((time.perf_counter() - t0) * 1000)
        return count

    async def poller(node: Node) -> None:
        node.pod_ms, node.container_ms = [], []
        await asyncio.sleep(random.random())
        tick = time.monotonic()
        while tick < deadline:
            node.pods_seen = await timed(lambda: node.list_pods(client), node.pod_ms)
            node.containers_seen = await timed(lambda: node.list_containers(client), node.container_ms)
            tick += 1.0
            await asyncio.sleep(max(0.0, tick - time.monotonic()))

    # This process's own collector would stall every poller at once: off
    # while polling (what it frees is little for a run of this length).
    gc.collect()
    gc.disable()
    try:
        await asyncio.gather(lag(), *(poller(n) for n in nodes))
    finally:
        gc.enable()
    return lags


def show_lists(name: str, nodes: list[Node], pick: Callable[[Node], list[float]], per_node: bool) -> int:
    every = [ms for n in nodes for ms in pick(n)]
    p99s = [pct(pick(n), 0.99) for n in nodes]
    over = sum(1 for p in p99s if p > TARGET_P99_MS)
    line(
        f"{name}, all nodes",
        f"p50 {pct(every, 0.5):6.2f} ms   p99 {pct(every, 0.99):6.2f} ms   max {max(every):6.2f} ms   (n={len(every)})",
    )
    line(
        f"{name}, per-node p99",
        f"min {min(p99s):6.2f}   median {statistics.median(p99s):6.2f}   max {max(p99s):6.2f} ms   "
        f"({over} of {len(nodes)} nodes over {TARGET_P99_MS:g} ms; {len(pick(nodes[0]))} calls each)",
    )
    if per_node:
        for n in nodes:
            s = pick(n)
            print(
                f"    node {n.index:>4}: p50 {pct(s, 0.5):6.2f} ms   p99 {pct(s, 0.99):6.2f} ms   (n={len(s)})"
            )
    return over


async def one_transport(args: argparse.Namespace, tmp: str, single: float, transport: str) -> dict[str, str]:
    """Start the hollow nodes on ``transport``, load them, poll them; the figures for the summary."""
    print(f"== transport {transport}")
    log = f"{tmp}/hollow-{transport}.log"
    template = f"{tmp}/{transport[0]}-{{i}}.sock"
    state = f"{tmp}/state-{transport}"
    summary: dict[str, str] = {}
    t0 = time.perf_counter()
    proc = start(
        [
            "hollow",
            "--nodes",
            str(args.nodes),
            "--socket-template",
            template,
            "--state-root",
            state,
            "--transport",
            transport,
        ],
        log,
    )
    try:
        sockets = [template.replace("{i}", str(i)) for i in range(args.nodes)]
        for sock in sockets:
            await wait_ready(sock, proc, log)
        line(
            f"all {args.nodes} nodes answering (process start included)", f"{time.perf_counter() - t0:8.2f} s"
        )
        await asyncio.sleep(1)
        idle = rss_mib(proc.pid)
        line(f"RSS idle, {args.nodes} nodes", f"{idle:8.1f} MiB")
        line(
            "per node above one idle serve",
            f"{(idle - single) / max(1, args.nodes - 1) * 1024:8.0f} KiB"
            f"   (threads {proc_status(proc.pid, 'Threads')}, fds {len(os.listdir(f'/proc/{proc.pid}/fd'))})",
        )

        nodes = [Node(i, s) for i, s in enumerate(sockets)]
        try:
            await asyncio.gather(
                *(n.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox"))) for n in nodes)
            )
            secs = await create_pods(nodes, args.pods, args.concurrency)
            total = args.nodes * args.pods
            line(
                f"{total} pods created + started ({args.concurrency} in flight)",
                f"{secs:8.2f} s   ({total / secs:.0f} pods/s, {3 * total / secs:.0f} RPCs/s)",
            )
            summary["create"] = f"{secs:.2f} s"
            await asyncio.sleep(1)
            loaded = rss_mib(proc.pid)
            line(
                f"RSS with {total} pods + {total} containers",
                f"{loaded:8.1f} MiB   (target ≤ {TARGET_RSS_MIB})",
            )
            summary["rss"] = f"{loaded:.1f} MiB"

            for client in args.clients.split(","):
                if client == "h2":
                    await asyncio.gather(*(n.connect_h2() for n in nodes))
                cpu0, w0, ticks0 = cpu_seconds(proc.pid), time.perf_counter(), cpu_ticks()
                lags = await poll(nodes, args.poll_seconds, client)
                cpu = (cpu_seconds(proc.pid) - cpu0) / (time.perf_counter() - w0)
                ticks1 = cpu_ticks()
                steal = (ticks1[1] - ticks0[1]) / max(1, ticks1[0] - ticks0[0])
                print(
                    f"polling through the {client} client: {args.nodes} pollers x 1/s for "
                    f"{args.poll_seconds:g} s, each ListPodSandbox + ListContainers"
                )
                over = (
                    show_lists("ListPodSandbox", nodes, lambda n: n.pod_ms, args.per_node),
                    show_lists("ListContainers", nodes, lambda n: n.container_ms, args.per_node),
                )
                line("shim CPU while polled", f"{cpu * 100:8.1f} % of one core")
                line(
                    "bench client's loop lag while polling",
                    f"p50 {pct(lags, 0.5):6.2f} ms   p99 {pct(lags, 0.99):6.2f} ms   max {max(lags):6.2f} ms"
                    f"   (load average {os.getloadavg()[0]:.2f})",
                )
                # A VM whose host takes its CPUs away stalls shim and pollers alike.
                line("CPU time the host took (steal) while polling", f"{steal * 100:8.1f} %")
                seen = {(n.pods_seen, n.containers_seen) for n in nodes}
                line("pods, containers listed per node", ", ".join(f"{p}, {c}" for p, c in sorted(seen)))
                every = [ms for n in nodes for ms in n.pod_ms + n.container_ms]
                summary[f"{client} p50"] = f"{pct(every, 0.5):.2f} ms"
                summary[f"{client} p99"] = f"{pct(every, 0.99):.2f} ms"
                summary[f"{client} over"] = f"{over[0]} + {over[1]} of {args.nodes}"
                summary[f"{client} cpu"] = f"{cpu * 100:.1f} %"
                summary[f"{client} steal"] = f"{steal * 100:.1f} %"
            line(
                "RSS after polling",
                f"{rss_mib(proc.pid):8.1f} MiB   (peak {proc_status(proc.pid, 'VmHWM') / 1024:.1f})",
            )
        finally:
            for n in nodes:
                await n.channel.close()
                if n.h2 is not None and n.h2.transport is not None:
                    n.h2.transport.close()
            await asyncio.sleep(0.1)  # let the closes happen before the SIGTERM below
    finally:
        took = stop(proc)
        left = [s for s in os.listdir(tmp) if s.endswith(".sock") and s.startswith(transport[0])]
        line("SIGTERM to exit", f"{took:8.2f} s   (exit code {proc.returncode}, {len(left)} sockets left)")
    return summary


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--pods", type=int, default=30, help="pods per node (one started container each)")
    ap.add_argument("--poll-seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=32, help="pod creations in flight, over all nodes")
    ap.add_argument("--transports", default="native,grpcio", help="the hollow nodes' transports, in turn")
    ap.add_argument("--clients", default="h2,grpcio", help="the pollers' clients, in turn: h2, grpcio")
    ap.add_argument("--per-node", action="store_true", help="print every node's list latencies")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="chb-", dir="/tmp")
    print(
        f"cri-shim hollow: {args.nodes} nodes x {args.pods} pods, python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    try:
        single = await single_serve_rss(tmp)
        line("RSS of one idle `cri-shim serve`", f"{single:8.1f} MiB")
        results = {t: await one_transport(args, tmp, single, t) for t in args.transports.split(",")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"== summary (per-node p99 target ≤ {TARGET_P99_MS:g} ms: nodes over it, pod list + container list)"
    )
    keys = list(next(iter(results.values())))
    print(f"{'':<14}" + "".join(f"{t:>22}" for t in results))
    for key in keys:
        print(f"{key:<14}" + "".join(f"{results[t].get(key, ''):>22}" for t in results))


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
