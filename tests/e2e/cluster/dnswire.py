"""The DNS wire format (RFC 1035 section 4, SRV from RFC 2782, AAAA from RFC 3596, EDNS's OPT from
RFC 6891): the messages the cluster's DNS server reads and writes, and `ask`, one blocking query
(the harness's readiness check and the tests; kept out of ``dnsserver``, which runs as ``-m``).

Written here rather than taken from a package: the server needs a dozen record types and one
message layout, and the harness's venv stays what the project's is. Decoding follows compression
pointers (only backwards, a bounded number of them); encoding compresses every name against the
ones already written. Names are kept as text without the final dot, in the case they came in.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import struct

# Record types and classes used here.
A, NS, CNAME, SOA, PTR, TXT, AAAA, SRV, OPT, ANY = 1, 2, 5, 6, 12, 16, 28, 33, 41, 255
IN = 1
TYPE_NAMES = {A: "A", NS: "NS", CNAME: "CNAME", SOA: "SOA", PTR: "PTR", TXT: "TXT", AAAA: "AAAA", SRV: "SRV"}

# Response codes.
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5

# Header flag bits.
QR, AA, TC, RD, RA = 0x8000, 0x0400, 0x0200, 0x0100, 0x0080
OPCODE_SHIFT = 11

UDP_MIN = 512  # what a UDP answer may be without EDNS
UDP_MAX = 4096  # what we offer and accept with EDNS
MAX_POINTERS = 64


class WireError(ValueError):
    """The bytes are not a DNS message this module can read."""


@dataclasses.dataclass(frozen=True)
class Question:
    name: str
    qtype: int
    qclass: int = IN


@dataclasses.dataclass(frozen=True)
class Record:
    """A resource record. `data` is the decoded RDATA: an address as text (A, AAAA), a name (NS,
    CNAME, PTR), a tuple (SRV: priority, weight, port, target; SOA: mname, rname, serial, refresh,
    retry, expire, minimum), a tuple of strings (TXT), raw bytes for anything else (OPT too)."""

    name: str
    rtype: int
    ttl: int
    data: object
    rclass: int = IN


@dataclasses.dataclass
class Message:
    id: int = 0
    flags: int = 0
    questions: list[Question] = dataclasses.field(default_factory=list)
    answers: list[Record] = dataclasses.field(default_factory=list)
    authority: list[Record] = dataclasses.field(default_factory=list)
    additional: list[Record] = dataclasses.field(default_factory=list)

    @property
    def rcode(self) -> int:
        return self.flags & 0xF

    @property
    def opcode(self) -> int:
        return (self.flags >> OPCODE_SHIFT) & 0xF

    def opt(self) -> Record | None:
        return next((r for r in self.additional if r.rtype == OPT), None)

    def udp_limit(self) -> int:
        """The largest UDP answer the asker takes: 512 without EDNS, else its payload size (RFC 6891
        6.2.5: never less than 512), up to ours."""
        opt = self.opt()
        return UDP_MIN if opt is None else max(UDP_MIN, min(opt.rclass, UDP_MAX))


# ------------------------------------------------------------ names
def normalize(name: str) -> str:
    """The name as the zone's keys hold it: lower case, no final dot."""
    return name.rstrip(".").lower()


