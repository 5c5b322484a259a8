"""The cluster's DNS server: the zone of ``dnszone`` over UDP and TCP, the rest forwarded.

    python -m tests.e2e.cluster.dnsserver --listen 172.30.0.10:53 --kubeconfig admin.kubeconfig

It lists Services, EndpointSlices and Pods from the API server every `--interval` seconds (from
the API server's watch cache: ``resourceVersion=0``) and swaps in a new zone when any list changed.
Names of the zone are answered from it; other names are sent on to the nameservers of the host's
resolv.conf (UDP for UDP askers, TCP then UDP for TCP ones, 2 s each) and their answer relayed; SERVFAIL when
none answers, REFUSED when there is none. An A/AAAA question whose answer is a CNAME out of the zone
(an ExternalName Service) gets the target's records from upstream too, as a recursive server's
would. UDP answers larger than the asker takes (512 bytes, or its EDNS size) are cut and flagged TC.
Until the first list succeeds, names of the zone get SERVFAIL (not a false NXDOMAIN).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import secrets
import signal
import ssl
import struct
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from tests.e2e.cluster import dnswire as w
from tests.e2e.cluster import dnszone

UPSTREAM_TIMEOUT = 2.0
TCP_IDLE = 30.0
LISTS = {
    "services": "/api/v1/services",
    "endpointslices": "/apis/discovery.k8s.io/v1/endpointslices",
    "pods": "/api/v1/pods",
}


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# ------------------------------------------------------------ the API server
class ApiLister:
    """Lists of the API server's objects, over HTTPS with a kubeconfig's client certificate."""

    def __init__(self, kubeconfig: Path) -> None:
        cfg = json.loads(kubeconfig.read_text())  # the harness writes its kubeconfigs as JSON
        cluster = cfg["clusters"][0]["cluster"]
        user = cfg["users"][0]["user"]
        self.server = str(cluster["server"]).rstrip("/")
        self.ctx = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.ctx.load_cert_chain(user["client-certificate"], user["client-key"])

    def list(self, path: str) -> dict[str, Any]:
        url = f"{self.server}{path}?resourceVersion=0"
        with urllib.request.urlopen(url, timeout=10, context=self.ctx) as resp:
            data: dict[str, Any] = json.load(resp)
        return data


# ------------------------------------------------------------ the server
class DnsServer:
    def __init__(
        self,
        domain: str,
        reverse_cidrs: tuple[str, ...],
        upstreams: list[tuple[str, int]],
        verbose: bool = False,
    ) -> None:
        self.domain = domain
        self.reverse_cidrs = reverse_cidrs
        self.upstreams = upstreams
        self.verbose = verbose
        self.zone: dnszone.Zone | None = None  # None until the first successful list
        self._versions: tuple[str, ...] = ()
        self.counts = {"udp": 0, "tcp": 0, "forwarded": 0, "forward_failed": 0, "truncated": 0}

    def load(self, lists: dict[str, dict[str, Any]]) -> bool:
        """A new zone from the API server's lists unless they are what the zone came from."""
        versions = tuple(str(lists[k].get("metadata", {}).get("resourceVersion", "")) for k in LISTS)
        if self.zone is not None and versions == self._versions and all(versions):
            return False
        self.zone = dnszone.build(
            lists["services"].get("items") or [],
            lists["endpointslices"].get("items") or [],
            lists["pods"].get("items") or [],
            self.domain,
            self.reverse_cidrs,
        )
        self._versions = versions
        return True

    # ---------------------------------------------------------------- one query
    async def handle(self, data: bytes, tcp: bool) -> bytes | None:
        """The answer's bytes to a query's, or None to stay silent (not even an ID to answer to)."""
        try:
            query = w.decode(data)
        except w.WireError as exc:
            mid = w.header_id(data)
            if mid is None or (len(data) >= 4 and data[2] & 0x80):
                return None  # no ID, or a response: never answer those
            if self.verbose:
                _log(f"FORMERR: {exc}")
            return w.encode(w.Message(mid, w.QR | w.FORMERR))
        if query.flags & w.QR:
            return None
        limit = 65535 if tcp else query.udp_limit()
        if query.opcode != 0:
            reply = w.reply_to(query, w.NOTIMP)
        elif len(query.questions) != 1:
            reply = w.reply_to(query, w.FORMERR)
        else:
            answered = await self.resolve(query, data, tcp)
            if isinstance(answered, bytes):
                return answered  # an upstream's answer, relayed as it came
            reply = answered
        out = w.encode(reply, limit)
        if len(out) > 12 and out[2] & (w.TC >> 8):
            self.counts["truncated"] += 1
        if self.verbose:
            q = query.questions[0] if query.questions else None
            _log(f"{'tcp' if tcp else 'udp'} {q} -> rcode {reply.rcode}, {len(reply.answers)} answers")
        return out

    async def resolve(self, query: w.Message, raw: bytes, tcp: bool) -> w.Message | bytes:
        q = query.questions[0]
        zone = self.zone
        if q.qclass != w.IN:
            return w.reply_to(query, w.REFUSED)
        if zone is None or not zone.owns(q.name):
            if zone is None and (w.normalize(q.name) + ".").endswith(w.normalize(self.domain) + "."):
                return w.reply_to(query, w.SERVFAIL)  # not synced yet
            return await self.forward(query, raw, tcp)
        reply = zone.answer(query)
        last = reply.answers[-1] if reply.answers else None
        if (
            last is not None
            and last.rtype == w.CNAME
            and q.qtype in (w.A, w.AAAA)
            and not zone.owns(str(last.data))
        ):
            reply.answers += await self._chase(str(last.data), q.qtype)
        return reply

    async def _chase(self, target: str, qtype: int) -> list[w.Record]:
        sub = w.Message(secrets.randbits(16), w.RD)
        sub.questions.append(w.Question(target, qtype))
        got = await self._ask_upstreams(w.encode(sub), tcp=False)
        if got is None:
            return []
        try:
            return w.decode(got).answers
        except w.WireError:
            return []

    async def forward(self, query: w.Message, raw: bytes, tcp: bool) -> w.Message | bytes:
        if not self.upstreams:
            return w.reply_to(query, w.REFUSED)
        got = await self._ask_upstreams(raw, tcp)
        if got is None:
            self.counts["forward_failed"] += 1
            return w.reply_to(query, w.SERVFAIL)
        self.counts["forwarded"] += 1
        return got

    async def _ask_upstreams(self, raw: bytes, tcp: bool) -> bytes | None:
        """The first answer of an upstream; a TCP question goes on over UDP to one that closes TCP
        (this machine's nameserver does)."""
        for host, port in self.upstreams:
            for ask in (_ask_tcp, _ask_udp) if tcp else (_ask_udp,):
                try:
                    return await asyncio.wait_for(ask(host, port, raw), UPSTREAM_TIMEOUT)
                except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                    if self.verbose:
                        _log(f"upstream {host}:{port} ({ask.__name__}): {exc!r}")
        return None

    # ---------------------------------------------------------------- transports
    async def serve(self, host: str, port: int) -> tuple[asyncio.DatagramTransport, asyncio.Server]:
        """UDP and TCP on host:port (port 0: the one the kernel gives the UDP socket, for both;
        another one while that port's TCP side is somebody else's)."""
        loop = asyncio.get_running_loop()
        for attempt in range(1 if port else 20):
            transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), local_addr=(host, port))
            got = transport.get_extra_info("sockname")[1]
            try:
                server = await asyncio.start_server(self._tcp_client, host, got, reuse_address=True)
            except OSError as exc:
                transport.close()
                if port or exc.errno != errno.EADDRINUSE or attempt == 19:
                    raise
                continue
            return transport, server
        raise AssertionError("unreachable")

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE)
                (length,) = struct.unpack("!H", head)
                data = await asyncio.wait_for(reader.readexactly(length), TCP_IDLE)
                self.counts["tcp"] += 1
                out = await self.handle(data, tcp=True)
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # uvloop's is no subclass

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.server.counts["udp"] += 1
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self.tasks.add(task)  # kept until done: the loop holds tasks only weakly
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        out = await self.server.handle(data, tcp=False)
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)


