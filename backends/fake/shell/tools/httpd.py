"""httpd: busybox's static file server, on the port of the caller's network (``io.network``).

``httpd [-ifv[v]] [-c CONFFILE] [-p [IP:]PORT] [-u USER[:GRP]] [-r REALM] [-h HOME]`` binds its
port (default 80) and serves the files under HOME (default the working directory) through
``io.fs``, each read when it is asked for: a file written after the server started is served.
With ``-f`` the command runs until it is killed, as busybox's foreground server; without, it
"daemonises": the command returns 0 at once and the server lives on until the caller closes the
network (the fake closes it when the container ends). ``-d STRING`` and ``-e STRING`` decode a
URL and encode HTML, and exit. Errors are busybox's: a bad option prints the usage; a bad port
or address, a missing HOME or a port already bound ("bind: Address in use") exit 1.

Answers: GET and HEAD (others 501), HTTP/1.0 and 1.1; a directory's ``index.html`` (a
directory named without its slash is redirected to it, 302, as busybox does); 404 for a missing
file, 403 for a path that climbs out of HOME or a file that cannot be read; Content-Type by
extension; busybox's error pages. Two differences from busybox 1.35 (checked against Debian's
build): it keeps connections alive (busybox closes after each answer) and answers a path out of
HOME with 403 (busybox says 400); a client of either works with both.

Not here: the config file (``-c``), CGI, authentication (``-m``, the realm is taken and unused),
inetd mode (``-i``), ranges, directory listings. ``-u`` is taken and changes nothing (the fake
has no users to switch to).
"""

from __future__ import annotations

import contextlib
import email.utils
import posixpath
import socket
import urllib.parse
from collections.abc import Callable

from backends.fake.shell import http
from backends.fake.shell.caller import Connection
from backends.fake.shell.control import BrokenPipe, ToolError, reason
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.fs import Fs
from backends.fake.shell.streams import Writer

USAGE = (
    "Usage: httpd [-ifv[v]] [-c CONFFILE] [-p [IP:]PORT] [-u USER[:GRP]] [-r REALM] [-h HOME]\n"
    "or httpd -d/-e/-m STRING\n"
)
_FLAGS, _VALUED = "ifv", "cdhermup"
_UNSUPPORTED = {"c": "a config file", "i": "inetd mode", "m": "MD5 crypt"}

CONTENT_TYPES = {
    "html": "text/html",
    "htm": "text/html",
    "txt": "text/plain",
    "css": "text/css",
    "js": "application/javascript",
    "mjs": "application/javascript",
    "json": "application/json",
    "xml": "application/xml",
    "png": "image/png",
    "jpg": "image/jpeg",
    "jpeg": "image/jpeg",
    "gif": "image/gif",
    "svg": "image/svg+xml",
    "ico": "image/x-icon",
    "webp": "image/webp",
    "wasm": "application/wasm",
    "pdf": "application/pdf",
    "mp3": "audio/mpeg",
    "wav": "audio/wav",
}
DEFAULT_TYPE = "application/octet-stream"


def _options(argv: list[str]) -> tuple[dict[str, str], int]:
    """busybox's getopt32 for httpd: the valued options (the last of a repeat wins) and -v's count."""
    opts: dict[str, str] = {}
    verbose = 0
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] != "-":
        arg = args.pop(0)
        if arg == "--":
            break
        for j, c in enumerate(arg[1:], 1):
            if c in _VALUED:
                value = arg[j + 1 :]
                if not value:
                    if not args:
                        raise ToolError(f"option requires an argument -- '{c}'")
                    value = args.pop(0)
                opts[c] = value
                break
            if c not in _FLAGS:
                raise ToolError(f"invalid option -- '{c}'")
            verbose += c == "v"
            opts[c] = ""
    return opts, verbose


def _address(spec: str) -> tuple[str, int]:
    """``-p`` as busybox reads it: a port alone binds every address; anything else is an address
    with an optional ``:PORT`` (IPv6 in brackets), numeric only, port 80 by default."""
    if spec.isdecimal() and 0 < int(spec) <= 0xFFFF:
        return "", int(spec)
    host, port = spec, 80
    colon = spec.rfind(":")
    if colon >= 0 and (spec.startswith("[") or spec.count(":") == 1):
        host, tail = spec[:colon], spec[colon + 1 :]
        if not tail.isdecimal() or int(tail) > 0xFFFF:
            raise ToolError(f"bad port '{tail}'")
        port = int(tail)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        # inet_aton, as busybox's: "0" and "127.1" are addresses too.
        packed = socket.inet_pton(family, host) if family == socket.AF_INET6 else socket.inet_aton(host)
    except OSError:
        raise ToolError(f"bad address '{spec}'") from None
    return socket.inet_ntop(family, packed), port