def _labels(name: str) -> list[bytes]:
    name = name.rstrip(".")
    if not name:
        return []
    labels = [label.encode("ascii") for label in name.split(".")]
    if any(not 0 < len(label) < 64 for label in labels):
        raise WireError(f"bad name {name!r}: empty label or one over 63 bytes")
    if sum(len(label) + 1 for label in labels) + 1 > 255:
        raise WireError(f"name over 255 bytes: {name[:40]}...")
    return labels


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.offsets: dict[str, int] = {}  # lower-cased suffix -> offset written at

    def name(self, name: str, compress: bool = True) -> None:
        labels = _labels(name)
        for i in range(len(labels)):
            suffix = b".".join(labels[i:]).decode().lower()
            at = self.offsets.get(suffix) if compress else None
            if at is not None:
                self.buf += struct.pack("!H", 0xC000 | at)
                return
            if len(self.buf) < 0x3FFF:
                self.offsets[suffix] = len(self.buf)
            self.buf += bytes([len(labels[i])]) + labels[i]
        self.buf.append(0)

    def record(self, r: Record) -> None:
        self.name(r.name)
        self.buf += struct.pack("!HHI", r.rtype, r.rclass, r.ttl & 0xFFFFFFFF)
        length_at = len(self.buf)
        self.buf += b"\0\0"
        self._rdata(r)
        struct.pack_into("!H", self.buf, length_at, len(self.buf) - length_at - 2)

    def _rdata(self, r: Record) -> None:
        d = r.data
        if r.rtype == A:
            self.buf += ipaddress.IPv4Address(str(d)).packed
        elif r.rtype == AAAA:
            self.buf += ipaddress.IPv6Address(str(d)).packed
        elif r.rtype in (NS, CNAME, PTR):
            self.name(str(d))
        elif r.rtype == SRV:
            assert isinstance(d, tuple)
            self.buf += struct.pack("!HHH", d[0], d[1], d[2])
            self.name(d[3], compress=False)  # RFC 2782: the target is never compressed
        elif r.rtype == SOA:
            assert isinstance(d, tuple)
            self.name(d[0])
            self.name(d[1])
            self.buf += struct.pack("!IIIII", *d[2:7])
        elif r.rtype == TXT:
            assert isinstance(d, tuple)
            for s in d:
                b = str(s).encode()[:255]
                self.buf += bytes([len(b)]) + b
        else:
            self.buf += bytes(d) if isinstance(d, (bytes, bytearray)) else b""


def encode(m: Message, limit: int = 65535) -> bytes:
    """The message's bytes. When they would exceed `limit`, the answer is cut to its header and
    question with TC set (RFC 2181 9: a resolver then asks again over TCP)."""
    w = _Writer()
    sections = (m.answers, m.authority, m.additional)
    w.buf += struct.pack("!HHHHHH", m.id, m.flags, len(m.questions), *(len(s) for s in sections))
    for q in m.questions:
        w.name(q.name)
        w.buf += struct.pack("!HH", q.qtype, q.qclass)
    for section in sections:
        for r in section:
            w.record(r)
    if len(w.buf) <= limit:
        return bytes(w.buf)
    opt = [r for r in m.additional if r.rtype == OPT]
    cut = Message(m.id, m.flags | TC, list(m.questions), [], [], opt)
    return encode(cut, 65535)


# ------------------------------------------------------------ decoding
class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise WireError("message ends early")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def name(self) -> str:
        labels: list[str] = []
        pos, jumped, pointers = self.pos, False, 0
        while True:
            if pos >= len(self.data):
                raise WireError("name runs past the message")
            n = self.data[pos]
            if n & 0xC0 == 0xC0:
                if pos + 1 >= len(self.data):
                    raise WireError("compression pointer cut")
                target = ((n & 0x3F) << 8) | self.data[pos + 1]
                pointers += 1
                if target >= pos or pointers > MAX_POINTERS:
                    raise WireError("compression pointer loops or points forwards")
                if not jumped:
                    self.pos = pos + 2
                jumped = True
                pos = target
                continue
            if n & 0xC0:
                raise WireError(f"label type {n >> 6} not supported")
            pos += 1
            if n == 0:
                break
            if pos + n > len(self.data):
                raise WireError("label runs past the message")
            labels.append(self.data[pos : pos + n].decode("ascii", errors="replace"))
            pos += n
        if not jumped:
            self.pos = pos
        name = ".".join(labels)
        if len(name) > 253:
            raise WireError("name over 255 bytes")
        return name

    def record(self) -> Record:
        name = self.name()
        rtype, rclass, ttl, length = self.unpack("!HHIH")
        end = self.pos + length
        if end > len(self.data):
            raise WireError("record data runs past the message")
        data: object
        if rtype == A and length == 4:
            data = str(ipaddress.IPv4Address(self.take(4)))
        elif rtype == AAAA and length == 16:
            data = str(ipaddress.IPv6Address(self.take(16)))
        elif rtype in (NS, CNAME, PTR):
            data = self.name()
        elif rtype == SRV:
            prio, weight, port = self.unpack("!HHH")
            data = (prio, weight, port, self.name())
        elif rtype == SOA:
            mname, rname = self.name(), self.name()
            data = (mname, rname, *self.unpack("!IIIII"))
        elif rtype == TXT:
            strings = []
            while self.pos < end:
                (n,) = self.unpack("!B")
                strings.append(self.take(n).decode(errors="replace"))
            data = tuple(strings)
        else:
            data = self.take(length)
        if self.pos != end:
            raise WireError(f"record {name!r} type {rtype}: data length {length} does not match")
        return Record(name, rtype, ttl, data, rclass)


