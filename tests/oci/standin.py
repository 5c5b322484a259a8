"""A stand-in registry for the tests of backends/oci: the distribution API's GETs from memory on a
threaded http.server, with optional TLS (its own CA, made by ``openssl``), client-certificate
verification, Basic or Bearer auth (a token endpoint on the same server), and faults:

    "500"               every API request answers HTTP 500 (with a registry error body)
    "redirect_loop"     every API request redirects to itself
    "stall"             a blob's headers and half its bytes, then nothing (until stop)
    "wrong_digest"      blobs with a flipped last byte
    "garbage_manifest"  manifests that are not JSON
    "huge_manifest"     a manifest whose Content-Length is 5 MiB

It can also pass requests on to another registry (``upstream``: the testenv's at 127.0.0.1:5000),
as a pull-through mirror does. Every request is recorded in ``seen``.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import http.server
import io
import json
import os
import socket
import ssl
import subprocess
import tarfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"


# --------------------------------------------------------------------------- certificates


@dataclasses.dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for 127.0.0.1 and localhost signed by it, and a client CA with
    one client certificate."""

    ca: str
    server_cert: str
    server_key: str
    client_ca: str
    client_cert: str
    client_key: str
    other_ca: str  # a CA that signed nothing here (a wrong trust anchor)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(directory: str, name: str) -> tuple[str, str]:
    key, cert = os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.crt")
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key)
    _openssl("req", "-x509", "-new", "-key", key, "-subj", f"/CN={name}", "-days", "2", "-out", cert)
    return cert, key


def _leaf(directory: str, name: str, ca: tuple[str, str], ext: str) -> tuple[str, str]:
    key, csr = os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.csr")
    cert, extfile = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.ext")
    with open(extfile, "w") as fh:
        fh.write(ext)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key)
    _openssl("req", "-new", "-key", key, "-subj", f"/CN={name}", "-out", csr)
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-days", "2", "-extfile", extfile, "-out", cert,
    )  # fmt: skip
    return cert, key


def make_pki(directory: str) -> Pki:
    os.makedirs(directory, exist_ok=True)
    ca = _ca(directory, "registry-ca")
    server = _leaf(
        directory,
        "server",
        ca,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    client_ca = _ca(directory, "client-ca")
    client = _leaf(directory, "client", client_ca, "extendedKeyUsage=clientAuth\n")
    other = _ca(directory, "other-ca")
    return Pki(ca[0], server[0], server[1], client_ca[0], client[0], client[1], other[0])


# --------------------------------------------------------------------------- images


@dataclasses.dataclass
class Image:
    manifest: bytes
    manifest_digest: str
    config_digest: str
    layers: list[str]  # digests, bottom first
    blobs: dict[str, bytes]


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_image(files: dict[str, bytes], layers: int = 1) -> Image:
    """An image of ``layers`` gzip layers, the files spread over them."""
    blobs: dict[str, bytes] = {}
    diff_ids, layer_descs = [], []
    names = sorted(files)
    for i in range(layers):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name in names[i::layers]:
                info = tarfile.TarInfo(name)
                info.size = len(files[name])
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(files[name]))
        raw = buf.getvalue()
        gz = gzip.compress(raw, mtime=0)
        diff_ids.append(digest_of(raw))
        blobs[digest_of(gz)] = gz
        layer_descs.append(
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": digest_of(gz),
                "size": len(gz),
            }
        )
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": ["sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    blobs[digest_of(config)] = config
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": digest_of(config),
                "size": len(config),
            },
            "layers": layer_descs,
        }
    ).encode()
    return Image(manifest, digest_of(manifest), digest_of(config), [d["digest"] for d in layer_descs], blobs)


# --------------------------------------------------------------------------- the server


@dataclasses.dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, list[str]]  # lower-case name -> values

    def header(self, name: str) -> str:
        values = self.headers.get(name.lower(), [])
        return values[0] if values else ""


