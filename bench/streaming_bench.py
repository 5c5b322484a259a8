"""Side-by-side benchmark of cri-shim's streaming server (docker backend).

In one run it measures
- exec round trip: the Exec RPC, dialling the URL it returns with SPDY/3.1
  (``v4.channel.k8s.io``, as crictl and the kubelet do), the command's output
  and its exit status on the error stream; against ``docker exec`` through
  the docker SDK (exec_create + exec_start + exec_inspect) of the same
  command in the same container. The two take turns, so machine noise (this
  machine is shared) falls on both alike;
- port-forward throughput: the PortForward RPC, SPDY ``portforward.k8s.io``
  with a data + error stream pair; against a direct TCP connection to the pod
  IP. Two transfers: a download (the pod sends N MiB of zeros) and an echo
  (the client sends N MiB and reads them back: payload / time).

cri-shim runs as a child process with the docker backend on a temporary
socket, state directory and config. The pod runs busybox with
``nc -ll -p 8080 -e cat`` (echo) and ``nc -ll -p 8081 -e dd ...`` (source).
The SPDY client below is the minimal one crictl's library (moby/spdystream)
amounts to: it sends no WINDOW_UPDATE and honours none, so the server's
drain on the socket is the only back-pressure, like against crictl.

Figures only: nothing is asserted. Everything it creates is removed at the
end, also on failure or Ctrl-C. Run as root (the engine's socket), with the
registry of scripts/testenv/up holding the images:
    .venv/bin/python bench/streaming_bench.py [-n 50] [--mib 256] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

import docker
import grpc
from websockets.asyncio.client import connect as ws_connect
from websockets.typing import Subprotocol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.docker import labels as lbl  # noqa: E402
from cri_api import api_pb2 as pb  # noqa: E402
from cri_api import api_pb2_grpc  # noqa: E402
from shim.streaming import spdy  # noqa: E402

# The same child-process shim (docker backend, own socket, state and instance label).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from endpoints import BUSYBOX, DOCKER_SOCK, PAUSE, Shim  # noqa: E402

ECHO_PORT = 8080
SOURCE_PORT = 8081
CHUNK = 32 * 1024  # DATA frame / write size of the client (io.Copy's buffer in the Go client)
READ_SIZE = 256 * 1024


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not samples:
        return math.nan
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


# ---------------------------------------------------------------- SPDY client


class Stream:
    def __init__(self, sid: int, keep: bool) -> None:
        self.id = sid
        self.keep = keep  # keep the bytes, or only count them
        self.data = bytearray()
        self.count = 0
        self.replied = asyncio.Event()
        self.fin = asyncio.Event()
        self.reset: int | None = None
        self.on_data: Callable[[int], None] | None = None


class SpdyConn:
    """The client role of a SPDY/3.1 session, on the server's own codec."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = spdy.FrameEncoder()
        self.decoder = spdy.FrameDecoder()
        self.streams: dict[int, Stream] = {}
        self.next_id = 1
        self.eof = asyncio.Event()
        self._task = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def dial(cls, url: str, protocol: str) -> SpdyConn:
        parts = urllib.parse.urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            f"X-Stream-Protocol-Version: {protocol}\r\n\r\n"
        )
        writer.write(head.encode())
        resp = await reader.readuntil(b"\r\n\r\n")
        status = resp.split(b" ", 2)[1]
        if status != b"101":
            writer.close()
            raise RuntimeError(f"upgrade refused: {resp!r}")
        return cls(reader, writer)

    def open(self, headers: dict[str, str], keep: bool = True) -> Stream:
        stream = Stream(self.next_id, keep)
        self.next_id += 2
        self.streams[stream.id] = stream
        self.writer.write(self.encoder.encode(spdy.SynStreamFrame(stream.id, headers)))
        return stream

    async def send(self, stream: Stream, data: bytes, fin: bool = False) -> None:
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            piece = view[i : i + CHUNK]
            self.writer.write(struct.pack(">II", stream.id, len(piece)) + piece)
        if fin:
            self.writer.write(struct.pack(">II", stream.id, spdy.FLAG_FIN << 24))
        await self.writer.drain()

    def _control(self, head: bytes, body: bytes) -> None:
        frame = self.decoder.decode(head, body)
        match frame:
            case spdy.SynReplyFrame(sid):
                if (s := self.streams.get(sid)) is not None:
                    s.replied.set()
            case spdy.RstStreamFrame(sid, status):
                if (s := self.streams.get(sid)) is not None:
                    s.reset = status
                    s.fin.set()
            case spdy.PingFrame(ping_id) if ping_id % 2 == 0:
                self.writer.write(self.encoder.encode(frame))
            case _:
                pass  # WINDOW_UPDATE (ignored, as moby/spdystream does), GOAWAY, SETTINGS

    async def _read_loop(self) -> None:
        # Frames are cut out of large reads: the client must not be what limits throughput.
        buf = bytearray()
        try:
            while chunk := await self.reader.read(READ_SIZE):
                buf += chunk
                pos = 0
                while len(buf) - pos >= 8:
                    first, second = struct.unpack_from(">II", buf, pos)
                    length = second & 0xFFFFFF
                    end = pos + 8 + length
                    if len(buf) < end:
                        break
                    if first & 0x80000000:
                        self._control(bytes(buf[pos : pos + 8]), bytes(buf[pos + 8 : end]))
                    elif (s := self.streams.get(first)) is not None:
                        s.count += length
                        if s.keep:
                            s.data += buf[pos + 8 : end]
                        if s.on_data is not None:
                            s.on_data(s.count)
                        if second >> 24 & spdy.FLAG_FIN:
                            s.fin.set()
                    pos = end
                del buf[:pos]
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.eof.set()
            for s in self.streams.values():
                s.fin.set()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