def decode(data: bytes) -> Message:
    r = _Reader(data)
    if len(data) < 12:
        raise WireError(f"{len(data)} bytes: shorter than a header")
    mid, flags, qd, an, ns, ar = r.unpack("!HHHHHH")
    m = Message(mid, flags)
    for _ in range(qd):
        name = r.name()
        qtype, qclass = r.unpack("!HH")
        m.questions.append(Question(name, qtype, qclass))
    for count, section in ((an, m.answers), (ns, m.authority), (ar, m.additional)):
        for _ in range(count):
            section.append(r.record())
    return m


def header_id(data: bytes) -> int | None:
    """The ID of a message too broken to decode, to answer FORMERR to it; None if not even that."""
    return int(struct.unpack("!H", data[:2])[0]) if len(data) >= 2 else None


def opt_record(payload: int = UDP_MAX) -> Record:
    """Our EDNS OPT pseudo-record: its class is the UDP payload size we take."""
    return Record("", OPT, 0, b"", payload)


def reply_to(query: Message, rcode: int = NOERROR, authoritative: bool = False) -> Message:
    """An empty answer to `query`: its ID, opcode, RD, question and (if it had one) an OPT."""
    flags = QR | RA | (query.flags & (RD | (0xF << OPCODE_SHIFT))) | rcode
    if authoritative:
        flags |= AA
    m = Message(query.id, flags, list(query.questions[:1]))
    if query.opt() is not None:
        m.additional.append(opt_record())
    return m


def reverse_name(address: str) -> str:
    """The PTR name of an address: d.c.b.a.in-addr.arpa, or the nibbles under ip6.arpa."""
    return ipaddress.ip_address(address).reverse_pointer


def address_of_reverse(name: str) -> str | None:
    """The address a PTR name stands for, or None when it is not a whole address's name."""
    labels = normalize(name).split(".")
    if labels[-2:] == ["in-addr", "arpa"] and len(labels) == 6:
        try:
            return str(ipaddress.IPv4Address(".".join(reversed(labels[:4]))))
        except ValueError:
            return None
    if labels[-2:] == ["ip6", "arpa"] and len(labels) == 34:
        nibbles = "".join(reversed(labels[:32]))
        try:
            return str(ipaddress.IPv6Address(int(nibbles, 16)))
        except ValueError:
            return None
    return None


# ------------------------------------------------------------ a client
def ask(
    host: str, port: int, name: str, qtype: int, tcp: bool = False, timeout: float = 2.0, edns: int = 0
) -> Message:
    """One query, blocking (the harness's readiness check and the tests): the decoded answer."""
    q = Message(0x4B1D, RD, [Question(name, qtype)])
    if edns:
        q.additional.append(opt_record(edns))
    raw = encode(q)
    kind = socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as s:
        s.settimeout(timeout)
        s.connect((host, port))
        if tcp:
            s.sendall(struct.pack("!H", len(raw)) + raw)
            head = _recv_exactly(s, 2)
            return decode(_recv_exactly(s, struct.unpack("!H", head)[0]))
        s.send(raw)
        return decode(s.recv(65535))


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed mid-message")
        buf += chunk
    return buf
