"""The docker backend's short-call HTTP client, against a scripted engine on a unix socket."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from backends.docker.engine import EngineClient
from shim.cri.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)

Reply = Callable[[str, str, bytes], bytes | None]  # None: never answer


def answer(status: int, body: object = None, extra: str = "") -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n{extra}\r\n"
    )
    return head.encode() + data


class Engine:
    """Answers each request with ``reply(method, target, body)``; counts connections and requests."""

    def __init__(self, path: str, reply: Reply) -> None:
        self.path = path
        self.reply = reply
        self.connections = 0
        self.requests: list[tuple[str, str, bytes]] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, target, _ = lines[0].split(" ")
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append((method, target, body))
                out = self.reply(method, target, body)
                if out is None:
                    await reader.read()  # hold the connection until the client drops it
                    break
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    eng = Engine(str(tmp_path / "docker.sock"), lambda m, t, b: answer(200, {"ok": True}))
    server = await asyncio.start_unix_server(eng.serve, eng.path)
    yield eng
    server.close()
    for w in eng.writers:
        w.close()


async def client_for(engine: Engine, call_timeout: float = 5.0) -> EngineClient:
    return EngineClient(f"unix://{engine.path}", call_timeout=call_timeout)


async def test_calls_share_one_kept_alive_connection(engine: Engine) -> None:
    client = await client_for(engine)
    try:
        for _ in range(5):
            assert await client.request("GET", "/containers/abc/json") == {"ok": True}
        assert engine.connections == 1
        assert engine.requests[0][:2] == ("GET", "/v1.41/containers/abc/json")
    finally:
        await client.close()


async def test_query_and_body_are_encoded(engine: Engine) -> None:
    client = await client_for(engine)
    try:
        await client.request(
            "POST",
            "/containers/create",
            {"name": "k8s_a b", "all": True, "force": False, "skip": None, "filters": {"label": ["x=y"]}},
            {"Image": "busybox"},
        )
        method, target, body = engine.requests[0]
        assert method == "POST"
        path, query = target.split("?")
        assert path == "/v1.41/containers/create"
        assert sorted(query.split("&")) == sorted(
            ["name=k8s_a%20b", "all=1", "force=0", "filters=%7B%22label%22%3A%5B%22x%3Dy%22%5D%7D"]
        )
        assert json.loads(body) == {"Image": "busybox"}
    finally:
        await client.close()


async def test_an_idle_connection_the_engine_closed_is_replaced(engine: Engine) -> None:
    client = await client_for(engine)
    try:
        await client.request("GET", "/a")
        for w in engine.writers:  # the engine drops its idle connections (a restart does too)
            w.close()
        await asyncio.sleep(0.05)
        assert await client.request("POST", "/b") == {"ok": True}
        assert engine.connections == 2
        assert [t for _, t, _ in engine.requests] == ["/v1.41/a", "/v1.41/b"]  # sent once each
    finally:
        await client.close()


async def test_chunked_answers_and_connection_close(engine: Engine) -> None:
    def reply(method: str, target: str, body: bytes) -> bytes:
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n4\r\n[1, \r\n3\r\n2]\n\r\n0\r\n\r\n"
        )

    engine.reply = reply
    client = await client_for(engine)
    try:
        assert await client.request("GET", "/x") == [1, 2]
        assert await client.request("GET", "/x") == [1, 2]
        assert engine.connections == 2  # "Connection: close" is honoured
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("status", "message", "error"),
    [
        (404, "No such container: abc", NotFoundError),
        (409, 'Conflict. The container name "/x" is already in use', AlreadyExistsError),
        (409, "You cannot remove a running container", FailedPreconditionError),
        (400, "invalid reference format", InvalidArgumentError),
        (503, "engine shutting down", UnavailableError),
        (301, "", InvalidArgumentError),
    ],
)
async def test_error_statuses(engine: Engine, status: int, message: str, error: type[Exception]) -> None:
    engine.reply = lambda m, t, b: answer(status, {"message": message} if message else None)
    client = await client_for(engine)
    try:
        with pytest.raises(error) as info:
            await client.request("DELETE", "/containers/abc")
        if message:
            assert message in str(info.value)
    finally:
        await client.close()


async def test_not_modified_is_success(engine: Engine) -> None:
    engine.reply = lambda m, t, b: b"HTTP/1.1 304 Not Modified\r\n\r\n"
    client = await client_for(engine)
    try:
        assert await client.request("POST", "/containers/abc/stop", {"t": 0}) is None
        assert await client.request("POST", "/containers/abc/stop", {"t": 0}) is None
        assert engine.connections == 1
    finally:
        await client.close()


async def test_deadline_drops_the_connection(engine: Engine) -> None:
    slow = {"on": True}
    engine.reply = lambda m, t, b: None if slow["on"] else answer(200, {"ok": 1})
    client = await client_for(engine, call_timeout=0.2)
    try:
        with pytest.raises(DeadlineExceededError):
            await client.request("POST", "/containers/abc/stop", {"t": 0})
        slow["on"] = False
        assert await client.request("GET", "/b") == {"ok": 1}  # on a new connection
        assert engine.connections == 2
    finally:
        await client.close()


async def test_cancelled_call_leaves_no_connection_behind(engine: Engine) -> None:
    engine.reply = lambda m, t, b: None
    client = await client_for(engine)
    task = asyncio.create_task(client.request("GET", "/slow"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client._idle == []
    await client.close()


async def test_engine_down_is_unavailable(tmp_path: Path) -> None:
    client = EngineClient(f"unix://{tmp_path}/absent.sock")
    try:
        with pytest.raises(UnavailableError):
            await client.request("GET", "/_ping")
    finally:
        await client.close()


async def test_calls_in_flight_are_bounded(engine: Engine) -> None:
    gate = asyncio.Event()
    in_flight = {"now": 0, "most": 0}

    async def slow_serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        engine.connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                in_flight["now"] += 1
                in_flight["most"] = max(in_flight["most"], in_flight["now"])
                await gate.wait()
                in_flight["now"] -= 1
                writer.write(answer(200, {"ok": True}))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    path = engine.path + "2"
    server = await asyncio.start_unix_server(slow_serve, path)
    client = EngineClient(f"unix://{path}", workers=2)
    try:
        calls = [asyncio.create_task(client.request("GET", f"/c/{i}/json")) for i in range(6)]
        await asyncio.sleep(0.1)
        assert in_flight["now"] == 2
        gate.set()
        assert await asyncio.gather(*calls) == [{"ok": True}] * 6
        assert in_flight["most"] == 2 and engine.connections == 2
    finally:
        await client.close()
        server.close()


async def test_connections_kept_alive_after_a_burst_are_closed_once_unused(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import backends.docker.engine as engine_module

    monkeypatch.setattr(engine_module, "_IDLE_AGE", 0.5)
    client = await client_for(engine)
    try:
        await asyncio.gather(*(client.request("GET", f"/c/{i}") for i in range(6)))
        assert len(client._idle) == 6  # the burst's connections, kept for the next calls
        await asyncio.sleep(0.25)
        await client.request("GET", "/steady")  # one in use again: it stays, the rest age out
        await asyncio.sleep(0.35)  # 0.6 s after the burst, 0.35 s after the steady call
        assert len(client._idle) == 1
        await asyncio.sleep(0.4)
        assert client._idle == []  # a quiet client holds no connection
        assert engine.connections == 6
        await client.request("GET", "/later")  # and opens one again when needed
        assert engine.connections == 7
    finally:
        await client.close()


async def test_info_and_df_are_short_calls_of_the_http_client(engine: Engine) -> None:
    engine.reply = lambda m, t, b: answer(200, {"path": t})
    client = await client_for(engine)
    try:
        assert (await client.info())["path"] == "/v1.41/info"
        assert (await client.df())["path"] == "/v1.41/system/df"
    finally:
        await client.close()


def test_the_docker_sdk_is_loaded_only_by_a_call_that_needs_it(tmp_path: Path) -> None:
    """The SDK, and requests under it, cost about 10 MiB: a shim whose calls are all short ones
    (info and df included) does not import it; an image removal does."""
    script = """
import asyncio, json, sys
from backends.docker.engine import EngineClient
from backends.docker import DockerBackend  # the backend's own imports

async def main(path):
    client = EngineClient("unix://" + path, call_timeout=2)
    for call in (client.info, client.df):
        try:
            await call()
        except Exception as exc:
            print(type(exc).__name__, file=sys.stderr)
    before = "docker" in sys.modules or "requests" in sys.modules
    try:
        await client.image_remove("sha256:absent")
    except Exception as exc:
        print(type(exc).__name__, file=sys.stderr)
    await client.close()
    print(json.dumps([before, "docker" in sys.modules]))

asyncio.run(main(sys.argv[1]))
"""
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "absent.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [False, True]
    assert out.stderr.split() == ["UnavailableError"] * 3  # each says the engine is not there