# ---------------------------------------------------------------- cri-shim child process


class Pod:
    """The benchmark pod: one busybox container serving echo and a byte source."""

    def __init__(self, rt: Any, im: Any, run_id: str, log_dir: str, mib: int) -> None:
        self.rt = rt
        spec = pb.ImageSpec(image=BUSYBOX)
        if not im.ImageStatus(pb.ImageStatusRequest(image=spec), timeout=60).HasField("image"):
            im.PullImage(pb.PullImageRequest(image=spec), timeout=300)
        self.sc = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="sbench", namespace=f"sbench-{run_id}", uid=run_id),
            hostname="sbench",
            log_directory=log_dir,
        )
        self.id = str(rt.RunPodSandbox(pb.RunPodSandboxRequest(config=self.sc), timeout=120).pod_sandbox_id)
        # nc -ll: a persistent server forking PROG per connection (no -k in busybox nc).
        count = mib * 16  # 64 KiB blocks
        script = (
            f"nc -ll -p {ECHO_PORT} -e cat & "
            f"nc -ll -p {SOURCE_PORT} -e dd if=/dev/zero bs=65536 count={count} & wait"
        )
        cc = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="nc"),
            image=spec,
            command=["sh", "-c", script],
            log_path="nc.log",
        )
        req = pb.CreateContainerRequest(pod_sandbox_id=self.id, config=cc, sandbox_config=self.sc)
        self.cid = str(rt.CreateContainer(req, timeout=120).container_id)
        rt.StartContainer(pb.StartContainerRequest(container_id=self.cid), timeout=120)
        status = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=self.id), timeout=30)
        self.ip = status.status.network.ip

    def remove(self) -> None:
        for call, req in (
            (self.rt.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id=self.id)),
            (self.rt.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=self.id)),
        ):
            try:
                call(req, timeout=120)
            except grpc.RpcError as exc:
                print(f"cleanup: {exc.code().name} {exc.details()}", file=sys.stderr)


# ---------------------------------------------------------------- exec


Samples = dict[str, list[float]]


def add(samples: Samples, key: str, t0: float, t1: float) -> None:
    samples.setdefault(key, []).append((t1 - t0) * 1000)


async def shim_exec(rt: Any, cid: str, cmd: list[str], samples: Samples) -> bytes:
    t0 = time.perf_counter()
    req = pb.ExecRequest(container_id=cid, cmd=cmd, stdout=True, stderr=True)
    url = rt.Exec(req, timeout=30).url
    t1 = time.perf_counter()
    conn = await SpdyConn.dial(url, "v4.channel.k8s.io")
    t2 = time.perf_counter()
    # client-go's order: error first, then the output streams.
    error = conn.open({"streamtype": "error"})
    stdout = conn.open({"streamtype": "stdout"})
    stderr = conn.open({"streamtype": "stderr"})
    async with asyncio.timeout(30):
        for s in (error, stdout, stderr):
            await s.fin.wait()
    t3 = time.perf_counter()
    status = json.loads(error.data or b"{}")
    await conn.close()
    if status.get("status") != "Success":
        raise RuntimeError(f"exec through cri-shim failed: {status}")
    add(samples, "total", t0, t3)
    add(samples, "Exec RPC", t0, t1)
    add(samples, "dial+upgrade", t1, t2)
    add(samples, "streams->status", t2, t3)
    return bytes(stdout.data)


