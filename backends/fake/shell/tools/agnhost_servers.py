"""agnhost's servers, on the pod's ports of the fake (reached by port-forward), as the shell's httpd.

- ``netexec [--http-port 8080]``: ``/`` (``NOW: <time>``), ``/echo?msg=M[&code=C]``, ``/hostname``
  and ``/hostName``, ``/clientip``, ``/serverport``, ``/header?key=K``, ``/healthz`` and ``/readyz``
  (``ok``; 503 ``shutting down`` once SIGTERM came), ``/redirect?location=L[&code=C]``,
  ``/exit?code=C`` and ``/shutdown`` (the command ends with that code, the request unanswered,
  as os.Exit); each request logged on stderr as agnhost logs it (``GET /echo?msg=hi&code=``).
  SIGTERM ends it with 0 after ``--delay-shutdown`` s. Not here: ``/dial``, ``/shell``, ``/upload``
  (404), UDP, SCTP, TLS, ``--http-override``.
- ``liveness``: port 8080; ``/healthz`` 200 ``ok`` for 10 s of the shell's clock, then 500;
  ``/started`` the time since start; ``/redirect?loc=L``.
- ``test-webserver [--port 80]``: the container's files from ``/`` (the httpd file server).
- ``serve-hostname [--port 9376] [--http=false --tcp] [--close]``: the host name over HTTP (any
  path) or, with ``--tcp``, written to each connection, which then closes.

Those without a SIGTERM handler run until the runtime kills them (as PID 1 a signal they do not
handle is ignored), as the real ones do. A port a server of the pod holds fails as Go's listen does
(``listen tcp :8080: bind: address already in use``, exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import urllib.parse
from collections.abc import Awaitable, Callable

from backends.fake.shell import http
from backends.fake.shell.caller import Connection
from backends.fake.shell.control import BrokenPipe
from backends.fake.shell.evaluation import Shell
from backends.fake.shell.tools.agnhost_flags import Flags, go_error, go_quote, wait_for_signal
from backends.fake.shell.tools.httpd import Server as FileServer


@dataclasses.dataclass
class Answer:
    status: int = 200
    body: str = ""
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    exit_code: int | None = None  # the program ends with this code instead of answering


Route = Callable[[http.Request, dict[str, str]], Awaitable[Answer]]


class Program:
    """One server subcommand's run: its log, its port, the code it ends with."""

    def __init__(self, sh: Shell) -> None:
        self.sh = sh
        self.started = sh.io.clock()
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.peers = 0

    async def log(self, message: str) -> None:
        """A line of Go's log package: ``2006/01/02 15:04:05 message`` on stderr."""
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(self.sh.io.clock()))
        with contextlib.suppress(BrokenPipe):
            await self.sh.writer(2).write(f"{stamp} {message}\n".encode())

    def exit(self, code: int) -> None:
        if not self.exited.done():
            self.exited.set_result(code)

    def listen(self, port: int, serve: Callable[[Connection], Awaitable[None]]) -> Callable[[], None] | str:
        """Binds the port; Go's error text when it cannot."""
        network = self.sh.io.network
        if network is None:
            return f"listen tcp :{port}: socket: address family not supported by protocol"
        try:
            return network.listen("", port, serve)
        except OSError as exc:
            return f"listen tcp :{port}: bind: {go_error(exc)}"

    async def http(self, conn: Connection, route: Route) -> None:
        """The requests of one connection, each answered by ``route``."""
        self.peers += 1
        requests = http.Requests(conn)
        while (request := await requests.next_or_refuse()) is not None:
            query = dict(urllib.parse.parse_qsl(request.target.partition("?")[2], keep_blank_values=True))
            answer = await route(request, query)
            if answer.exit_code is not None:
                self.exit(answer.exit_code)
                return
            data, close = http.response(
                request, answer.status, http.TEXT, answer.body.encode(), answer.headers
            )
            await conn.write(data)
            if close:
                return


# ---------------------------------------------------------------------- netexec


