"""The agent wire protocol: byte-level framing vectors and the multiplexer over a socket pair."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from backends.runv.agent import protocol as p
from backends.runv.agent.client import AgentClient
from backends.runv.agent.messages import StateRequest
from shim.cri import errors

VECTORS = [
    (
        p.Frame(p.Kind.REQUEST, 1, {"op": "hello", "args": {}}),
        bytes.fromhex("00000024010100000000000100000018") + b'{"op":"hello","args":{}}',
    ),
    (
        p.Frame(p.Kind.DATA, 7, payload=b"hi\n", channel=p.Ch.STDERR),
        bytes.fromhex("0000000f010302000000000700000000") + b"hi\n",
    ),
    (
        p.Frame(p.Kind.CLOSE, 0x01020304, channel=p.Ch.STDOUT),
        bytes.fromhex("0000000c010401000102030400000000"),
    ),
    (
        p.Frame(p.Kind.RESPONSE, 2, {"ok": True}, b"\x00\xff"),
        bytes.fromhex("0000001901020000000000020000000b") + b'{"ok":true}' + b"\x00\xff",
    ),
]


@pytest.mark.parametrize(
    ("frame", "wire"), VECTORS, ids=["request", "data-stderr", "close", "response-payload"]
)
def test_encode_vectors(frame: p.Frame, wire: bytes) -> None:
    # The vectors' lengths are hand-computed: the prefix counts the 12-byte head + header + payload.
    assert p.encode(frame) == wire


@pytest.mark.parametrize(
    ("frame", "wire"), VECTORS, ids=["request", "data-stderr", "close", "response-payload"]
)
def test_decode_vectors_byte_by_byte(frame: p.Frame, wire: bytes) -> None:
    dec = p.Decoder()
    got: list[p.Frame] = []
    for i in range(len(wire)):
        got += dec.feed(wire[i : i + 1])
        if i < len(wire) - 1:
            assert got == []
    assert got == [frame]
    assert dec.pending == 0


def test_decode_many_frames_in_one_chunk() -> None:
    wire = b"".join(w for _, w in VECTORS)
    assert p.Decoder().feed(wire) == [f for f, _ in VECTORS]


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (bytes.fromhex("0000000c020100000000000100000000"), "version 2"),
        (bytes.fromhex("0000000c010900000000000100000000"), "kind 9"),
        (bytes.fromhex("0000000401010000"), "bad frame length 4"),
        (bytes.fromhex("7fffffff"), "bad frame length"),
        (bytes.fromhex("0000000d010100000000000100000005") + b"{", "header longer"),
        (bytes.fromhex("0000000d010100000000000100000001") + b"[", "bad header JSON"),
        (bytes.fromhex("0000000e010100000000000100000002") + b"[]", "not a JSON object"),
    ],
    ids=["version", "kind", "short", "huge", "header-overrun", "bad-json", "not-object"],
)
def test_decode_rejects(wire: bytes, message: str) -> None:
    with pytest.raises(p.ProtocolError, match=message):
        p.Decoder().feed(wire)


def test_encode_rejects_oversized_frame() -> None:
    with pytest.raises(p.ProtocolError):
        p.encode(p.Frame(p.Kind.DATA, 1, payload=b"x" * p.MAX_FRAME))


# --------------------------------------------------------------------------- multiplexer


class Pair:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.server: p.Channel | None = None
        self.client: AgentClient | None = None


async def _handler_for(pair: Pair) -> p.Handler:
    async def handle(op: str, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        assert pair.server is not None
        if op == "echo":
            return {"args": args, "payload_len": len(payload)}
        if op == "missing":
            raise p.AgentError("not_found", "no such thing")
        if op == "boom":
            raise RuntimeError("kaput")
        if op == "state":  # a result of the wrong shape
            return {"id": 5, "status": "running"}
        if op == "slow":
            await asyncio.sleep(10)
            return {}
        if op == "stream":
            st = pair.server.stream(int(args["stream"]))
            # Echo STDIN back on STDOUT in upper case until the client half-closes.
            while True:
                _ch, data = await st.read()
                if not data:
                    break
                await st.write(p.Ch.STDOUT, data.upper())
            await st.close(p.Ch.STDOUT)
            await pair.server.send_event("done", {"stream": st.id})
            return {"ok": 1}
        raise p.AgentError("unimplemented", op)

    return handle


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    a, b = socket.socketpair()
    result = Pair()
    r1, w1 = await asyncio.open_connection(sock=a)
    r2, w2 = await asyncio.open_connection(sock=b)
    result.server = p.Channel(r2, w2, await _handler_for(result))
    result.server.start()
    result.client = AgentClient(r1, w1, lambda n, body: result.events.append((n, body)), timeout=1.0)
    yield result
    await result.client.close()
    await result.server.aclose()


async def test_request_response(pair: Pair) -> None:
    assert pair.client is not None
    got = await pair.client.channel.request("echo", {"x": [1, "y"]}, payload=b"\x00" * 100_000)
    assert got == {"args": {"x": [1, "y"]}, "payload_len": 100_000}


@pytest.mark.parametrize(
    ("op", "exc", "text"),
    [
        ("missing", errors.NotFoundError, "no such thing"),
        ("boom", errors.InternalError, "RuntimeError: kaput"),
        ("nope", errors.UnimplementedError, "nope"),
        ("slow", errors.UnavailableError, "did not answer slow"),
    ],
    ids=["not-found", "crash-in-handler", "unknown-op", "timeout"],
)
async def test_errors_map_to_conditions(pair: Pair, op: str, exc: type[Exception], text: str) -> None:
    assert pair.client is not None
    with pytest.raises(exc, match=text):
        await pair.client.raw(op, {}, timeout=0.3 if op == "slow" else 1.0)


async def test_typed_call_checks_the_result(pair: Pair) -> None:
    assert pair.client is not None
    with pytest.raises(errors.InternalError, match="agent state: bad result: id: expected str, got int"):
        await pair.client.call(StateRequest(id="c1"))


async def test_concurrent_requests_and_stream(pair: Pair) -> None:
    assert pair.client is not None
    st = pair.client.stream()
    call = asyncio.ensure_future(pair.client.raw("stream", {"stream": st.id}))
    echoes = [asyncio.ensure_future(pair.client.raw("echo", {"n": i})) for i in range(20)]
    await st.write(p.Ch.STDIN, b"abc" * 50_000)  # several DATA frames
    await st.close(p.Ch.STDIN)
    out = bytearray()
    while True:
        ch, data = await st.read()
        if not data:
            break
        assert ch == p.Ch.STDOUT
        out += data
    assert bytes(out) == b"ABC" * 50_000
    assert await call == {"ok": 1}
    assert [(await e)["args"]["n"] for e in echoes] == list(range(20))
    assert pair.events == [("done", {"stream": st.id})]


async def test_peer_gone_fails_pending_requests(pair: Pair) -> None:
    assert pair.client is not None and pair.server is not None
    pending = asyncio.ensure_future(pair.client.raw("slow", {}, timeout=5.0))
    await asyncio.sleep(0.05)
    await pair.server.aclose()
    with pytest.raises(errors.UnavailableError, match="lost"):
        await pending
    assert pair.client.closed
