"""The cluster harness's DNS server (tests/e2e/cluster/dns*.py), without Kubernetes: the wire format,
each kind of record from API objects as the API server lists them, NXDOMAIN and NODATA, UDP and TCP,
truncation, forwarding and its failures, the sync from a lister."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import ipaddress
import json
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from tests.e2e.cluster import configs, dnsserver, dnszone, layout, pki
from tests.e2e.cluster import dnswire as w
from tests.e2e.kubelet.config import REPO

NS = "dns-ns"
DOMAIN = "cluster.local"
CIDRS = ("10.96.0.0/16", "10.244.0.0/16")


# ------------------------------------------------------------ API objects
def service(name: str, cluster_ip: str = "10.96.0.20", **spec: Any) -> dict[str, Any]:
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("ports", [{"name": "http", "port": 80, "protocol": "TCP"}])
    return {
        "metadata": {"name": name, "namespace": NS},
        "spec": {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip], **spec},
    }


def endpoint_slice(svc: str, *endpoints: dict[str, Any], port: int = 8080) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{svc}-abcde", "namespace": NS, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": list(endpoints),
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


def ep(address: str, ready: bool | None = True, hostname: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [address], "conditions": {} if ready is None else {"ready": ready}}
    if hostname:
        out["hostname"] = hostname
    return out


def pod(ip: str, phase: str = "Running", ns: str = NS) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": ns}, "spec": {}, "status": {"phase": phase, "podIP": ip}}


def zone() -> dnszone.Zone:
    return dnszone.build(
        [
            service("web"),
            service("headless", "None"),
            service("everyone", "None", publishNotReadyAddresses=True),
            service("ext", "", type="ExternalName", externalName="foo.example.com"),
            service("alias", "", type="ExternalName", externalName=f"web.{NS}.svc.{DOMAIN}"),
            service("empty", "None"),
        ],
        [
            endpoint_slice(
                "headless", ep("10.244.1.5"), ep("10.244.2.6", hostname="pod-b"), ep("10.244.1.7", False)
            ),
            endpoint_slice("everyone", ep("10.244.1.8", False), ep("10.244.1.9", None)),
        ],
        [pod("10.244.1.5"), pod("10.244.1.66", "Succeeded")],
        DOMAIN,
        CIDRS,
    )


def query(name: str, qtype: int, edns: int = 0) -> w.Message:
    m = w.Message(0x1234, w.RD, [w.Question(name, qtype)])
    if edns:
        m.additional.append(w.opt_record(edns))
    return m


def answer(name: str, qtype: int) -> w.Message:
    return zone().answer(query(name, qtype))


def data(m: w.Message, rtype: int | None = None) -> list[object]:
    return sorted((r.data for r in m.answers if rtype is None or r.rtype == rtype), key=str)


# ------------------------------------------------------------ wire format
RECORDS = [
    w.Record("a.example", w.A, 5, "192.0.2.1"),
    w.Record("a.example", w.AAAA, 5, "2001:db8::1"),
    w.Record("c.example", w.CNAME, 60, "a.example"),
    w.Record("1.2.0.192.in-addr.arpa", w.PTR, 5, "a.example"),
    w.Record("_http._tcp.a.example", w.SRV, 5, (0, 100, 80, "a.example")),
    w.Record("example", w.SOA, 5, ("ns.example", "hostmaster.example", 1, 7200, 1800, 86400, 5)),
    w.Record("example", w.NS, 5, "ns.example"),
    w.Record("t.example", w.TXT, 5, ("hello", "world")),
]


@pytest.mark.parametrize("record", RECORDS, ids=[w.TYPE_NAMES[r.rtype] for r in RECORDS])
def test_wire_round_trip(record: w.Record) -> None:
    m = w.Message(7, w.QR | w.AA, [w.Question("a.example", record.rtype)], [record])
    back = w.decode(w.encode(m))
    assert back == m


def test_wire_names_are_compressed() -> None:
    m = w.Message(1, 0, [w.Question("web.ns.svc.cluster.local", w.A)])
    m.answers = [w.Record("web.ns.svc.cluster.local", w.A, 5, f"10.0.0.{i}") for i in range(10)]
    raw = w.encode(m)
    assert raw.count(b"\x03web") == 1  # each later owner is a 2-byte pointer
    assert len(raw) == 12 + 30 + 10 * (2 + 10 + 4)


def test_wire_srv_target_is_not_compressed() -> None:
    m = w.Message(1, 0, [w.Question("a.example", w.SRV)], [RECORDS[4]])
    assert w.encode(m).count(b"\x01a\x07example\x00") == 2  # in the question and whole as the target


@pytest.mark.parametrize(
    "raw",
    [
        b"\x00\x01",
        struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01",  # a pointer to itself
        struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\x05ab",  # a label cut short
        struct.pack("!HHHHHH", 1, 0, 0, 1, 0, 0) + b"\x00\x00\x01\x00\x01\x00\x00\x00\x05\x00\x09abcd",
    ],
    ids=["short header", "pointer loop", "cut label", "rdata past the end"],
)
def test_wire_rejects_broken_messages(raw: bytes) -> None:
    with pytest.raises(w.WireError):
        w.decode(raw)


def test_wire_truncation_keeps_header_question_and_opt() -> None:
    m = query("big.example", w.A, edns=4096)
    m.flags |= w.QR
    m.answers = [w.Record("big.example", w.A, 5, f"10.0.{i // 250}.{i % 250}") for i in range(100)]
    raw = w.encode(m, 512)
    assert len(raw) <= 512
    back = w.decode(raw)
    assert back.flags & w.TC and back.answers == [] and back.questions == m.questions
    assert back.opt() is not None
    assert not w.decode(w.encode(m)).flags & w.TC


def test_wire_reverse_names() -> None:
    assert w.reverse_name("10.96.0.10") == "10.0.96.10.in-addr.arpa"
    assert w.address_of_reverse("10.0.96.10.in-addr.arpa.") == "10.96.0.10"
    assert w.address_of_reverse("0.96.10.in-addr.arpa") is None
    assert w.address_of_reverse(w.reverse_name("2001:db8::1")) == "2001:db8::1"


def test_wire_edns_limit() -> None:
    assert query("x", w.A).udp_limit() == 512
    assert query("x", w.A, edns=1232).udp_limit() == 1232
    assert query("x", w.A, edns=100).udp_limit() == 512
    assert query("x", w.A, edns=65000).udp_limit() == w.UDP_MAX


# ------------------------------------------------------------ the zone
def test_cluster_ip_service_a_record() -> None:
    m = answer(f"web.{NS}.svc.{DOMAIN}", w.A)
    assert m.rcode == w.NOERROR and m.flags & w.AA
    assert data(m) == ["10.96.0.20"]
    assert m.answers[0].ttl == dnszone.TTL


def test_question_spelling_is_kept_and_matching_ignores_case() -> None:
    m = answer(f"WEB.{NS}.svc.Cluster.Local.", w.A)
    assert data(m) == ["10.96.0.20"]
    assert m.answers[0].name == f"WEB.{NS}.svc.Cluster.Local"


def test_cluster_ip_service_srv_and_ptr() -> None:
    srv = answer(f"_http._tcp.web.{NS}.svc.{DOMAIN}", w.SRV)
    assert data(srv) == [(0, 100, 80, f"web.{NS}.svc.{DOMAIN}")]
    assert [r.data for r in srv.additional if r.rtype == w.A] == ["10.96.0.20"]
    ptr = answer("20.0.96.10.in-addr.arpa", w.PTR)
    assert data(ptr) == [f"web.{NS}.svc.{DOMAIN}"]
    assert answer(f"_http._udp.web.{NS}.svc.{DOMAIN}", w.SRV).rcode == w.NXDOMAIN


def test_headless_service_a_records_are_its_ready_endpoints() -> None:
    assert data(answer(f"headless.{NS}.svc.{DOMAIN}", w.A)) == ["10.244.1.5", "10.244.2.6"]
    # publishNotReadyAddresses: every endpoint; a missing ready condition counts as ready.
    assert data(answer(f"everyone.{NS}.svc.{DOMAIN}", w.A)) == ["10.244.1.8", "10.244.1.9"]


def test_several_addresses_come_in_varying_order() -> None:
    z = zone()
    firsts = {z.answer(query(f"headless.{NS}.svc.{DOMAIN}", w.A)).answers[0].data for _ in range(60)}
    assert firsts == {"10.244.1.5", "10.244.2.6"}  # both first at times (chance of failing: 2**-59)


def test_headless_endpoint_with_hostname() -> None:
    name = f"pod-b.headless.{NS}.svc.{DOMAIN}"
    assert data(answer(name, w.A)) == ["10.244.2.6"]
    assert data(answer("6.2.244.10.in-addr.arpa", w.PTR)) == [name]
    # without a hostname: the dashed address
    assert data(answer(f"10-244-1-5.headless.{NS}.svc.{DOMAIN}", w.A)) == ["10.244.1.5"]
    assert answer(f"pod-c.headless.{NS}.svc.{DOMAIN}", w.A).rcode == w.NXDOMAIN


def test_headless_srv_per_endpoint_with_addresses() -> None:
    m = answer(f"_http._tcp.headless.{NS}.svc.{DOMAIN}", w.SRV)
    assert data(m) == [
        (0, 50, 8080, f"10-244-1-5.headless.{NS}.svc.{DOMAIN}"),
        (0, 50, 8080, f"pod-b.headless.{NS}.svc.{DOMAIN}"),
    ]
    assert sorted(str(r.data) for r in m.additional if r.rtype == w.A) == ["10.244.1.5", "10.244.2.6"]


def test_headless_service_without_endpoints_is_nodata() -> None:
    m = answer(f"empty.{NS}.svc.{DOMAIN}", w.A)
    assert m.rcode == w.NOERROR and m.answers == []
    assert [r.rtype for r in m.authority] == [w.SOA]


def test_external_name_is_a_cname() -> None:
    m = answer(f"ext.{NS}.svc.{DOMAIN}", w.CNAME)
    assert data(m) == ["foo.example.com"]
    a = answer(f"ext.{NS}.svc.{DOMAIN}", w.A)  # the CNAME alone: the server chases names outside
    assert [(r.rtype, r.data) for r in a.answers] == [(w.CNAME, "foo.example.com")]


def test_external_name_inside_the_zone_is_followed() -> None:
    m = answer(f"alias.{NS}.svc.{DOMAIN}", w.A)
    assert [(r.rtype, r.data) for r in m.answers] == [
        (w.CNAME, f"web.{NS}.svc.{DOMAIN}"),
        (w.A, "10.96.0.20"),
    ]


def test_pod_records() -> None:
    assert data(answer(f"10-244-1-5.{NS}.pod.{DOMAIN}", w.A)) == ["10.244.1.5"]
    assert answer(f"10-244-1-5.other.pod.{DOMAIN}", w.A).rcode == w.NXDOMAIN  # not a pod of that namespace
    assert answer(f"10-244-1-66.{NS}.pod.{DOMAIN}", w.A).rcode == w.NXDOMAIN  # a finished pod


@pytest.mark.parametrize(
    "name,qtype,rcode",
    [
        (f"nothing.{NS}.svc.{DOMAIN}", w.A, w.NXDOMAIN),
        (f"web.{NS}.svc.{DOMAIN}.{NS}.svc.{DOMAIN}", w.A, w.NXDOMAIN),  # a search path's try
        (f"web.{NS}.svc.{DOMAIN}", w.AAAA, w.NOERROR),  # the name exists: no data
        (f"{NS}.svc.{DOMAIN}", w.A, w.NOERROR),  # a parent of names that exist
        ("99.99.96.10.in-addr.arpa", w.PTR, w.NXDOMAIN),  # in the service range, nobody's
    ],
    ids=["unknown", "search suffix", "nodata", "empty non-terminal", "reverse unknown"],
)
def test_negative_answers_carry_the_soa(name: str, qtype: int, rcode: int) -> None:
    m = answer(name, qtype)
    assert m.rcode == rcode and m.answers == [] and m.flags & w.AA
    assert [(r.name, r.rtype) for r in m.authority] == [(DOMAIN, w.SOA)]
    assert m.authority[0].data[-1] == dnszone.TTL  # type: ignore[index]


def test_zone_apex_soa_and_ownership() -> None:
    z = zone()
    assert data(z.answer(query(DOMAIN, w.SOA)))[0][0] == f"ns.dns.{DOMAIN}"  # type: ignore[index]
    assert z.owns(f"x.{DOMAIN}") and z.owns("1.1.244.10.in-addr.arpa")
    assert not z.owns("example.com") and not z.owns("8.8.8.8.in-addr.arpa") and not z.owns("local")


# ------------------------------------------------------------ the server, over UDP and TCP
class Upstream(asyncio.DatagramProtocol):
    """A nameserver outside the cluster that answers every A question with 192.0.2.53."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.asked: list[str] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, int]) -> None:
        q = w.decode(data)
        self.asked.append(q.questions[0].name)
        reply = w.reply_to(q)
        reply.answers.append(w.Record(q.questions[0].name, w.A, 30, "192.0.2.53"))
        assert self.transport is not None
        self.transport.sendto(w.encode(reply), addr)


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, int]]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(Upstream, local_addr=("127.0.0.1", 0))
    yield proto, transport.get_extra_info("sockname")[1]
    transport.close()