async def _netexec(sh: Shell, argv: list[str], flags: Flags) -> int:
    program = Program(sh)
    port = flags.integer("http-port")
    terminating = False

    async def route(request: http.Request, q: dict[str, str]) -> Answer:
        path = request.path
        if path == "/":
            await program.log("GET /")
            return Answer(
                body=f"NOW: {time.strftime('%Y-%m-%d %H:%M:%S %z %Z', time.localtime(sh.io.clock()))}"
            )
        if path == "/echo":
            msg, code = q.get("msg", ""), q.get("code", "")
            await program.log(f"GET /echo?msg={msg}&code={code}")
            if code and not code.lstrip("-").isdecimal():
                return Answer(body=f"argument 'code' must be an integer or empty, got {go_quote(code)}\n")
            return Answer(int(code) if code else 200, msg)
        if path in ("/hostname", "/hostName"):
            await program.log(f"GET {path}")
            return Answer(body=sh.io.hostname)
        if path == "/clientip":
            await program.log("GET /clientip")
            return Answer(body=f"127.0.0.1:{40000 + program.peers % 20000}")
        if path == "/serverport":
            await program.log("GET /serverport")
            return Answer(body=str(port))
        if path == "/header":
            key = q.get("key", "")
            await program.log(f"GET /header?key={key}")
            if key:
                return Answer(body=request.headers.get(key.lower(), ""))
            return Answer(body=json.dumps({k.title(): [v] for k, v in request.headers.items()}))
        if path == "/healthz":
            await program.log("GET /healthz")
            return Answer()
        if path == "/readyz":
            await program.log("GET /readyz")
            return Answer(503, "shutting down") if terminating else Answer(body="ok")
        if path == "/redirect":
            location, code = q.get("location", ""), q.get("code", "")
            await program.log(f"{request.method} /redirect?msg={location}&code={code}")
            if code and not code.isdecimal():
                return Answer(body=f"argument 'code' must be an integer or empty, got {go_quote(code)}\n")
            return Answer(int(code) if code else 302, "", [("Location", location)])
        if path == "/exit":
            code = q.get("code", "")
            await program.log(
                f"GET /exit?code={code}&timeout={q.get('timeout', '')}&wait={q.get('wait', '')}"
            )
            if code and not (code.isdecimal() and int(code) <= 127):
                return Answer(
                    body=f"argument 'code' must be an integer [0-127] or empty, got {go_quote(code)}\n"
                )
            return Answer(exit_code=int(code) if code else 0)
        if path == "/shutdown":
            await program.log("GET /shutdown")
            return Answer(exit_code=0)
        return Answer(404, "404 page not found\n")

    async def serve(conn: Connection) -> None:
        await program.http(conn, route)

    await program.log(f"Started HTTP server on port {port}")
    close = program.listen(port, serve)
    if isinstance(close, str):
        await program.log(close)
        return 1
    try:
        signal = asyncio.ensure_future(wait_for_signal(sh, frozenset({"TERM"})))
        try:
            await asyncio.wait((program.exited, signal), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not signal.done():
                signal.cancel()
        if program.exited.done():
            return program.exited.result()
        signal.result()  # another signal's end propagates
        terminating = True
        delay = flags.integer("delay-shutdown")
        if delay > 0:
            await program.log(f"Sleeping {delay} seconds before terminating...")
            await sh.io.sleep(delay)
        return 0
    finally:
        close()


NETEXEC_FLAGS: dict[str, str | int | bool] = {
    "http-port": 8080,
    "udp-port": 8081,
    "sctp-port": -1,
    "tls-cert-file": "",
    "tls-private-key-file": "",
    "http-override": "",
    "udp-listen-addresses": "",
    "delay-shutdown": 0,
}


# ---------------------------------------------------------------------- the others


async def _liveness(sh: Shell, argv: list[str], flags: Flags) -> int:
    program = Program(sh)

    async def route(request: http.Request, q: dict[str, str]) -> Answer:
        since = sh.io.clock() - program.started
        if request.path == "/started":
            return Answer(body=f"{since:.9g}s")
        if request.path == "/healthz":
            return Answer(500, f"error: {since:.9g}") if since > 10 else Answer(body="ok")
        if request.path == "/redirect":
            return Answer(302, "", [("Location", q.get("loc", ""))])
        return Answer(404, "404 page not found\n")

    async def serve(conn: Connection) -> None:
        await program.http(conn, route)

    return await _serve_until_killed(program, 8080, serve)


async def _serve_until_killed(
    program: Program, port: int, serve: Callable[[Connection], Awaitable[None]]
) -> int:
    close = program.listen(port, serve)
    if isinstance(close, str):
        await program.log(close)
        return 1
    try:
        return await program.sh.block(program.exited)
    finally:
        close()


async def _test_webserver(sh: Shell, argv: list[str], flags: Flags) -> int:
    program = Program(sh)
    files = FileServer(sh.io.fs, "/", sh.io.clock, 0, sh.writer(2))
    return await _serve_until_killed(program, flags.integer("port"), files.serve)


async def _serve_hostname(sh: Shell, argv: list[str], flags: Flags) -> int:
    program = Program(sh)
    tcp, udp, over_http = flags.boolean("tcp"), flags.boolean("udp"), flags.boolean("http")
    if over_http and (tcp or udp):
        await program.log("Can't server TCP/UDP mode and HTTP mode at the same time")
        return 1
    hostname = sh.io.hostname  # --close is taken: the client's keep-alive decides here

    async def route(request: http.Request, q: dict[str, str]) -> Answer:
        return Answer(body=hostname)

    async def serve(conn: Connection) -> None:
        if tcp:
            await program.log("TCP request from 127.0.0.1")
            await conn.write(hostname.encode())
            return
        await program.http(conn, route)

    if not (tcp or over_http):
        return await program.sh.block(program.exited)  # UDP alone: nothing reaches it here
    await program.log(f"Serving on port {flags.integer('port')}.")
    return await _serve_until_killed(program, flags.integer("port"), serve)


SUBCOMMANDS: dict[
    str, tuple[Callable[[Shell, list[str], Flags], Awaitable[int]], dict[str, str | int | bool]]
] = {
    "netexec": (_netexec, NETEXEC_FLAGS),
    "liveness": (_liveness, {}),
    "test-webserver": (_test_webserver, {"port": 80}),
    "serve-hostname": (
        _serve_hostname,
        {"tcp": False, "udp": False, "http": True, "close": False, "port": 9376},
    ),
}
