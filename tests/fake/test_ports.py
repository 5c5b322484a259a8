"""A fake pod's servers through the fake backend's port_forward: a container's httpd, started by its
command or by an exec, serves its files to a port-forward until the container ends; the pod's
containers share its ports; the annotation's scripted servers bind theirs too."""

from __future__ import annotations

import asyncio

from backends.contract import ContainerRecord, ContainerStatus, SandboxRecord
from backends.fake.exec import FakeExec
from backends.fake.lifecycle import FakeLifecycle
from backends.fake.servers import SERVE_ANNOTATION
from tests.fake.test_files import Conn, container, lifecycle
from tests.follow import Follower, MemoryLog

SERVE = "mkdir -p /www && echo hello > /www/index.html && httpd -f -p 8080 -h /www"
GET = b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


async def until_bound(life: FakeLifecycle, sb: SandboxRecord, port: int, bound: bool = True) -> None:
    """Lets the containers' shells run until ``port`` of the pod is (or is no longer) bound."""
    for _ in range(1000):
        if (port in life.ports.bound(sb.id)) == bound:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"port {port} of the pod: bound {not bound}, want {bound}")


async def forward(streams: FakeExec, sb: SandboxRecord, port: int, *data: bytes) -> bytes:
    conn = Conn(list(data))
    await streams.port_forward(sb, port, conn)
    return bytes(conn.got)


async def started(
    life: FakeLifecycle, follower: Follower, c: ContainerRecord, log: MemoryLog | None = None
) -> None:
    sb = life.sandboxes[c.sandbox_id]
    await life.create_container(c, sb)
    await follower.start(life, c, sb, log)


async def test_the_commands_httpd_serves_port_forward_until_its_container_stops() -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    streams = FakeExec({}, life, life.programs)
    assert await forward(streams, sb, 8080, b"ping") == b"ping"  # nothing listens: today's echo
    web = container("1" * 64, ["sh", "-c", SERVE])
    await started(life, follower, web)
    await until_bound(life, sb, 8080)
    got = await forward(streams, sb, 8080, GET)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nhello\n")
    assert b"Content-Type: text/html\r\n" in got and b"Content-Length: 6\r\n" in got
    # A file written after the server started, by an exec, is served.
    res = await streams.exec_sync(web, ["sh", "-c", "echo '{}' > /www/data.json"])
    assert res.exit_code == 0
    got = await forward(streams, sb, 8080, b"GET /data.json HTTP/1.0\r\n\r\n")
    assert b"200 OK" in got and b"application/json" in got and got.endswith(b"{}\n")
    assert web.id in life.running  # -f: the command runs on
    info = await follower.stop(life, web, 5)
    assert info.exit_code == 143  # SIGTERM, no trap
    assert life.ports.bound(sb.id) == []
    assert await forward(streams, sb, 8080, GET) == GET  # gone: the echo again


async def test_the_pods_containers_share_its_ports() -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    streams = FakeExec({}, life, life.programs)
    web = container("1" * 64, ["sh", "-c", SERVE])
    side = container("2" * 64, ["sleep", "3600"])
    for c in (web, side):
        await started(life, follower, c)
    await until_bound(life, sb, 8080)
    res = await streams.exec_sync(side, ["httpd", "-p", "8080"])
    assert (res.exit_code, res.stderr) == (1, b"httpd: bind: Address in use\n")
    # A daemon started by an exec in the other container serves its files, until that one ends.
    res = await streams.exec_sync(side, ["sh", "-c", "echo side > /tmp/page.txt; httpd -p 9090 -h /tmp"])
    assert (res.exit_code, res.stdout, res.stderr) == (0, b"", b"")
    got = await forward(streams, sb, 9090, b"GET /page.txt HTTP/1.0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"side\n")
    assert (await forward(streams, sb, 9090, b"GET /../x HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 403 ")
    await follower.stop(life, side, 5)
    assert life.ports.bound(sb.id) == [8080]
    assert await forward(streams, sb, 9090, b"ping") == b"ping"
    assert (await forward(streams, sb, 8080, GET)).endswith(b"hello\n")  # the other server lives on
    await follower.stop(life, web, 5)


async def test_a_daemonised_httpd_as_the_command_ends_the_container_and_its_server() -> None:
    """busybox's httpd without -f forks and its parent exits: a container whose command it is ends."""
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    c = container("1" * 64, ["httpd", "-p", "8080"])
    await started(life, follower, c)
    assert (await follower.exit_of(c.id, timeout=5)).exit_code == 0
    assert life.ports.bound(sb.id) == []


class OpenConn:
    """A connection whose client sends when told, and stays open until told to close."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[bytes] = asyncio.Queue()
        self.got = bytearray()
        self.wrote = asyncio.Event()

    async def read(self) -> bytes:
        return await self.sent.get()

    async def write(self, data: bytes) -> None:
        self.got += data
        self.wrote.set()


async def test_an_open_connection_ends_with_its_server() -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    streams = FakeExec({}, life, life.programs)
    web = container("1" * 64, ["sh", "-c", SERVE])
    await started(life, follower, web)
    await until_bound(life, sb, 8080)
    conn = OpenConn()
    session = asyncio.ensure_future(streams.port_forward(sb, 8080, conn))
    conn.sent.put_nowait(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive
    await asyncio.wait_for(conn.wrote.wait(), 10)
    assert bytes(conn.got).endswith(b"hello\n") and not session.done()
    await follower.stop(life, web, 5)
    await asyncio.wait_for(session, 10)  # the connection closed with the server, not by the client


async def test_addresses_a_server_binds() -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    streams = FakeExec({}, life, life.programs)
    c = container("1" * 64, ["sleep", "3600"])
    await started(life, follower, c)
    pod_ip = sb.backend_data["ip"]
    res = await streams.exec_sync(c, ["httpd", "-p", "192.0.2.1:8080"])
    assert (res.exit_code, res.stderr) == (1, b"httpd: bind: Cannot assign requested address\n")
    for spec in ("127.0.0.1:8081", f"{pod_ip}:8082"):
        assert (await streams.exec_sync(c, ["httpd", "-p", spec, "-h", "/etc"])).exit_code == 0
    assert (await forward(streams, sb, 8081, b"GET /hostname HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 200")
    # Port-forward dials localhost in the pod: a server on the pod's address alone is not reached.
    assert await forward(streams, sb, 8082, b"ping") == b"ping"
    await follower.stop(life, c, 5)


async def test_scripted_servers_hold_their_ports_and_serve_again_after_a_restart() -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    streams = FakeExec({}, life, life.programs)
    scripted = container("1" * 64, ["sleep", "3600"])
    scripted.config.annotations[SERVE_ANNOTATION] = '{"8080": {"/": "scripted\\n"}}'
    await started(life, follower, scripted)
    log = MemoryLog()
    web = container("2" * 64, ["sh", "-c", SERVE])
    await started(life, follower, web, log)
    assert (await follower.exit_of(web.id, timeout=5)).exit_code == 1
    assert log.data["stderr"] == b"httpd: bind: Address in use\n"
    assert (await forward(streams, sb, 8080, GET)).endswith(b"\r\n\r\nscripted\n")
    # A new shim process: the fake runtime's running container serves its scripted port again.
    again = FakeLifecycle({}, life.images, life.programs)
    await again.start(Follower())
    scripted.status = ContainerStatus(started_at=1)  # what the shim's record says: running
    await again.recover([sb], [scripted])
    got = await forward(FakeExec({}, again, again.programs), sb, 8080, GET)
    assert got.endswith(b"\r\n\r\nscripted\n")
    await follower.stop(life, scripted, 5)