async def serving(server: dnsserver.DnsServer) -> tuple[int, Any]:
    udp, tcp = await server.serve("127.0.0.1", 0)
    return udp.get_extra_info("sockname")[1], (udp, tcp)


async def stop(handles: Any) -> None:
    udp, tcp = handles
    udp.close()
    tcp.close()
    await tcp.wait_closed()


def lists(services: list[Any], slices: list[Any], pods: list[Any], rv: str = "1") -> dict[str, Any]:
    return {
        "services": {"metadata": {"resourceVersion": rv}, "items": services},
        "endpointslices": {"metadata": {"resourceVersion": rv}, "items": slices},
        "pods": {"metadata": {"resourceVersion": rv}, "items": pods},
    }


async def ask(port: int, name: str, qtype: int, tcp: bool = False, edns: int = 0) -> w.Message:
    return await asyncio.to_thread(w.ask, "127.0.0.1", port, name, qtype, tcp, 5.0, edns)


async def test_server_answers_over_udp_and_tcp(upstream: tuple[Upstream, int]) -> None:
    server = dnsserver.DnsServer(DOMAIN, CIDRS, [("127.0.0.1", upstream[1])])
    server.load(lists([service("web")], [], []))
    port, handles = await serving(server)
    try:
        for tcp in (False, True):
            m = await ask(port, f"web.{NS}.svc.{DOMAIN}", w.A, tcp=tcp)
            assert m.id == 0x4B1D and m.flags & w.QR and m.flags & w.AA
            assert data(m) == ["10.96.0.20"]
            assert (await ask(port, f"nope.{NS}.svc.{DOMAIN}", w.A, tcp=tcp)).rcode == w.NXDOMAIN
        assert server.counts["udp"] == 2 and server.counts["tcp"] == 2
        assert upstream[0].asked == []  # the zone's names never leave the server
    finally:
        await stop(handles)


