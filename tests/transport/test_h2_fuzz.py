"""Seeded, bounded frame-level fuzzing of the native transport.

Connections send raw frames of every type (DATA, HEADERS, PRIORITY,
RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION
and types HTTP/2 does not define) with random lengths, flags, stream IDs and
payloads, some random bytes, some shaped like the real thing (valid HPACK
request blocks, gRPC messages, edge-value SETTINGS and window increments) so
that they get past the first checks. Meanwhile a well-behaved h2 client on a
connection of its own keeps calling and checking every answer.

Nothing may crash the server, log a bug (``h2.bug``, a traceback, an
unretrieved task exception), end a bad connection with INTERNAL_ERROR, or
reach the well-behaved connection.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hpack import Encoder

from cri_api import api_pb2 as pb
from tests.criutil import until
from tests.transport.conftest import Native, pod_request
from tests.transport.h2peer import RUNTIME, Peer, frame, grpc_frame, parse_frames, request_headers

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
KINDS = [*range(10), 0x0B, 0xFA]  # the ten of RFC 9113, and two it does not define
EDGE_WINDOWS = (0, 1, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)
EDGE_SETTINGS = (0, 1, 2, 4095, 4096, 16383, 16384, 65535, (1 << 24) - 1, 1 << 24, (1 << 31) - 1, 1 << 31)
METHODS = (
    "Version",
    "ListPodSandbox",
    "GetContainerEvents",
    "StreamPodSandboxes",
    "PodSandboxStatus",
    "Nope",
)
CONNECTIONS = 200  # per seed
BATCH = 6  # fuzzing connections open at once


class Fuzzer:
    """One connection's worth of random frames."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.encoder = Encoder()
        self.opened: list[int] = []
        self.next_sid = 1

    def sid(self, kind: int) -> int:
        """Mostly the right kind of stream for ``kind``, often not."""
        rng = self.rng
        roll = rng.random()
        if kind in (4, 6, 7) and roll < 0.8:
            return 0
        if roll < 0.5 and self.opened:
            return rng.choice(self.opened)
        if roll < 0.7:
            return self.next_sid
        return rng.choice(
            (0, 0, 2, 4, self.next_sid + 2, self.next_sid + 100, (1 << 31) - 1, rng.getrandbits(31))
        )

    def header_block(self) -> bytes:
        rng = self.rng
        headers = request_headers(RUNTIME + rng.choice(METHODS), rng.choice((None, "1m", "5S", "x")))
        if rng.random() < 0.2:
            headers = headers[rng.randint(0, 4) :]  # pseudo-headers missing
        if rng.random() < 0.2:
            headers.append((b"x-pad", b"p" * rng.choice((1, 100, 5000))))
        if rng.random() < 0.1:
            self.encoder.header_table_size = rng.choice((0, 64, 4096, 8192))
        return bytes(self.encoder.encode(headers))

    def payload(self, kind: int) -> bytes:
        rng = self.rng
        if rng.random() < 0.25:
            return rng.randbytes(rng.choice((0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 30, 300, 5000)))
        if kind == 0:
            body = grpc_frame(
                rng.choice((pb.VersionRequest(), pb.ListPodSandboxRequest(), rng.randbytes(20)))
            )
            return body[: rng.randint(0, len(body))] if rng.random() < 0.3 else body
        if kind in (1, 9):
            block = self.header_block()
            if rng.random() < 0.3:
                return block[: rng.randint(0, len(block))]
            return block
        if kind == 2:
            return rng.getrandbits(32).to_bytes(4, "big") + bytes((rng.getrandbits(8),))
        if kind == 3:
            return rng.choice((0, 1, 2, 7, 8, 0xFF, rng.getrandbits(32))).to_bytes(4, "big")
        if kind == 4:
            entries = [
                (rng.choice((1, 2, 3, 4, 5, 6, 8, 0x99)), rng.choice(EDGE_SETTINGS))
                for _ in range(rng.randint(0, 4))
            ]
            return b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in entries)
        if kind == 5:
            return rng.getrandbits(31).to_bytes(4, "big") + self.header_block()
        if kind == 6:
            return rng.randbytes(8)
        if kind == 7:
            return rng.getrandbits(32).to_bytes(4, "big") + rng.getrandbits(32).to_bytes(4, "big") + b"bye"
        if kind == 8:
            return rng.choice(EDGE_WINDOWS).to_bytes(4, "big")
        return rng.randbytes(rng.randint(0, 64))

    def flags(self, kind: int) -> int:
        rng = self.rng
        if rng.random() < 0.25:
            return rng.getrandbits(8)
        return rng.choice({0: (0, 1, 8, 9), 1: (4, 5, 0, 1, 0x24, 0x2D), 9: (0, 4)}.get(kind, (0, 1)))

    def request(self) -> bytes:
        """A valid request on the next stream, its header block in one frame or more (so that the
        frames after it find streams open); it may end, or leave its body to come."""
        rng = self.rng
        sid = self.next_sid
        self.next_sid += 2
        self.opened.append(sid)
        method = rng.choice(("Version", "ListPodSandbox", "GetContainerEvents", "StreamPodSandboxes"))
        block = bytes(self.encoder.encode(request_headers(RUNTIME + method, rng.choice((None, "1S", "1m")))))
        cut = rng.choice((len(block), 1, 5, 20))
        pieces = [block[i : i + cut] for i in range(0, len(block), cut)]
        out = frame(1, 4 if len(pieces) == 1 else 0, sid, pieces[0])
        for i, piece in enumerate(pieces[1:], 2):
            out += frame(9, 4 if i == len(pieces) else 0, sid, piece)
        body = grpc_frame(pb.ListPodSandboxRequest())
        return out + frame(0, rng.choice((0, 1, 1, 1)), sid, body)

    def connection(self) -> bytes:
        rng = self.rng
        out = bytearray(PREFACE + frame(4, 0, 0))
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.3:
                out += self.request()
                continue
            kind = rng.choice(KINDS)
            sid = self.sid(kind)
            out += frame(kind, self.flags(kind), sid, self.payload(kind))
            if kind == 1 and sid == self.next_sid:
                self.opened.append(sid)
                self.next_sid += 2
        return bytes(out)