async def shim_exec_ws(rt: Any, cid: str, cmd: list[str], samples: Samples) -> bytes:
    """The same through WebSocket ``v5.channel.k8s.io`` (crictl --transport websocket)."""
    t0 = time.perf_counter()
    req = pb.ExecRequest(container_id=cid, cmd=cmd, stdout=True, stderr=True)
    url = rt.Exec(req, timeout=30).url
    out = bytearray()
    status: dict[str, Any] = {}
    async with asyncio.timeout(30):
        async with ws_connect(
            "ws" + url.removeprefix("http"), subprotocols=[Subprotocol("v5.channel.k8s.io")], compression=None
        ) as ws:
            async for message in ws:
                assert isinstance(message, bytes)
                if message[:1] == b"\x01":
                    out += message[1:]
                elif message[:1] == b"\x03":
                    status = json.loads(message[1:] or b"{}")
    t1 = time.perf_counter()
    if status.get("status") != "Success":
        raise RuntimeError(f"exec through cri-shim (WebSocket) failed: {status}")
    add(samples, "total", t0, t1)
    return bytes(out)


def docker_exec(api: docker.APIClient, eid: str, cmd: list[str], samples: Samples) -> bytes:
    t0 = time.perf_counter()
    exec_id = api.exec_create(eid, cmd, stdout=True, stderr=True)["Id"]
    t1 = time.perf_counter()
    out = api.exec_start(exec_id)
    t2 = time.perf_counter()
    code = api.exec_inspect(exec_id)["ExitCode"]
    t3 = time.perf_counter()
    if code != 0:
        raise RuntimeError(f"docker exec exited {code}")
    add(samples, "total", t0, t3)
    add(samples, "exec_create", t0, t1)
    add(samples, "exec_start", t1, t2)
    add(samples, "exec_inspect", t2, t3)
    return bytes(out)


# ---------------------------------------------------------------- port-forward


