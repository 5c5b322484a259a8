"""The cluster's DNS zone, built from the API server's Services, EndpointSlices and Pods as the
Kubernetes "DNS-Based Service Discovery" specification (v1.1.0) lays it out, and the answers it gives.

For a zone `cluster.local`:

- a Service with a ClusterIP: ``svc.ns.svc.cluster.local`` A/AAAA → the ClusterIP(s); each named port
  ``_port._proto.svc.ns.svc.cluster.local`` SRV ``0 100 port svc.ns.svc.cluster.local``; PTR of the
  ClusterIP → the service's name;
- a headless Service: ``svc.ns.svc.cluster.local`` A/AAAA → the addresses of its ready endpoints
  (every endpoint with ``publishNotReadyAddresses``); an endpoint with a hostname also
  ``hostname.svc.ns.svc.cluster.local`` and a PTR to it; one without gets the name of its dashed
  address (``10-244-1-5.svc.ns.svc...``, what CoreDNS does); SRV per named port and endpoint, the
  endpoint's name as target, its address in the additional section;
- an ExternalName Service: ``svc.ns.svc.cluster.local`` CNAME → the external name;
- a pod: ``a-b-c-d.ns.pod.cluster.local`` A → a.b.c.d, while a pod of that namespace has that IP;
- several records of a name come in a random order (clients that take the first spread);
- a name in the zone that exists with no record of the type asked: NOERROR, no answer, the SOA;
  one that does not exist: NXDOMAIN and the SOA. TTLs are 5 s, as CoreDNS's, negative ones too.

Reverse names of the given CIDRs (the service and pod ranges) are the zone's as well: NXDOMAIN for
an address nobody has. Everything else is not the zone's (`owns` says no): the server forwards it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
from collections.abc import Iterable, Mapping
from typing import Any

from tests.e2e.cluster import dnswire as w

TTL = 5
SERIAL = 1


def dashed(address: str) -> str:
    """10.244.1.5 → 10-244-1-5; 2001:db8::1 → 2001-db8--1 (the spec's pod and endpoint labels)."""
    return address.replace(".", "-").replace(":", "-")


def _family(address: str) -> int:
    return w.A if ipaddress.ip_address(address).version == 4 else w.AAAA


@dataclasses.dataclass
class Zone:
    domain: str = "cluster.local"
    reverse_cidrs: tuple[str, ...] = ()
    records: dict[str, dict[int, list[object]]] = dataclasses.field(default_factory=dict)
    names: set[str] = dataclasses.field(default_factory=set)  # every name that exists, and its parents

    def __post_init__(self) -> None:
        self.domain = w.normalize(self.domain)
        self._nets = [ipaddress.ip_network(c) for c in self.reverse_cidrs]
        self.add(self.domain, w.SOA, self.soa())
        self.add(self.domain, w.NS, f"ns.dns.{self.domain}")

    # ---------------------------------------------------------------- building
    def add(self, name: str, rtype: int, data: object) -> None:
        name = w.normalize(name)
        bucket = self.records.setdefault(name, {}).setdefault(rtype, [])
        if data not in bucket:
            bucket.append(data)
        self.touch(name)

    def touch(self, name: str) -> None:
        """The name and its parents exist (NOERROR with no data rather than NXDOMAIN)."""
        labels = w.normalize(name).split(".")
        for i in range(len(labels)):
            self.names.add(".".join(labels[i:]))

    def soa(self) -> tuple[object, ...]:
        return (f"ns.dns.{self.domain}", f"hostmaster.{self.domain}", SERIAL, 7200, 1800, 86400, TTL)

    def add_service(self, svc: Mapping[str, Any], slices: Iterable[Mapping[str, Any]]) -> None:
        meta, spec = svc.get("metadata", {}), svc.get("spec", {})
        base = f"{meta.get('name')}.{meta.get('namespace')}.svc.{self.domain}"
        if spec.get("type") == "ExternalName":
            if spec.get("externalName"):
                self.add(base, w.CNAME, w.normalize(spec["externalName"]))
            return
        ips = [ip for ip in spec.get("clusterIPs") or [spec.get("clusterIP")] if ip and ip != "None"]
        if ips:
            for ip in ips:
                self.add(base, _family(ip), ip)
                self.add(w.reverse_name(ip), w.PTR, base)
            for port in spec.get("ports") or []:
                if port.get("name"):
                    proto = str(port.get("protocol", "TCP")).lower()
                    self.add(f"_{port['name']}._{proto}.{base}", w.SRV, (0, 100, int(port["port"]), base))
            return
        self._add_headless(base, bool(spec.get("publishNotReadyAddresses")), slices)

    def _add_headless(self, base: str, not_ready_too: bool, slices: Iterable[Mapping[str, Any]]) -> None:
        self.touch(base)  # the service's name exists even while it has no endpoint
        targets: list[tuple[str, str]] = []  # (endpoint name, address)
        ports: list[tuple[str, str, int]] = []
        for s in slices:
            for p in s.get("ports") or []:
                if p.get("name") and p.get("port") is not None:
                    ports.append((p["name"], str(p.get("protocol", "TCP")).lower(), int(p["port"])))
            for ep in s.get("endpoints") or []:
                ready = (ep.get("conditions") or {}).get("ready")
                if ready is False and not not_ready_too:
                    continue
                for address in ep.get("addresses") or []:
                    host = ep.get("hostname") or dashed(address)
                    name = f"{host}.{base}"
                    self.add(base, _family(address), address)
                    self.add(name, _family(address), address)
                    self.add(w.reverse_name(address), w.PTR, name)
                    targets.append((name, address))
        weight = max(1, 100 // len(targets)) if targets else 0
        for pname, proto, port in dict.fromkeys(ports):
            for name, _ in dict.fromkeys(targets):
                self.add(f"_{pname}._{proto}.{base}", w.SRV, (0, weight, port, name))

    def add_pod(self, pod: Mapping[str, Any]) -> None:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if pod.get("spec", {}).get("hostNetwork"):
            return  # the node's address is not the pod's to name
        addresses = [p.get("ip") for p in status.get("podIPs") or []] or [status.get("podIP")]
        for address in addresses:
            if address:
                self.add(
                    f"{dashed(address)}.{meta.get('namespace')}.pod.{self.domain}", _family(address), address
                )

    # ---------------------------------------------------------------- answering
    def owns(self, name: str) -> bool:
        """The name is this zone's to answer (else the server forwards it)."""
        name = w.normalize(name)
        if name == self.domain or name.endswith("." + self.domain):
            return True
        address = w.address_of_reverse(name)
        return address is not None and (
            any(ipaddress.ip_address(address) in net for net in self._nets) or name in self.records
        )

    def answer(self, query: w.Message) -> w.Message:
        """The authoritative answer to a query whose name `owns` is true for."""
        q = query.questions[0]
        reply = w.reply_to(query, authoritative=True)
        name = w.normalize(q.name)
        for _ in range(8):  # a CNAME inside the zone is followed, a few times at most
            rrs = self.records.get(name, {})
            if q.qtype == w.ANY:
                found = [(t, d) for t, ds in rrs.items() for d in ds]
            else:
                found = [(q.qtype, d) for d in rrs.get(q.qtype, [])]
            # The first owner is spelt as asked; a CNAME's target as the zone holds it.
            owner = q.name.rstrip(".") if name == w.normalize(q.name) else name
            if not found and w.CNAME in rrs and q.qtype != w.CNAME:
                target = str(rrs[w.CNAME][0])
                reply.answers.append(w.Record(owner, w.CNAME, TTL, target))
                if self.owns(target) and target != name:
                    name = target
                    continue
                return reply  # the server may chase a name outside the zone
            if len(found) > 1:  # each answer in another order, as CoreDNS's loadbalance plugin does
                random.shuffle(found)
            reply.answers += [w.Record(owner, t, TTL, d) for t, d in found]
            break
        if not reply.answers:
            reply.authority.append(w.Record(self.domain, w.SOA, TTL, self.soa()))
            if name not in self.names and name not in self.records:
                reply.flags |= w.NXDOMAIN
            return reply
        for r in list(reply.answers):
            if r.rtype == w.SRV:
                assert isinstance(r.data, tuple)
                target = w.normalize(r.data[3])
                for t in (w.A, w.AAAA):
                    reply.additional += [
                        w.Record(target, t, TTL, d) for d in self.records.get(target, {}).get(t, [])
                    ]
        return reply


def build(
    services: Iterable[Mapping[str, Any]],
    endpoint_slices: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    domain: str = "cluster.local",
    reverse_cidrs: tuple[str, ...] = (),
) -> Zone:
    """The zone of these API objects (items of the list answers of the API server)."""
    zone = Zone(domain, reverse_cidrs)
    by_service: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in endpoint_slices:
        meta = s.get("metadata", {})
        svc = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if svc:
            by_service.setdefault((meta.get("namespace", ""), svc), []).append(s)
    for svc in services:
        meta = svc.get("metadata", {})
        zone.add_service(svc, by_service.get((meta.get("namespace", ""), meta.get("name", "")), []))
    for pod in pods:
        if pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            zone.add_pod(pod)
    return zone