async def _t_httpd(sh: Shell, argv: list[str]) -> int:
    try:
        opts, verbose = _options(argv)
    except ToolError as exc:
        await sh.err(f"httpd: {exc}")
        await sh.writer(2).write(USAGE.encode())
        return 1
    if "d" in opts:
        await sh.out(urllib.parse.unquote_to_bytes(opts["d"].replace("+", " ")))
        return 0
    if "e" in opts:
        await sh.out("".join(c if c.isalnum() else f"&#{ord(c)};" for c in opts["e"]))
        return 0
    for flag, what in _UNSUPPORTED.items():
        if flag in opts:
            raise ToolError(f"-{flag} ({what}) is not supported by the fake runtime's httpd")
    home = sh.abspath(opts.get("h", "."))
    if not sh.io.fs.is_dir(home):
        why = "Not a directory" if sh.io.fs.exists(home) else "No such file or directory"
        raise ToolError(f"can't change directory to '{opts.get('h', '.')}': {why}")
    host, port = _address(opts.get("p", "80"))
    if sh.io.network is None:
        raise ToolError("socket: Address family not supported by protocol")
    foreground = "f" in opts
    # A daemon's stdio is /dev/null, as busybox's after it forks; in the foreground -v logs to stderr.
    server = Server(sh.io.fs, home, sh.io.clock, verbose if foreground else 0, sh.writer(2))
    try:
        close = sh.io.network.listen(host, port, server.serve)
    except OSError as exc:
        raise ToolError(f"bind: {reason(exc)}") from None
    if not foreground:
        return 0
    try:
        await sh.sleep_forever()
    finally:
        close()
    return 0


class Server:
    """One httpd's answers: files under ``home`` of ``fs``, read at each request."""

    def __init__(self, fs: Fs, home: str, clock: Callable[[], float], verbose: int, log: Writer) -> None:
        self.fs = fs
        self.home = home
        self.clock = clock
        self.verbose = verbose
        self._log = log
        self._peers = 0

    async def serve(self, conn: Connection) -> None:
        """Answers the requests of one connection until it closes or a request asks to."""
        self._peers += 1
        peer = f"127.0.0.1:{40000 + self._peers % 20000}"  # a forwarded connection comes from localhost
        if self.verbose > 2:
            await self.log(peer, "connected")
        requests = http.Requests(conn)
        while True:
            try:
                request = await requests.next()
            except http.BadRequest as exc:
                await self._answer(conn, peer, None, exc.status, str(exc), "")
                return
            if request is None:
                return
            if self.verbose > 1:
                await self.log(peer, f"url:{request.target}")
            if await self._answer(conn, peer, request, *self.find(request)):
                return

    def find(self, request: http.Request) -> tuple[int, str, bytes | str]:
        """(status, content type or detail, file contents or redirect target) for ``request``."""
        if request.method not in ("GET", "HEAD"):
            return 501, "The requested method is not recognized", ""
        path = urllib.parse.unquote(request.path)
        if not path.startswith("/") or "\0" in path:
            return 400, "Bad request path", ""
        depth = 0
        for part in path.split("/"):
            depth += -1 if part == ".." else part not in ("", ".")
            if depth < 0:
                return 403, "Path escapes the server's home", ""
        target = posixpath.normpath(self.home + "/" + path.lstrip("/"))
        try:
            if self.fs.is_dir(target):
                if not path.endswith("/"):
                    return 302, "", request.path + "/"
                target = posixpath.join(target, "index.html")
            return 200, _content_type(target), self.fs.read(target)
        except PermissionError:
            return 403, "Permission denied", ""
        except OSError:
            return 404, "The requested URL was not found", ""

    async def _answer(
        self,
        conn: Connection,
        peer: str,
        request: http.Request | None,
        status: int,
        kind: str,
        content: bytes | str,
    ) -> bool:
        """Writes one answer; whether the connection closes after it."""
        extra = [("Date", _http_date(self.clock()))]
        if status == 200:
            assert isinstance(content, bytes)
            body, content_type = content, kind
        else:
            if status == 302:
                assert isinstance(content, str)
                extra.append(("Location", content))
            title = f"{status} {http.REASONS.get(status, '')}"
            page = f"<HTML><HEAD><TITLE>{title}</TITLE></HEAD>\n<BODY><H1>{title}</H1>\n{kind}\n"
            body, content_type = (page + "</BODY></HTML>\n").encode(), "text/html"
        data, close = http.response(request, status, content_type, body, extra)
        if self.verbose:
            await self.log(peer, f"response:{status}")
        await conn.write(data)
        return close

    async def log(self, peer: str, message: str) -> None:
        with contextlib.suppress(BrokenPipe):
            await self._log.write(f"{peer}: {message}\n".encode())


def _content_type(path: str) -> str:
    name = posixpath.basename(path)
    return CONTENT_TYPES.get(name.rpartition(".")[2].lower(), DEFAULT_TYPE) if "." in name else DEFAULT_TYPE


def _http_date(when: float) -> str:
    return email.utils.formatdate(when, usegmt=True)


COMMANDS: dict[str, Builtin] = {"httpd": _t_httpd}