async def shim_forward(rt: Any, pod_id: str, port: int, mode: str, size: int) -> tuple[float, int, float]:
    """(seconds of the transfer, bytes received, setup ms) through cri-shim."""
    t0 = time.perf_counter()
    url = rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod_id, port=[port]), timeout=30).url
    conn = await SpdyConn.dial(url, "portforward.k8s.io")
    error = conn.open({"streamtype": "error", "port": str(port), "requestid": "0"})
    data = conn.open({"streamtype": "data", "port": str(port), "requestid": "0"}, keep=False)
    async with asyncio.timeout(30):
        await data.replied.wait()
    setup = (time.perf_counter() - t0) * 1000
    try:
        async with asyncio.timeout(300):
            start = time.perf_counter()
            if mode == "download":
                await data.fin.wait()
            else:
                done = asyncio.Event()
                data.on_data = lambda n: done.set() if n >= size else None
                block = b"x" * READ_SIZE
                for _ in range(size // len(block)):
                    await conn.send(data, block)
                # All echoed, or the stream ended early (an error, a reset): never wait for the timeout.
                waits = {asyncio.ensure_future(done.wait()), asyncio.ensure_future(data.fin.wait())}
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
            took = time.perf_counter() - start
            if mode != "download":
                await conn.send(data, b"", fin=True)
        if error.data:
            raise RuntimeError(f"port-forward error: {error.data.decode()}")
    finally:
        await conn.close()
    return took, data.count, setup


async def direct_forward(ip: str, port: int, mode: str, size: int) -> tuple[float, int, float]:
    """The same transfer on a TCP connection to the pod IP."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(ip, port)
    setup = (time.perf_counter() - t0) * 1000
    got = 0
    try:
        async with asyncio.timeout(300):
            start = time.perf_counter()
            if mode == "download":
                while chunk := await reader.read(READ_SIZE):
                    got += len(chunk)
            else:

                async def pump() -> None:
                    block = b"x" * READ_SIZE
                    for _ in range(size // len(block)):
                        writer.write(block)
                        await writer.drain()

                sender = asyncio.ensure_future(pump())
                while got < size and (chunk := await reader.read(READ_SIZE)):
                    got += len(chunk)
                await sender
            took = time.perf_counter() - start
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return took, got, setup


# ---------------------------------------------------------------- main


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def span(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}"


def exec_table(n: int, shim: Samples, ws: Samples, raw: Samples) -> None:
    print(f"\nExec round trip of ['echo', 'hi'], ms (n={n}, the three paths alternating)")
    head = f"{'path':<46} | {'p50':>8} {'p90':>8}"
    print(head)
    print("-" * len(head))
    rows = [("cri-shim SPDY (RPC + v4.channel + exit status)", shim["total"])]
    rows += [(f"  {k}", v) for k, v in shim.items() if k != "total"]
    rows += [("cri-shim WebSocket (RPC + v5.channel)", ws["total"])]
    rows += [("docker SDK (exec create+start+inspect)", raw["total"])]
    rows += [(f"  {k}", v) for k, v in raw.items() if k != "total"]
    for name, v in rows:
        print(f"{name:<46} | {pct(v, 0.5):8.2f} {pct(v, 0.9):8.2f}")
    for name, got in (("SPDY", shim), ("WebSocket", ws)):
        d50 = pct(got["total"], 0.5) - pct(raw["total"], 0.5)
        d90 = pct(got["total"], 0.9) - pct(raw["total"], 0.9)
        print(
            f"{'overhead cri-shim ' + name + ' - docker SDK':<46} | {d50:8.2f} {d90:8.2f}   (target: <= 20 ms)"
        )


async def run(args: argparse.Namespace, tmp: str, run_id: str, cleanups: list[Callable[[], None]]) -> None:
    api = docker.APIClient(base_url=DOCKER_SOCK, version="auto", timeout=120)
    cleanups.append(api.close)
    for image in (PAUSE, BUSYBOX):
        try:
            api.inspect_image(image)
        except docker.errors.ImageNotFound:
            repo, tag = image.rsplit(":", 1)
            api.pull(repo, tag=tag)

    shim = Shim(tmp, run_id)
    cleanups.append(shim.remove_engine_leftovers)
    cleanups.append(shim.stop)
    channel = grpc.insecure_channel(f"unix://{shim.sock}")
    cleanups.append(channel.close)
    # The generated stubs carry no annotations.
    rt = api_pb2_grpc.RuntimeServiceStub(channel)  # type: ignore[no-untyped-call]
    im = api_pb2_grpc.ImageServiceStub(channel)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + 60
    while True:
        try:
            rt.Version(pb.VersionRequest(), timeout=2)
            break
        except grpc.RpcError:
            if time.monotonic() > deadline or shim.proc.poll() is not None:
                args.keep_tmp = True
                raise RuntimeError(f"cri-shim did not answer; its log: {shim.tmp}/cri-shim.log") from None
            await asyncio.sleep(0.1)

    os.makedirs(f"{tmp}/pod-logs")
    pod = Pod(rt, im, run_id, f"{tmp}/pod-logs", args.mib)
    cleanups.append(pod.remove)
    rows = api.containers(filters={"label": [f"{lbl.ID}={pod.cid}", f"{lbl.INSTANCE}={shim.instance}"]})
    eid = str(rows[0]["Id"])
    eng = api.version()
    print(
        f"run {run_id}: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
        f"engine {eng.get('Version')}, pod IP {pod.ip}, cri-shim pid {shim.proc.pid}"
    )
    if args.only != "portforward":
        await bench_exec(args, rt, api, pod, eid)
    if args.only != "exec":
        await bench_portforward(args, rt, pod, shim.proc.pid)


async def bench_exec(args: argparse.Namespace, rt: Any, api: docker.APIClient, pod: Pod, eid: str) -> None:

    cmd = ["echo", "hi"]
    warm: Samples = {}
    for _ in range(3):  # first-use costs on every path
        await shim_exec(rt, pod.cid, cmd, warm)
        await shim_exec_ws(rt, pod.cid, cmd, warm)
        docker_exec(api, eid, cmd, warm)
    res_shim: Samples = {}
    res_ws: Samples = {}
    res_raw: Samples = {}
    for _ in range(args.iterations):
        outs = (
            await shim_exec(rt, pod.cid, cmd, res_shim),
            await shim_exec_ws(rt, pod.cid, cmd, res_ws),
            docker_exec(api, eid, cmd, res_raw),
        )
        if any(out != b"hi\n" for out in outs):
            print(f"unexpected exec output (SPDY, WebSocket, docker): {outs!r}", file=sys.stderr)
    exec_table(args.iterations, res_shim, res_ws, res_raw)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench_portforward(args: argparse.Namespace, rt: Any, pod: Pod, shim_pid: int) -> None:
    size = args.mib << 20
    print(
        f"\nPort-forward throughput, MB/s (10^6 B/s), {args.mib} MiB per transfer, "
        f"{args.reps} reps alternating, median"
    )
    head = (
        f"{'transfer':<10} | {'cri-shim SPDY':>13} {'min-max':>11} {'setup ms':>9} "
        f"| {'direct TCP':>10} {'min-max':>11} {'setup ms':>9} | {'ratio':>6} "
        f"| {'shim CPU':>8} {'bench CPU':>9}"
    )
    print(head)
    print("-" * len(head))
    for mode, port in (("download", SOURCE_PORT), ("echo", ECHO_PORT)):
        if args.transfer and mode != args.transfer:
            continue
        # A warm-up of each, then alternating reps.
        await shim_forward(rt, pod.id, port, mode, size)
        await direct_forward(pod.ip, port, mode, size)
        via: list[float] = []
        direct: list[float] = []
        setups: tuple[list[float], list[float]] = ([], [])
        # Share of one core the shim and this client used while transferring
        # through cri-shim: tells whether either is the bottleneck.
        shim_cpu: list[float] = []
        bench_cpu: list[float] = []
        for _ in range(args.reps):
            c0, b0 = cpu_seconds(shim_pid), time.process_time()
            took, got, setup = await shim_forward(rt, pod.id, port, mode, size)
            shim_cpu.append((cpu_seconds(shim_pid) - c0) / took)
            bench_cpu.append((time.process_time() - b0) / took)
            via.append(got / took / 1e6)
            setups[0].append(setup)
            took_d, got_d, setup_d = await direct_forward(pod.ip, port, mode, size)
            direct.append(got_d / took_d / 1e6)
            setups[1].append(setup_d)
            for path, n in (("cri-shim", got), ("direct", got_d)):
                if n != size:
                    print(f"{mode} {path}: received {n} of {size} bytes", file=sys.stderr)
        v, d = statistics.median(via), statistics.median(direct)
        print(
            f"{mode:<10} | {v:13.1f} {span(via):>11} {statistics.median(setups[0]):9.2f} "
            f"| {d:10.1f} {span(direct):>11} {statistics.median(setups[1]):9.2f} | {v / d:6.0%} "
            f"| {statistics.median(shim_cpu):8.0%} {statistics.median(bench_cpu):9.0%}"
        )
    print(
        "target: cri-shim >= 50% of direct. echo = payload sent and read back / time. "
        "CPU = share of one core while transferring through cri-shim (setup included)."
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--iterations", type=int, default=50, help="exec round trips per path (50)")
    ap.add_argument("--mib", type=int, default=256, help="MiB per port-forward transfer (256)")
    ap.add_argument("--reps", type=int, default=5, help="transfers per path and mode (5)")
    ap.add_argument(
        "--only", choices=("exec", "portforward"), help="run one part only (e.g. while profiling)"
    )
    ap.add_argument("--transfer", choices=("download", "echo"), help="one port-forward transfer only")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (shim log) for inspection")
    args = ap.parse_args()
    if args.mib * (1 << 20) % READ_SIZE:
        ap.error("--mib must be a whole number of MiB")

    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-sbench-", dir="/tmp")
    cleanups: list[Callable[[], None]] = []
    failed = False
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C does
    try:
        asyncio.run(run(args, tmp, run_id, cleanups))
    except KeyboardInterrupt:
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    except Exception:
        failed = True
        args.keep_tmp = True
        raise
    finally:
        # Pod removal through CRI, then the shim's stop, then whatever it left on the engine.
        for cleanup in reversed(cleanups):
            try:
                cleanup()
            except Exception as exc:
                print(f"cleanup: {exc!r}", file=sys.stderr)
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
