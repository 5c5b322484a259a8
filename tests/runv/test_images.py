"""The runv OCI image store: layer unpacking, pulls from an in-test registry."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import os
import stat
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.oci.settings import PullSettings
from backends.runv.images.store import Credentials, ImageStore, unpack_layer
from shim.cri import errors


def _tar(entries: list[tuple[str, bytes | None, int]]) -> bytes:
    """Build a tar: (name, content or None for a directory, mode)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def test_unpack_whiteouts_and_safety(tmp_path: Path) -> None:
    raw = _tar(
        [
            ("etc", None, 0o755),
            ("etc/hostname", b"img\n", 0o644),
            ("bin/", None, 0o755),
            ("bin/su", b"#!", 0o4755),  # setuid bits survive
            ("etc/.wh.passwd", b"", 0o644),  # delete a lower file
            ("var/.wh..wh..opq", b"", 0o644),  # hide the lower directory's content
            ("../escape", b"x", 0o644),
        ]
    )
    blob = tmp_path / "layer.tar.gz"
    blob.write_bytes(gzip.compress(raw))
    dest = tmp_path / "fs"
    diff_id = unpack_layer(str(blob), str(dest))
    assert diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()  # diff IDs hash the uncompressed tar
    assert (dest / "etc/hostname").read_bytes() == b"img\n"
    assert stat.S_IMODE(os.stat(dest / "bin/su").st_mode) == 0o4755
    wh = os.lstat(dest / "etc/passwd")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0  # overlayfs whiteout
    assert os.getxattr(dest / "var", "trusted.overlay.opaque") == b"y"
    assert not (tmp_path / "escape").exists()


def test_unpack_rejects_symlink_escape(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        link = tarfile.TarInfo("evil")
        link.type = tarfile.SYMTYPE
        link.linkname = str(tmp_path / "outside")
        tar.addfile(link)
        f = tarfile.TarInfo("evil/pwned")
        f.size = 1
        tar.addfile(f, io.BytesIO(b"x"))
    (tmp_path / "outside").mkdir()
    blob = tmp_path / "l.tar"
    blob.write_bytes(buf.getvalue())
    with pytest.raises(Exception, match="escapes"):
        unpack_layer(str(blob), str(tmp_path / "fs"))
    assert not (tmp_path / "outside/pwned").exists()


# --------------------------------------------------------------------------- registry


class FakeRegistry:
    """Serves one image (a manifest list -> amd64 manifest) behind bearer auth."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, tuple[str, bytes]] = {}
        self.token_requests: list[str] = []
        self.tamper = False
        layer_tar = _tar([("hello.txt", b"hello from the registry\n", 0o644), ("bin", None, 0o755)])
        layer = gzip.compress(layer_tar)
        diff_id = "sha256:" + hashlib.sha256(layer_tar).hexdigest()
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Cmd": ["sh"], "User": "1000"},
                "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            }
        ).encode()
        self.config_digest = self._blob(config)
        layer_digest = self._blob(layer)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": self.config_digest,
                    "size": len(config),
                },
                "layers": [
                    {
                        "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": layer_digest,
                        "size": len(layer),
                    }
                ],
            }
        ).encode()
        self.manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        self.manifests[self.manifest_digest] = ("application/vnd.oci.image.manifest.v1+json", manifest)
        index = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "manifests": [
                    {"digest": "sha256:" + "0" * 64, "platform": {"os": "linux", "architecture": "arm64"}},
                    {"digest": self.manifest_digest, "platform": {"os": "linux", "architecture": "amd64"}},
                ],
            }
        ).encode()
        self.manifests["v1"] = ("application/vnd.oci.image.index.v1+json", index)

    def _blob(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest


@pytest.fixture
def registry() -> Iterator[tuple[FakeRegistry, str]]:
    reg = FakeRegistry()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            host = f"127.0.0.1:{self.server.server_port}"  # type: ignore[attr-defined]
            if self.path.startswith("/token"):
                reg.token_requests.append(self.path)
                ok = self.headers.get("Authorization") == "Basic dXNlcjpwYXNz"  # user:pass
                self._send(200 if ok else 401, json.dumps({"token": "T0K"}).encode())
                return
            if self.headers.get("Authorization") != "Bearer T0K":
                challenge = (
                    f'Bearer realm="http://{host}/token",service="fake",scope="repository:team/app:pull"'
                )
                self._send(401, b"{}", {"WWW-Authenticate": challenge})
                return
            parts = self.path.split("/")  # /v2/team/app/{manifests,blobs}/ref
            kind, ref = parts[-2], parts[-1]
            if kind == "manifests" and ref in reg.manifests:
                media, body = reg.manifests[ref]
                self._send(200, body, {"Content-Type": media})
            elif kind == "blobs" and ref in reg.blobs:
                body = reg.blobs[ref]
                if reg.tamper and ref != reg.config_digest:
                    body = body[:-1] + bytes([body[-1] ^ 1])
                self._send(200, body)
            else:
                self._send(404, b"{}")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield reg, f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_pull_index_with_bearer_auth(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    reg, host = registry
    store = ImageStore(str(tmp_path / "images"), PullSettings(insecure=frozenset({host})))
    image_id = await store.pull(f"{host}/team/app:v1", Credentials(username="user", password="pass"))
    assert image_id == reg.config_digest  # the image ID is the config digest
    assert reg.token_requests and "scope=repository%3Ateam%2Fapp%3Apull" in reg.token_requests[0]
    img = store.resolve(f"{host}/team/app:v1")
    assert img is not None and img.id == image_id
    assert img.repo_digests == [f"{host}/team/app@{reg.manifest_digest}"]
    assert store.resolve(image_id[7:19]) is img  # short ID prefix
    lower = store.lowers(img)
    assert Path(lower[0], "hello.txt").read_bytes() == b"hello from the registry\n"

    reopened = ImageStore(
        str(tmp_path / "images"), PullSettings(insecure=frozenset({host}))
    )  # the index persists
    assert [i.id for i in reopened.all()] == [image_id]
    reopened.remove(image_id)
    assert reopened.resolve(image_id) is None and not Path(lower[0]).exists()


async def test_pull_rejects_bad_credentials(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    _, host = registry
    store = ImageStore(str(tmp_path / "images"), PullSettings(insecure=frozenset({host})))
    with pytest.raises(errors.CriError, match="token request failed"):
        await store.pull(f"{host}/team/app:v1", Credentials(username="user", password="wrong"))


async def test_pull_verifies_digests(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    reg, host = registry
    reg.tamper = True
    store = ImageStore(str(tmp_path / "images"), PullSettings(insecure=frozenset({host})))
    with pytest.raises(errors.CriError, match="digest mismatch"):
        await store.pull(f"{host}/team/app:v1", Credentials(username="user", password="pass"))
    assert store.all() == []


async def test_pull_missing_tag_is_not_found(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    _, host = registry
    store = ImageStore(str(tmp_path / "images"), PullSettings(insecure=frozenset({host})))
    with pytest.raises(errors.NotFoundError):
        await store.pull(f"{host}/team/app:nope", Credentials(username="user", password="pass"))
