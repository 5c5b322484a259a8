"""The shell's httpd (backends/fake/shell/tools/httpd.py) over a network double: its options and
errors as busybox gives them, its answers, and its port's life (foreground, daemon, SIGTERM)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable

import pytest

from backends.fake.shell import MemoryFs, Serve
from backends.fake.shell.http import Request
from tests.fake.harness import Harness, settle


class Net:
    """A network double: one server a port, a second bind is EADDRINUSE."""

    def __init__(self) -> None:
        self.bound: dict[int, tuple[str, Serve]] = {}

    def listen(self, host: str, port: int, serve: Serve) -> Callable[[], None]:
        if port in self.bound:
            raise OSError(errno.EADDRINUSE, "Address in use")
        self.bound[port] = (host, serve)
        return lambda: self.bound.pop(port, None) and None

    async def get(self, port: int, *requests: bytes) -> bytes:
        conn = Conn(list(requests))
        await self.bound[port][1](conn)
        return bytes(conn.got)


class Conn:
    def __init__(self, data: list[bytes]) -> None:
        self._in = data
        self.got = bytearray()

    async def read(self) -> bytes:
        return self._in.pop(0) if self._in else b""

    async def write(self, data: bytes) -> None:
        self.got += data


def site() -> MemoryFs:
    fs = MemoryFs(
        {
            "/www/index.html": "<p>home</p>\n",
            "/www/notes.txt": "plain\n",
            "/www/app.js": "x()\n",
            "/www/style.css": "p{}\n",
            "/www/data.json": "{}\n",
            "/www/logo.png": b"\x89PNG",
            "/www/README": "no extension\n",
            "/www/docs/index.html": "docs\n",
            "/www/empty/.keep": "",
            "/secret.txt": "not served\n",
        }
    )
    fs.mkdir("/tmp")
    return fs


def harness() -> tuple[Harness, Net]:
    h = Harness(fs=site())
    net = Net()
    h.io.network = net
    return h, net


@pytest.mark.parametrize(
    ("argv", "stderr"),
    [
        (["httpd", "-z"], "httpd: invalid option -- 'z'\nUsage: httpd [-ifv[v]]"),
        (["httpd", "-p"], "httpd: option requires an argument -- 'p'\nUsage: httpd"),
        (["httpd", "-p", "http"], "httpd: bad address 'http'\n"),
        (["httpd", "-p", "127.0.0.1:99999"], "httpd: bad port '99999'\n"),
        (["httpd", "-p", "1.2.3.4.5:80"], "httpd: bad address '1.2.3.4.5:80'\n"),
        (["httpd", "-h", "/nope"], "httpd: can't change directory to '/nope': No such file or directory\n"),
        (["httpd", "-h", "/secret.txt"], "httpd: can't change directory to '/secret.txt': Not a directory\n"),
        (["httpd", "-c", "/etc/httpd.conf"], "httpd: -c (a config file) is not supported"),
        (["httpd", "-i"], "httpd: -i (inetd mode) is not supported"),
    ],
    ids=["option", "no-port", "name", "port-range", "address", "no-home", "home-file", "config", "inetd"],
)
async def test_bad_options_print_an_error_and_exit_1(argv: list[str], stderr: str) -> None:
    h, net = harness()
    result = await h.run(argv)
    assert (result.code, result.stdout) == (1, b"")
    assert result.stderr.decode().startswith(stderr)
    assert net.bound == {}


async def test_without_a_network_it_cannot_listen() -> None:
    result = await Harness(fs=site()).run(["httpd", "-h", "/www"])
    assert result.code == 1 and b"httpd: socket:" in result.stderr


@pytest.mark.parametrize(
    ("spec", "host", "port"),
    [("8080", "", 8080), ("127.0.0.1:81", "127.0.0.1", 81), ("[::1]:82", "::1", 82), ("0", "0.0.0.0", 80)],
    ids=["port", "ipv4", "ipv6", "zero-is-an-address"],
)
async def test_the_port_is_busyboxs_ip_and_port(spec: str, host: str, port: int) -> None:
    h, net = harness()
    assert (await h.run(["httpd", "-p", spec])).code == 0
    assert list(net.bound) == [port] and net.bound[port][0] == host


async def test_d_and_e_decode_and_encode_without_serving() -> None:
    h, net = harness()
    result = await h.run(["sh", "-c", "httpd -d 'a%20b%2Fc+d'; echo; httpd -e '<a&b>'"])
    assert (result.code, result.stdout) == (0, b"a b/c d\n&#60;a&#38;b&#62;")
    assert net.bound == {}


async def test_a_daemon_returns_at_once_and_serves_on() -> None:
    h, net = harness()
    result = await h.run(["sh", "-c", "httpd -p 8080 -h /www && echo started"])
    assert (result.code, result.stdout, result.stderr) == (0, b"started\n", b"")
    got = await net.get(8080, b"GET / HTTP/1.0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\n<p>home</p>\n")


async def test_a_second_server_on_the_port_fails_like_bind() -> None:
    h, net = harness()
    result = await h.run(["sh", "-c", "httpd -p 8080 -h /www; httpd -p 8080 -h /; echo $?"])
    assert (result.stdout, result.stderr) == (b"1\n", b"httpd: bind: Address in use\n")
    assert (await net.get(8080, b"GET / HTTP/1.0\r\n\r\n")).endswith(b"<p>home</p>\n")  # the first


async def test_in_the_foreground_it_serves_until_sigterm_then_closes_its_port() -> None:
    h, net = harness()
    run = asyncio.ensure_future(h.run(["httpd", "-f", "-v", "-p", "8080", "-h", "/www"]))
    await settle()
    assert not run.done() and 8080 in net.bound
    got = await net.get(8080, b"GET /notes.txt HTTP/1.0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"plain\n")
    assert h.stderr.decode().endswith(": response:200\n")  # -v logs on stderr, busybox's way
    h.term.set()
    assert (await run).code == 143
    assert net.bound == {}


async def test_files_are_read_at_each_request() -> None:
    h, net = harness()
    await h.run(["httpd", "-p", "8080", "-h", "/www"])
    assert b" 404 " in (await net.get(8080, b"GET /later.txt HTTP/1.0\r\n\r\n")).split(b"\r\n")[0]
    await h.run(["sh", "-c", "echo written-later > /www/later.txt"])
    got = await net.get(8080, b"GET /later.txt HTTP/1.0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nwritten-later\n")


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def header(answer: bytes, name: str) -> str | None:
    head = answer.split(b"\r\n\r\n", 1)[0].decode()
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(": ")
        if key.lower() == name.lower():
            return value
    return None


@pytest.mark.parametrize(
    ("target", "status", "content_type", "body"),
    [
        ("/", 200, "text/html", b"<p>home</p>\n"),
        ("/index.html", 200, "text/html", b"<p>home</p>\n"),
        ("/notes.txt?x=1", 200, "text/plain", b"plain\n"),
        ("/app.js", 200, "application/javascript", b"x()\n"),
        ("/style.css", 200, "text/css", b"p{}\n"),
        ("/data.json", 200, "application/json", b"{}\n"),
        ("/logo.png", 200, "image/png", b"\x89PNG"),
        ("/README", 200, "application/octet-stream", b"no extension\n"),
        ("/docs/", 200, "text/html", b"docs\n"),
        ("/d%6Fcs/index.html", 200, "text/html", b"docs\n"),
        ("/docs/../notes.txt", 200, "text/plain", b"plain\n"),
        ("/docs", 302, "text/html", None),
        ("/empty/", 404, "text/html", None),
        ("/missing.html", 404, "text/html", None),
        ("/notes.txt/x", 404, "text/html", None),
        ("/../secret.txt", 403, "text/html", None),
        ("/docs/../../secret.txt", 403, "text/html", None),
        ("/%2e%2e/secret.txt", 403, "text/html", None),
        ("noslash", 400, "text/html", None),
    ],
    ids=lambda v: str(v)[:24],
)
async def test_answers(target: str, status: int, content_type: str, body: bytes | None) -> None:
    h, net = harness()
    await h.run(["httpd", "-p", "8080", "-h", "/www"])
    got = await net.get(8080, f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert status_of(got) == status
    assert header(got, "Content-Type") == content_type
    content = got.split(b"\r\n\r\n", 1)[1]
    assert header(got, "Content-Length") == str(len(content))
    assert header(got, "Connection") == "close"
    if body is not None:
        assert content == body
    if status == 302:
        assert header(got, "Location") == "/docs/"


async def test_head_keep_alive_and_methods() -> None:
    h, net = harness()
    await h.run(["httpd", "-p", "8080", "-h", "/www"])
    # Three requests on one connection, the second in two pieces; the last asks to close.
    got = await net.get(
        8080,
        b"HEAD /notes.txt HTTP/1.1\r\nHost: x\r\n\r\nGET /notes.txt HT",
        b"TP/1.1\r\nHost: x\r\n\r\n",
        b"DELETE /notes.txt HTTP/1.1\r\nConnection: close\r\n\r\nGET / HTTP/1.1\r\n\r\n",
    )
    answers = got.split(b"HTTP/1.1 ")[1:]
    assert [int(a[:3]) for a in answers] == [200, 200, 501]  # nothing after the close
    head = b"HTTP/1.1 " + answers[0]
    assert head.endswith(b"\r\n\r\n") and header(head, "Content-Length") == "6"  # no body
    assert answers[1].endswith(b"\r\n\r\nplain\n") and header(b"x " + answers[1], "Connection") is None
    # HTTP/1.0 closes unless it asks for keep-alive.
    got = await net.get(8080, b"GET /notes.txt HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 2)
    assert got.count(b"HTTP/1.1 200 OK") == 2 and got.count(b"Connection: keep-alive") == 2


@pytest.mark.parametrize(
    "request_bytes",
    [b"NONSENSE\r\n\r\n", b"GET / HTTP/2.0\r\n\r\n", b"GET / HTTP/1.1\r\nno colon\r\n\r\n"],
    ids=["line", "version", "header"],
)
async def test_a_bad_request_gets_400_and_the_connection_closes(request_bytes: bytes) -> None:
    h, net = harness()
    await h.run(["httpd", "-p", "8080", "-h", "/www"])
    got = await net.get(8080, request_bytes + b"GET / HTTP/1.1\r\n\r\n")
    assert status_of(got) == 400 and got.count(b"HTTP/1.1") == 1
    assert header(got, "Connection") == "close"


def test_keep_alive_follows_rfc_9112() -> None:
    def req(version: str, connection: str | None) -> Request:
        return Request("GET", "/", version, {"connection": connection} if connection else {})

    assert req("HTTP/1.1", None).keep_alive and not req("HTTP/1.1", "Close").keep_alive
    assert not req("HTTP/1.0", None).keep_alive and req("HTTP/1.0", "Keep-Alive").keep_alive