async def test_server_truncates_big_udp_answers() -> None:
    endpoints = [ep(f"10.244.{i // 200}.{i % 200 + 1}") for i in range(60)]
    server = dnsserver.DnsServer(DOMAIN, CIDRS, [])
    server.load(lists([service("many", "None")], [endpoint_slice("many", *endpoints)], []))
    port, handles = await serving(server)
    name = f"many.{NS}.svc.{DOMAIN}"
    try:
        udp = await ask(port, name, w.A)
        assert udp.flags & w.TC and udp.answers == []
        assert len(data(await ask(port, name, w.A, edns=4096))) == 60  # fits the asker's EDNS size
        tcp = await ask(port, name, w.A, tcp=True)
        assert not tcp.flags & w.TC and len(data(tcp)) == 60
        assert server.counts["truncated"] == 1
    finally:
        await stop(handles)


async def test_server_forwards_other_names_and_chases_external_names(upstream: tuple[Upstream, int]) -> None:
    server = dnsserver.DnsServer(DOMAIN, CIDRS, [("127.0.0.1", upstream[1])])
    server.load(lists([service("ext", "", type="ExternalName", externalName="foo.example.com")], [], []))
    port, handles = await serving(server)
    try:
        m = await ask(port, "www.example.org", w.A)
        assert data(m) == ["192.0.2.53"] and m.id == 0x4B1D
        chased = await ask(port, f"ext.{NS}.svc.{DOMAIN}", w.A)
        assert [(r.rtype, r.data) for r in chased.answers] == [
            (w.CNAME, "foo.example.com"),
            (w.A, "192.0.2.53"),
        ]
        # over TCP: the upstream takes no TCP (as this machine's does not): asked over UDP instead
        by_tcp = await ask(port, "tcp.example.org", w.A, tcp=True)
        assert data(by_tcp) == ["192.0.2.53"] and by_tcp.rcode == w.NOERROR
        assert upstream[0].asked == ["www.example.org", "foo.example.com", "tcp.example.org"]
        assert server.counts["forwarded"] == 2 and server.counts["forward_failed"] == 0
    finally:
        await stop(handles)


