"""agnhost's servers in the fake (backends/fake/shell/tools/agnhost_servers.py): netexec, liveness,
test-webserver and serve-hostname on a network double, their answers, logs, ends and ports."""

from __future__ import annotations

import asyncio

import pytest

from backends.fake.shell import MemoryFs
from tests.fake.harness import NOW, Harness, settle
from tests.fake.test_shell_httpd import Net


def harness(fs: MemoryFs | None = None) -> tuple[Harness, Net]:
    h = Harness(fs=fs)
    h.io.init = True  # a container's command: PID 1, signals it does not handle are ignored
    net = Net()
    h.io.network = net
    return h, net


def body(answer: bytes) -> bytes:
    return answer.split(b"\r\n\r\n", 1)[1]


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def get(net: Net, port: int, target: str) -> bytes:
    return await net.get(port, f"GET {target} HTTP/1.0\r\n\r\n".encode())


@pytest.mark.parametrize(
    ("target", "code", "text"),
    [
        ("/echo?msg=hello%20there", 200, b"hello there"),
        ("/echo?msg=teapot&code=418", 418, b"teapot"),
        ("/echo?msg=x&code=abc", 200, b"argument 'code' must be an integer or empty, got \"abc\"\n"),
        ("/hostname", 200, b"pod-1"),
        ("/hostName", 200, b"pod-1"),
        ("/serverport", 200, b"8080"),
        ("/healthz", 200, b""),
        ("/readyz", 200, b"ok"),
        ("/header?key=X-Test", 200, b"yes"),
        ("/nope", 404, b"404 page not found\n"),
    ],
    ids=[
        "echo",
        "echo-code",
        "echo-bad-code",
        "hostname",
        "hostName",
        "serverport",
        "healthz",
        "readyz",
        "header",
        "404",
    ],
)
async def test_netexec_answers(target: str, code: int, text: bytes) -> None:
    h, net = harness()
    run = asyncio.ensure_future(h.run(["/agnhost", "netexec", "--http-port=8080", "--udp-port=8081"]))
    await settle()
    answer = await net.get(8080, f"GET {target} HTTP/1.0\r\nX-Test: yes\r\n\r\n".encode())
    assert (status(answer), body(answer)) == (code, text)
    assert not run.done()
    run.cancel()


async def test_netexec_logs_requests_and_sigterm_ends_it_with_0_as_pid_1() -> None:
    h, net = harness()
    run = asyncio.ensure_future(h.run(["/agnhost", "netexec", "--http-port", "8081", "--delay-shutdown=3"]))
    await settle()
    assert body(await get(net, 8081, "/")).startswith(b"NOW: 2026-12-")
    await get(net, 8081, "/echo?msg=poststart")
    log = h.stderr.decode()
    assert "Started HTTP server on port 8081\n" in log and " GET /echo?msg=poststart&code=\n" in log
    h.term.set()
    result = await run
    assert result.code == 0 and h.slept == [3]
    assert "Sleeping 3 seconds before terminating..." in result.stderr.decode()
    assert net.bound == {}


@pytest.mark.parametrize(
    ("target", "code"),
    [("/exit?code=7", 7), ("/exit", 0), ("/shutdown", 0)],
    ids=["exit-7", "exit", "shutdown"],
)
async def test_netexec_exits_when_asked(target: str, code: int) -> None:
    h, net = harness()
    run = asyncio.ensure_future(h.run(["/agnhost", "netexec"]))
    await settle()
    assert await get(net, 8080, target) == b""  # os.Exit: no answer
    assert (await run).code == code and net.bound == {}


async def test_a_busy_port_fails_as_gos_listen() -> None:
    h, _ = harness()
    await h.run(["httpd", "-p", "8080"])
    result = await h.run(["/agnhost", "netexec"])
    assert result.code == 1 and result.stderr.decode().endswith(
        "listen tcp :8080: bind: address already in use\n"
    )


async def test_liveness_is_healthy_for_10_seconds() -> None:
    h, net = harness()
    now = [NOW]
    h.io.clock = lambda: now[0]
    run = asyncio.ensure_future(h.run(["/agnhost", "liveness"]))
    await settle()
    assert (status(a := await get(net, 8080, "/healthz")), body(a)) == (200, b"ok")
    now[0] += 11
    assert status(await get(net, 8080, "/healthz")) == 500
    assert body(await get(net, 8080, "/started")) == b"11s"
    redirect = await get(net, 8080, "/redirect?loc=%2Fhealthz")
    assert status(redirect) == 302 and b"\r\nLocation: /healthz\r\n" in redirect
    h.term.set()  # it does not handle SIGTERM: as PID 1 the signal is ignored
    await settle()
    assert not run.done()
    run.cancel()


async def test_test_webserver_serves_the_containers_files() -> None:
    fs = MemoryFs({"/www/index.html": "<p>hi</p>\n", "/data.txt": "data\n"})
    h, net = harness(fs)
    run = asyncio.ensure_future(h.run(["/agnhost", "test-webserver", "--port=9000"]))
    await settle()
    assert body(await get(net, 9000, "/data.txt")) == b"data\n"
    assert body(await get(net, 9000, "/www/")) == b"<p>hi</p>\n"
    assert status(await get(net, 9000, "/missing")) == 404
    run.cancel()


async def test_serve_hostname_over_http_and_tcp() -> None:
    h, net = harness()
    run = asyncio.ensure_future(h.run(["/agnhost", "serve-hostname"]))
    await settle()
    assert body(await get(net, 9376, "/anything")) == b"pod-1"
    run.cancel()
    h2, net2 = harness()
    run2 = asyncio.ensure_future(
        h2.run(["/agnhost", "serve-hostname", "--http=false", "--tcp", "--port=9000"])
    )
    await settle()
    assert await net2.get(9000) == b"pod-1"
    run2.cancel()
    bad = await harness()[0].run(["/agnhost", "serve-hostname", "--tcp"])
    assert bad.code == 1 and b"Can't server TCP/UDP mode and HTTP mode at the same time" in bad.stderr