class Standin:
    """One stand-in registry; ``with Standin(...) as reg`` serves until the block ends."""

    def __init__(
        self,
        pki: Pki | None = None,
        client_certs: bool = False,
        auth: str = "",  # "", "basic" or "bearer"
        user: str = "user",
        password: str = "secret-password",
        refresh_token: str = "secret-refresh-token",
        registry_token: str = "secret-registry-token",
        root: str = "/v2",
        upstream: str = "",
    ) -> None:
        self.pki = pki
        self.client_certs = client_certs
        self.auth = auth
        self.user, self.password = user, password
        self.refresh_token, self.registry_token = refresh_token, registry_token
        self.root = root.rstrip("/")
        self.upstream = upstream
        self.fault = ""
        self.expires_in = 300
        self.manifests: dict[tuple[str, str], tuple[str, bytes]] = {}
        self.blobs: dict[str, bytes] = {}
        self.seen: list[Seen] = []
        self.token_requests: list[Seen] = []
        self.issued: list[str] = []  # tokens the registry accepts (clear it to revoke them)
        self._tokens = 0
        self.tls_failures = 0
        self.release = threading.Event()  # ends a stall
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- content
    def put(self, repo: str, tag: str, image: Image) -> None:
        self.manifests[(repo, tag)] = (MEDIA_MANIFEST, image.manifest)
        self.manifests[(repo, image.manifest_digest)] = (MEDIA_MANIFEST, image.manifest)
        self.blobs.update(image.blobs)

    @property
    def scheme(self) -> str:
        return "https" if self.pki else "http"

    @property
    def netloc(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    def api_requests(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.path.startswith(self.root + "/") and s.path != self.root + "/"]

    # ---- life
    def __enter__(self) -> Standin:
        standin = self
        context = self._server_context()

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def finish_request(self, request: Any, client_address: Any) -> None:
                if context is None:
                    super().finish_request(request, client_address)
                    return
                try:
                    # The handshake in the connection's thread (wrapping takes the socket over).
                    tls = context.wrap_socket(request, server_side=True)
                except (ssl.SSLError, OSError):
                    with standin._lock:
                        standin.tls_failures += 1
                    return
                try:
                    super().finish_request(tls, client_address)
                finally:
                    tls.close()

        self._server = Server(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _server_context(self) -> ssl.SSLContext | None:
        if self.pki is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.pki.server_cert, self.pki.server_key)
        if self.client_certs:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.pki.client_ca)
        return ctx

    # ---- auth
    def _basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()

    def authorized(self, header: str) -> bool:
        if self.auth == "basic":
            return header == self._basic()
        if self.auth == "bearer":
            with self._lock:
                return header in (f"Bearer {t}" for t in (*self.issued, self.registry_token))
        return True

    def challenge(self, scope: str) -> str:
        if self.auth == "basic":
            return 'Basic realm="standin"'
        return f'Bearer realm="{self.url}/token",service="standin",scope="{scope}"'

    def token(
        self, method: str, query: dict[str, str], header: str, form: dict[str, str]
    ) -> tuple[int, bytes]:
        """The token endpoint: GET with the user's Basic credentials (or none: anonymous only when
        the registry has no user), POST of a refresh token."""
        if method == "POST":
            ok = form.get("grant_type") == "refresh_token" and form.get("refresh_token") == self.refresh_token
            field = "access_token"
        else:
            ok = header == self._basic() or (not self.user and not header)
            field = "token"
        if not ok:
            return 401, b'{"errors": [{"code": "UNAUTHORIZED"}]}'
        with self._lock:
            self._tokens += 1
            token = f"tok-{self._tokens}"
            self.issued.append(token)
        return 200, json.dumps({field: token, "expires_in": self.expires_in}).encode()


def _handler(reg: Standin) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def _record(self) -> Seen:
            parts = urllib.parse.urlsplit(self.path)
            headers: dict[str, list[str]] = {}
            for name, value in self.headers.items():
                headers.setdefault(name.lower(), []).append(value)
            seen = Seen(self.command, parts.path, dict(urllib.parse.parse_qsl(parts.query)), headers)
            return seen

        def do_POST(self) -> None:
            seen = self._record()
            length = int(self.headers.get("Content-Length") or 0)
            form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
            if seen.path == "/token":
                with reg._lock:
                    reg.token_requests.append(seen)
                code, body = reg.token("POST", seen.query, seen.header("authorization"), form)
                self._send(code, body, {"Content-Type": "application/json"})
                return
            self._send(405, b"")

        def do_GET(self) -> None:
            seen = self._record()
            if seen.path == "/token":
                with reg._lock:
                    reg.token_requests.append(seen)
                code, body = reg.token("GET", seen.query, seen.header("authorization"), {})
                self._send(code, body, {"Content-Type": "application/json"})
                return
            with reg._lock:
                reg.seen.append(seen)
            if not seen.path.startswith(reg.root + "/"):
                self._send(404, b"")
                return
            rest = seen.path[len(reg.root) + 1 :]
            repo, _, tail = rest.rpartition("/")
            repo, _, kind = repo.rpartition("/")
            if not rest:  # the API's base
                self._send(200, b"{}")
                return
            if not reg.authorized(seen.header("authorization")):
                challenge = reg.challenge(f"repository:{repo}:pull")
                self._send(401, b'{"errors": [{"code": "UNAUTHORIZED"}]}', {"WWW-Authenticate": challenge})
                return
            if reg.fault == "500":
                body = b'{"errors": [{"code": "UNKNOWN", "message": "the stand-in fails on purpose"}]}'
                self._send(500, body, {"Content-Type": "application/json"})
                return
            if reg.fault == "redirect_loop":
                self._send(307, b"", {"Location": self.path})
                return
            if reg.upstream:
                self._relay(reg.upstream + self.path.split("?")[0])
                return
            if kind == "manifests" and (repo, tail) in reg.manifests:
                media, body = reg.manifests[(repo, tail)]
                if reg.fault == "garbage_manifest":
                    body = b"<html>not a manifest</html>"
                if reg.fault == "huge_manifest":
                    self._send(200, b"", {"Content-Type": media, "Content-Length": str(5 << 20)})
                    return
                self._send(200, body, {"Content-Type": media, "Docker-Content-Digest": digest_of(body)})
            elif kind == "blobs" and tail in reg.blobs:
                self._blob(reg.blobs[tail])
            else:
                self._send(404, b'{"errors": [{"code": "NOT_FOUND"}]}')

        def _blob(self, body: bytes) -> None:
            if reg.fault == "wrong_digest":
                body = body[:-1] + bytes([body[-1] ^ 1])
            if reg.fault != "stall":
                self._send(200, body, {"Content-Type": "application/octet-stream"})
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            reg.release.wait(60)
            self.close_connection = True

        def _relay(self, url: str) -> None:
            """Pass the request on to the upstream registry (plain HTTP), as a pull-through mirror."""
            req = urllib.request.Request(url, headers={"Accept": self.headers.get("Accept", "*/*")})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    body, code, headers = resp.read(), resp.status, resp.headers
            except urllib.error.HTTPError as exc:
                body, code, headers = exc.read(), exc.code, exc.headers
                exc.close()
            keep = {k: headers[k] for k in ("Content-Type", "Docker-Content-Digest") if headers.get(k)}
            self._send(code, body, keep)

    return Handler


def free_port() -> int:
    """A loopback port nothing listens on (for an unreachable host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