async def test_server_without_upstream_answers_refused_or_servfail() -> None:
    none = dnsserver.DnsServer(DOMAIN, CIDRS, [])
    none.load(lists([], [], []))
    # a port nobody listens on: the kernel refuses the datagram at once
    silent = dnsserver.DnsServer(DOMAIN, CIDRS, [("127.0.0.1", 9)])
    silent.load(lists([], [], []))
    for server, rcode in ((none, w.REFUSED), (silent, w.SERVFAIL)):
        port, handles = await serving(server)
        try:
            assert (await ask(port, "example.com", w.A)).rcode == rcode
        finally:
            await stop(handles)


async def test_server_before_the_first_sync_and_bad_queries() -> None:
    server = dnsserver.DnsServer(DOMAIN, CIDRS, [])
    assert (await server.handle(w.encode(query(f"web.{NS}.svc.{DOMAIN}", w.A)), tcp=False)) is not None
    unsynced = w.decode(await server.handle(w.encode(query(f"web.{NS}.svc.{DOMAIN}", w.A)), False) or b"")
    assert unsynced.rcode == w.SERVFAIL  # never a false NXDOMAIN
    garbage = w.decode(await server.handle(b"\x12\x34\x01\x00\x00\x01\x00", False) or b"")
    assert garbage.id == 0x1234 and garbage.rcode == w.FORMERR
    assert await server.handle(b"\x12", False) is None
    response = w.reply_to(query("x", w.A))
    assert await server.handle(w.encode(response), False) is None  # never answer an answer
    two = w.Message(5, 0, [w.Question("a", w.A), w.Question("b", w.A)])
    assert w.decode(await server.handle(w.encode(two), False) or b"").rcode == w.FORMERR