# ------------------------------------------------------------ asking upstream
class _UdpOnce(asyncio.DatagramProtocol):
    def __init__(self, mid: bytes) -> None:
        self.mid = mid
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if data[:2] == self.mid and not self.done.done():
            self.done.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


async def _ask_udp(host: str, port: int, raw: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(
        lambda: _UdpOnce(raw[:2]), remote_addr=(host, port)
    )
    try:
        transport.sendto(raw)
        return await proto.done
    finally:
        transport.close()


async def _ask_tcp(host: str, port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(struct.pack("!H", len(raw)) + raw)
        await writer.drain()
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        return await reader.readexactly(length)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# ------------------------------------------------------------ the process
def upstreams_from(resolv_conf: Path, exclude: str) -> list[tuple[str, int]]:
    """The nameservers of a resolv.conf, less our own address."""
    out = []
    with contextlib.suppress(OSError):
        for line in resolv_conf.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and parts[1] != exclude:
                out.append((parts[1].split("%")[0], 53))
    return out


async def sync_forever(
    server: DnsServer, lister: Callable[[str], dict[str, Any]], interval: float, stop: asyncio.Event
) -> None:
    failing = ""
    while not stop.is_set():
        try:
            lists = {}
            for kind, path in LISTS.items():
                lists[kind] = await asyncio.to_thread(lister, path)
            if server.load(lists):
                z = server.zone
                _log(f"zone: {len(z.records) if z else 0} names; queries so far {server.counts}")
            if failing:
                _log("listing from the API server works again")
            failing = ""
        except (OSError, ValueError, KeyError) as exc:
            if str(exc) != failing:
                _log(f"listing from the API server failed (the zone stays as it was): {exc}")
            failing = str(exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


async def amain(args: argparse.Namespace) -> int:
    host, _, port = args.listen.rpartition(":")
    upstreams = upstreams_from(Path(args.resolv_conf), host)
    server = DnsServer(args.domain, tuple(args.reverse_cidr), upstreams, args.verbose)
    lister = ApiLister(Path(args.kubeconfig))
    transport, tcp = await server.serve(host, int(port))
    _log(f"serving {args.domain} on {args.listen} (UDP, TCP); API {lister.server}; upstreams {upstreams}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await sync_forever(server, lister.list, args.interval, stop)
    transport.close()
    tcp.close()
    await tcp.wait_closed()
    _log(f"stopped; queries {server.counts}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.e2e.cluster.dnsserver", description=__doc__)
    p.add_argument("--listen", required=True, help="ADDRESS:PORT for UDP and TCP")
    p.add_argument("--kubeconfig", required=True, help="a JSON kubeconfig with a client certificate")
    p.add_argument("--domain", default="cluster.local")
    p.add_argument("--reverse-cidr", action="append", default=[], help="reverse names answered here")
    p.add_argument("--resolv-conf", default="/etc/resolv.conf", help="where the upstream nameservers are")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between lists")
    p.add_argument("--verbose", action="store_true", help="log every query")
    return asyncio.run(amain(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