async def fuzz_one(path: str, data: bytes, rng: random.Random) -> bytes:
    """Send ``data`` in random pieces, then end our half; what the server sent until it closed."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        pos = 0
        while pos < len(data):
            step = rng.choice((1, 7, 100, 4096, len(data)))
            writer.write(data[pos : pos + step])
            pos += step
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        if rng.random() < 0.5:
            await asyncio.sleep(0.01)  # let calls start before the connection goes
        writer.write_eof()
        async with asyncio.timeout(15):
            return await reader.read(-1)
    except (ConnectionResetError, BrokenPipeError):
        return b""  # the server closed first, as it may on a protocol error
    finally:
        writer.close()


async def bystander(native: Native, stop: asyncio.Event, pods: set[str]) -> int:
    """Calls on a well-behaved connection until ``stop``; each answer checked. How many were made."""
    peer = await Peer.open(native.sock)
    try:
        events = await peer.start(RUNTIME + "GetContainerEvents", pb.GetEventsRequest())
        mine = pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(label_selector={"group": "bystander"}))
        calls = 0
        while not stop.is_set():
            version = await peer.call(RUNTIME + "Version", pb.VersionRequest())
            assert version.status == 0
            assert pb.VersionResponse.FromString(version.messages()[0]).runtime_api_version == "v1"
            listed = await peer.call(RUNTIME + "ListPodSandbox", mine)
            assert listed.status == 0
            [message] = listed.messages()
            assert {p.id for p in pb.ListPodSandboxResponse.FromString(message).items} == pods
            await peer.ping()
            calls += 2
            await asyncio.sleep(0.005)
        assert not peer.replies[events].done
        return calls
    finally:
        await peer.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_frames_reach_no_further_than_their_connection(
    native: Native, capfd: pytest.CaptureFixture[str], seed: int
) -> None:
    pods = set()
    for i in range(3):
        req = pod_request(f"b{i}")
        req.config.labels["group"] = "bystander"
        pods.add((await native.rt.RunPodSandbox(req)).pod_sandbox_id)
    await native.channel.close()  # the fuzzing and the bystander's connections only
    await until(lambda: native.connections == 0)
    stop = asyncio.Event()
    calm = asyncio.ensure_future(bystander(native, stop, pods))
    rng = random.Random(seed)
    answers: list[bytes] = []
    try:
        for first in range(0, CONNECTIONS, BATCH):
            batch = [Fuzzer(random.Random(rng.getrandbits(64))).connection() for _ in range(BATCH)]
            answers += await asyncio.gather(
                *(fuzz_one(native.sock, data, random.Random(first + i)) for i, data in enumerate(batch))
            )
            assert not calm.done(), calm.exception()
    finally:
        stop.set()
    assert await calm > 0
    await until(lambda: native.connections == 0 and native.tasks == 0)
    answered = 0
    for answer in answers:
        frames, used = parse_frames(answer)
        assert used == len(answer), "the server sent a partial frame"
        codes = [int.from_bytes(p[4:8], "big") for kind, _, _, p in frames if kind == 7]
        assert 2 not in codes, "a connection ended with INTERNAL_ERROR"
        answered += any(kind == 1 for kind, _, _, _ in frames)
    assert answered >= CONNECTIONS // 20  # the fuzzing reached the calls, not only the frame checks
    # still serving
    peer = await Peer.open(native.sock)
    try:
        assert (await peer.call(RUNTIME + "Version", pb.VersionRequest())).status == 0
    finally:
        await peer.close()
    logged = capfd.readouterr()
    text = logged.out + logged.err
    assert "h2.protocol_error" in text  # the fuzzing did reach the checks
    for bug in ("h2.bug", "Traceback", "exception was never retrieved", "Exception in callback"):
        assert bug not in text