async def test_sync_builds_and_replaces_the_zone() -> None:
    server = dnsserver.DnsServer(DOMAIN, CIDRS, [])
    snapshots = [lists([service("web")], [], [], "1"), lists([service("web", "10.96.0.30")], [], [], "2")]
    calls: list[str] = []
    stop_event = asyncio.Event()

    def lister(path: str) -> dict[str, Any]:
        calls.append(path)
        if len(calls) > 3 * len(snapshots):
            stop_event.set()
            raise OSError("the API server went away")
        kind = next(k for k, p in dnsserver.LISTS.items() if p == path)
        return dict(snapshots[(len(calls) - 1) // 3][kind])

    await dnsserver.sync_forever(server, lister, 0.01, stop_event)
    assert server.zone is not None  # a failed list keeps the last zone
    assert data(server.zone.answer(query(f"web.{NS}.svc.{DOMAIN}", w.A))) == ["10.96.0.30"]
    assert server.load(lists([service("web", "10.96.0.30")], [], [], "2")) is False  # unchanged versions


def test_upstreams_from_resolv_conf(tmp_path: Any) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "search example\nnameserver 10.255.255.53\nnameserver 172.30.0.10\n# x\nnameserver fe80::1%eth0\n"
    )
    assert dnsserver.upstreams_from(conf, "172.30.0.10") == [("10.255.255.53", 53), ("fe80::1", 53)]
    assert dnsserver.upstreams_from(tmp_path / "missing", "") == []


# ------------------------------------------------------------ the harness's pieces
def test_kube_dns_service_and_kubelet_config(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, eps = configs.kube_dns()
    assert ipaddress.ip_address(svc["spec"]["clusterIP"]) in ipaddress.ip_network(layout.SERVICE_CIDR)
    assert "selector" not in svc["spec"]  # kube-proxy takes the endpoints from our slice
    assert eps["metadata"]["labels"]["kubernetes.io/service-name"] == svc["metadata"]["name"]
    assert {(p["name"], p["protocol"], p["port"]) for p in svc["spec"]["ports"]} == {
        (p["name"], p["protocol"], p["port"]) for p in eps["ports"]
    }
    assert eps["endpoints"][0]["addresses"] == [layout.CONTROL_IP]
    argv = configs.dns_argv()
    assert f"--listen={layout.CONTROL_IP}:53" in argv
    monkeypatch.setattr(layout.NodeSpec, "dir", property(lambda n: tmp_path / n.name))
    cfg = json.loads(Path(configs.kubelet_config(layout.NODES[0])).read_text())
    assert cfg["clusterDNS"] == [svc["spec"]["clusterIP"]] and cfg["clusterDomain"] == DOMAIN


class _FakeApi(http.server.BaseHTTPRequestHandler):
    objects: dict[str, list[dict[str, Any]]] = {}

    def do_GET(self) -> None:
        path, _, query_string = self.path.partition("?")
        kind = next((k for k, p in dnsserver.LISTS.items() if p == path), None)
        if kind is None or query_string != "resourceVersion=0":
            self.send_error(404)
            return
        body = json.dumps({"metadata": {"resourceVersion": "7"}, "items": self.objects[kind]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make certificates")
def test_process_lists_a_tls_api_server_with_a_client_certificate(tmp_path: Path) -> None:
    """`python -m tests.e2e.cluster.dnsserver` as the harness runs it, against an HTTPS API server
    that asks for the kubeconfig's client certificate."""
    pki.make_ca(tmp_path)
    pki.make_cert(tmp_path, pki.Identity("api", "api", usage=(pki.SERVER,), ips=("127.0.0.1",)))
    pki.make_cert(tmp_path, pki.Identity("admin", "admin", ("system:masters",)))
    _FakeApi.objects = {"services": [service("web")], "endpointslices": [], "pods": []}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tmp_path / "ca.crt"))
    ctx.load_cert_chain(str(tmp_path / "api.crt"), str(tmp_path / "api.key"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    kubeconfig = json.loads(pki.kubeconfig(tmp_path, "admin", "admin").read_text())
    kubeconfig["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{httpd.server_address[1]}"
    (tmp_path / "kc.json").write_text(json.dumps(kubeconfig))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "tests.e2e.cluster.dnsserver", f"--listen=127.0.0.1:{port}"]
    argv += [f"--kubeconfig={tmp_path / 'kc.json'}", f"--resolv-conf={tmp_path / 'none'}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        got: list[object] = []
        for _ in range(100):
            with contextlib.suppress(OSError, w.WireError):
                got = data(w.ask("127.0.0.1", port, f"web.{NS}.svc.{DOMAIN}", w.A, tcp=True))
            if got or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert got == ["10.96.0.20"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        httpd.shutdown()
        httpd.server_close()
    assert proc.returncode == 0, out.decode()
    assert b"stopped" in out


JESSIE = "registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7"


def _have_image(ref: str) -> bool:
    if shutil.which("docker") is None:
        return False
    proc = subprocess.run(["docker", "image", "inspect", ref], capture_output=True, timeout=60, check=False)
    return proc.returncode == 0


@pytest.mark.skipif(
    not _have_image(JESSIE), reason="no jessie-dnsutils image (scripts/testenv/cluster-images)"
)
async def test_bind_dig_reads_our_answers(tmp_path: Path) -> None:
    """BIND's dig, in the stand-in image the DNS specs run, as the specs ask: UDP and TCP, +search
    through a pod's resolv.conf, SRV, PTR, and a truncated UDP answer taken again over TCP."""
    many = [ep(f"10.244.{i // 200}.{i % 200 + 1}") for i in range(60)]
    server = dnsserver.DnsServer(DOMAIN, CIDRS, [])
    objects = lists(
        [service("web"), service("headless", "None"), service("many", "None")],
        [endpoint_slice("headless", ep("10.244.2.6", hostname="pod-b")), endpoint_slice("many", *many)],
        [],
    )
    server.load(objects)
    port, handles = await serving(server)
    (tmp_path / "resolv.conf").write_text(
        f"search {NS}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}\nnameserver 127.0.0.1\noptions ndots:5\n"
    )
    at = f"@127.0.0.1 -p {port}"
    script = " ; echo --- ; ".join(
        [
            f"dig {at} +notcp +noall +answer +search web A",
            f"dig {at} +tcp +noall +answer +search web.{NS} A",
            f"dig {at} +short _http._tcp.headless.{NS}.svc.{DOMAIN} SRV",
            f"dig {at} +short -x 10.96.0.20",
            f"dig {at} +noedns +short many.{NS}.svc.{DOMAIN} | wc -l",
            f"dig {at} nothing.{NS}.svc.{DOMAIN} | grep -c 'status: NXDOMAIN'",
        ]
    )
    argv = [
        "docker",
        "run",
        "--rm",
        "--network",
        "host",
        "-v",
        f"{tmp_path / 'resolv.conf'}:/etc/resolv.conf:ro",
    ]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            JESSIE,
            "sh",
            "-c",
            script,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        await stop(handles)
    parts = [p.strip() for p in out.decode().split("---")]
    assert len(parts) == 6, out.decode()
    assert parts[0].split() == [f"web.{NS}.svc.{DOMAIN}.", "5", "IN", "A", "10.96.0.20"]
    assert parts[1].split()[-1] == "10.96.0.20"
    assert parts[2] == f"0 100 8080 pod-b.headless.{NS}.svc.{DOMAIN}."
    assert parts[3] == f"web.{NS}.svc.{DOMAIN}."
    assert parts[4].splitlines()[-1] == "60"  # after ";; Truncated, retrying in TCP mode."
    assert parts[5] == "1"
    assert server.counts["truncated"] >= 1 and server.counts["tcp"] >= 2
