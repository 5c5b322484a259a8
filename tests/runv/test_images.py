"""The runv OCI image store: pulls from an in-test registry that counts its requests and fails
on demand (layers in parallel and shared, failures that leave nothing, bad input)."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import hashlib
import http.server
import io
import json
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.oci.settings import PullSettings
from backends.runv.images.store import Credentials, ImageStore
from shim.cri import errors

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


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


def layer_of(name: str, size: int = 2000) -> bytes:
    """A gzip layer holding one file ``name`` of ``size`` bytes."""
    return gzip.compress(_tar([(name, (name.encode() * size)[:size], 0o644)]), mtime=0)


@dataclasses.dataclass
class Pushed:
    ref: str  # repo:tag
    manifest: str
    config: str
    layers: list[str]


class FakeRegistry:
    """Serves images by repository, behind bearer auth unless ``auth`` is off; records the
    requests (``(kind, digest or tag)`` past auth) and fails on demand, per blob digest:
    ``faults[d]`` = "500", "short" (closes half-way), "stall" (half, then waits for
    ``release``), "tamper" (one byte changed), "more" (a byte more than the blob);
    ``gates[d]`` an event to wait for before answering; ``barrier`` met by the requests of
    ``barrier_digests``."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, tuple[str, bytes]] = {}  # "repo:ref" -> (media type, body)
        self.token_requests: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self.auth = True
        self.faults: dict[str, str] = {}
        self.gates: dict[str, threading.Event] = {}
        self.release = threading.Event()
        self.barrier: threading.Barrier | None = None
        self.barrier_digests: set[str] = set()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        hello = gzip.compress(
            _tar([("hello.txt", b"hello from the registry\n", 0o644), ("bin", None, 0o755)])
        )
        app = self.push("team/app:v1", [hello], config={"Cmd": ["sh"], "User": "1000"}, index=True)
        self.config_digest, self.manifest_digest = app.config, app.manifest

    def blob(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def push(
        self,
        ref: str,
        layers: list[bytes],
        *,
        config: dict[str, Any] | None = None,
        index: bool = False,
        diff_ids: list[str] | None = None,
        sizes: list[int] | None = None,
        raw_config: bytes | None = None,
    ) -> Pushed:
        """An image of gzip ``layers`` at ``ref``; diff IDs, sizes and the config as given, or right."""
        repo, tag = ref.split(":")
        right = ["sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest() for layer in layers]
        cfg = (
            raw_config
            or json.dumps(
                {
                    "architecture": "amd64",
                    "os": "linux",
                    "config": config or {},
                    "rootfs": {"type": "layers", "diff_ids": right if diff_ids is None else diff_ids},
                }
            ).encode()
        )
        config_digest = self.blob(cfg)
        digests = [self.blob(layer) for layer in layers]
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST,
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": len(cfg),
                },
                "layers": [
                    {"mediaType": LAYER, "digest": d, "size": len(layer) if sizes is None else sizes[i]}
                    for i, (d, layer) in enumerate(zip(digests, layers, strict=True))
                ],
            }
        ).encode()
        manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        self.manifests[f"{repo}:{manifest_digest}"] = (MANIFEST, manifest)
        if index:
            body = json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": INDEX,
                    "manifests": [
                        {
                            "digest": "sha256:" + "0" * 64,
                            "platform": {"os": "linux", "architecture": "arm64"},
                        },
                        {"digest": manifest_digest, "platform": {"os": "linux", "architecture": "amd64"}},
                    ],
                }
            ).encode()
            self.manifests[f"{repo}:{tag}"] = (INDEX, body)
        else:
            self.manifests[f"{repo}:{tag}"] = (MANIFEST, manifest)
        return Pushed(ref, manifest_digest, config_digest, digests)

    def blob_requests(self) -> list[str]:
        return [ref for kind, ref in self.requests if kind == "blobs"]


@pytest.fixture
def registry() -> Iterator[tuple[FakeRegistry, str]]:
    reg = FakeRegistry()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

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
            if reg.auth and self.headers.get("Authorization") != "Bearer T0K":
                challenge = (
                    f'Bearer realm="http://{host}/token",service="fake",scope="repository:team/app:pull"'
                )
                self._send(401, b"{}", {"WWW-Authenticate": challenge})
                return
            path = self.path.removeprefix("/v2/")  # {repo}/{manifests,blobs}/{ref}
            repo, kind, ref = path.rsplit("/", 2)
            with reg.lock:
                reg.requests.append((kind, ref))
            if kind == "manifests" and f"{repo}:{ref}" in reg.manifests:
                media, body = reg.manifests[f"{repo}:{ref}"]
                self._send(200, body, {"Content-Type": media})
            elif kind == "blobs" and ref in reg.blobs:
                with reg.lock:
                    reg.in_flight += 1
                    reg.max_in_flight = max(reg.max_in_flight, reg.in_flight)
                left = [True]

                def done() -> None:
                    # Before the last bytes go out: a client that got them all may ask for the
                    # next blob before this thread returns, and that is not two at once.
                    with reg.lock:
                        if left and left.pop():
                            reg.in_flight -= 1

                try:
                    self._blob(ref, done)
                finally:
                    done()
            else:
                self._send(404, b"{}")

        def _blob(self, digest: str, done: Callable[[], None] = lambda: None) -> None:
            body = reg.blobs[digest]
            if reg.barrier is not None and digest in reg.barrier_digests:
                try:
                    reg.barrier.wait(timeout=10)
                except threading.BrokenBarrierError:
                    self._send(500, b"the barrier broke: fewer requests at once than expected")
                    return
            gate = reg.gates.get(digest)
            if gate is not None:
                gate.wait(timeout=10)
            fault = reg.faults.get(digest, "")
            if fault == "500":
                self._send(500, b"{}")
                return
            if fault == "tamper":
                body = body[: len(body) // 2] + bytes([body[len(body) // 2] ^ 1]) + body[len(body) // 2 + 1 :]
            if fault == "more":
                body += b"\0"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault in ("short", "stall"):
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                if fault == "short":
                    self.close_connection = True
                    return
                reg.release.wait(timeout=30)
                body = body[len(body) // 2 :]
            done()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield reg, f"127.0.0.1:{server.server_address[1]}"
    finally:
        reg.release.set()
        for gate in reg.gates.values():
            gate.set()
        server.shutdown()
        server.server_close()
        thread.join()


def new_store(root: Path, host: str, **settings: Any) -> ImageStore:
    return ImageStore(str(root), PullSettings(insecure=frozenset({host}), **settings))


def leftovers(root: Path) -> list[str]:
    """Temporary files and directories anywhere in a store."""
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.name.startswith(".unpack-") or p.name.endswith(".tmp")
    ]


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


async def test_pull_index_with_bearer_auth(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    reg, host = registry
    store = new_store(tmp_path / "images", host)
    image_id = await store.pull(f"{host}/team/app:v1", Credentials(username="user", password="pass"))
    assert image_id == reg.config_digest  # the image ID is the config digest
    assert reg.token_requests and "scope=repository%3Ateam%2Fapp%3Apull" in reg.token_requests[0]
    img = store.resolve(f"{host}/team/app:v1")
    assert img is not None and img.id == image_id and img.config["User"] == "1000"
    assert img.repo_digests == [f"{host}/team/app@{reg.manifest_digest}"]
    assert store.resolve(image_id[7:19]) is img  # short ID prefix
    lower = store.lowers(img)
    assert Path(lower[0], "hello.txt").read_bytes() == b"hello from the registry\n"

    reopened = new_store(tmp_path / "images", host)  # the index persists
    assert [i.id for i in reopened.all()] == [image_id]
    reopened.remove(image_id)
    assert reopened.resolve(image_id) is None and not Path(lower[0]).exists()


async def test_pull_rejects_bad_credentials(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    _, host = registry
    store = new_store(tmp_path / "images", host)
    with pytest.raises(errors.CriError, match="token request failed"):
        await store.pull(f"{host}/team/app:v1", Credentials(username="user", password="wrong"))


async def test_pull_missing_tag_is_not_found(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    _, host = registry
    store = new_store(tmp_path / "images", host)
    with pytest.raises(errors.NotFoundError):
        await store.pull(f"{host}/team/app:nope", Credentials(username="user", password="pass"))


# --------------------------------------------------------------------------- parallel, shared


@pytest.mark.parametrize("at_once", [1, 3])
async def test_layers_download_at_once(
    tmp_path: Path, registry: tuple[FakeRegistry, str], at_once: int
) -> None:
    """max_concurrent_downloads layers of one pull at once: with 3, the registry sees three
    requests together (a barrier of 3 that a one-at-a-time pull would break), never four."""
    reg, host = registry
    reg.auth = False
    layers = [layer_of(f"f{i}", 3000 + 500 * i) for i in range(6)]
    pushed = reg.push("multi/app:v1", layers)
    reg.barrier = threading.Barrier(3) if at_once == 3 else None
    reg.barrier_digests = set(pushed.layers)
    store = new_store(tmp_path / "images", host, max_concurrent_downloads=at_once)
    await store.pull(f"{host}/multi/app:v1")
    assert reg.max_in_flight == at_once
    img = store.resolve(f"{host}/multi/app:v1")
    assert img is not None
    assert sorted(reg.blob_requests()) == sorted([pushed.config, *pushed.layers])
    for i, lower in enumerate(reversed(store.lowers(img))):  # bottom to top
        assert Path(lower, f"f{i}").read_bytes()[:3] == f"f{i}f".encode()


async def test_pulls_at_once_share_layers(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    """Two images sharing two layers, pulled at once: one request for each blob. The shared
    layers are held back until both pulls have their configs, so both want them at once."""
    reg, host = registry
    reg.auth = False
    base = [layer_of("base0"), layer_of("base1")]
    a = reg.push("one/a:v1", [*base, layer_of("a")])
    b = reg.push("two/b:v1", [*base, layer_of("b")])
    hold = threading.Event()
    reg.gates = {d: hold for d in a.layers[:2]}
    store = new_store(tmp_path / "images", host)

    async def release_when_both_configs() -> None:
        await asyncio.to_thread(wait_for, lambda: {a.config, b.config} <= set(reg.blob_requests()), "configs")
        hold.set()

    await asyncio.gather(
        store.pull(f"{host}/one/a:v1"), store.pull(f"{host}/two/b:v1"), release_when_both_configs()
    )
    requested = reg.blob_requests()
    assert sorted(requested) == sorted({a.config, b.config, *a.layers, *b.layers})  # each once
    assert store.resolve(f"{host}/one/a:v1") is not None and store.resolve(f"{host}/two/b:v1") is not None


async def test_same_image_twice_at_once_is_one_set_of_requests(
    tmp_path: Path, registry: tuple[FakeRegistry, str]
) -> None:
    reg, host = registry
    reg.auth = False
    pushed = reg.push("same/app:v1", [layer_of("x"), layer_of("y")])
    hold = threading.Event()
    reg.gates = {pushed.layers[0]: hold}
    store = new_store(tmp_path / "images", host)
    by_tag = f"{host}/same/app:v1"
    by_digest = f"{host}/same/app@{pushed.manifest}"
    first = asyncio.ensure_future(store.pull(by_tag))
    await asyncio.to_thread(wait_for, lambda: pushed.layers[0] in reg.blob_requests(), "the layer request")
    others = [asyncio.ensure_future(store.pull(r)) for r in (by_tag, by_tag, by_digest)]
    await asyncio.sleep(0.2)  # the digest pull reaches the held layer (if it were to ask again, it would now)
    hold.set()
    ids = await asyncio.gather(first, *others)
    assert len(set(ids)) == 1
    assert sorted(reg.blob_requests()) == sorted([pushed.config, *pushed.layers])
    assert [r for k, r in reg.requests if k == "manifests"] == ["v1", pushed.manifest]


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("fault", ["500", "short", "tamper"])
async def test_failed_pull_leaves_nothing_and_a_retry_fetches_the_rest(
    tmp_path: Path, registry: tuple[FakeRegistry, str], fault: str
) -> None:
    """A layer fails (a 500, a connection closed half-way, a digest mismatch): the pull fails
    naming it, no temporary file stays, the index is unchanged, the other layers (verified)
    stay; the retry asks only for the failed layer."""
    reg, host = registry
    reg.auth = False
    pushed = reg.push("flaky/app:v1", [layer_of("ok1", 4000), layer_of("bad", 3000), layer_of("ok2", 2000)])
    bad = pushed.layers[1]
    reg.faults[bad] = fault
    # The failure comes once all three layers started (a layer not started yet is not started
    # after a failure).
    reg.gates[bad] = started = threading.Event()
    good = [pushed.layers[0], pushed.layers[2]]
    threading.Thread(
        target=lambda: (wait_for(lambda: set(good) <= set(reg.blob_requests()), "layers"), started.set())
    ).start()
    root = tmp_path / "images"
    store = new_store(root, host)
    await store.pull(f"{host}/team/app:v1", Credentials(username="user", password="pass"))
    index_before = (root / "index.json").read_bytes()
    with pytest.raises(errors.CriError, match=bad) as raised:
        await store.pull(f"{host}/flaky/app:v1")
    if fault == "tamper":
        assert "digest mismatch" in str(raised.value)
    assert leftovers(root) == []
    assert (root / "index.json").read_bytes() == index_before
    assert len(list((root / "snapshots").iterdir())) == 1 + 2  # app's layer, and the two good ones

    del reg.faults[bad]
    reg.requests.clear()
    await store.pull(f"{host}/flaky/app:v1")
    assert reg.blob_requests() == [bad]
    assert store.resolve(f"{host}/flaky/app:v1") is not None and leftovers(root) == []


async def test_diff_id_mismatch_discards_the_layer(
    tmp_path: Path, registry: tuple[FakeRegistry, str]
) -> None:
    reg, host = registry
    reg.auth = False
    layers = [layer_of("a", 9000), layer_of("b")]  # the good one larger: fetched first
    good = "sha256:" + hashlib.sha256(gzip.decompress(layers[0])).hexdigest()
    reg.push("lie/app:v1", layers, diff_ids=[good, "sha256:" + "1" * 64])
    root = tmp_path / "images"
    store = new_store(root, host, max_concurrent_downloads=1)
    with pytest.raises(
        errors.InvalidArgumentError, match=r"diff ID .* does not match the config's sha256:1111"
    ):
        await store.pull(f"{host}/lie/app:v1")
    assert [p.name for p in (root / "snapshots").iterdir()] == [good.removeprefix("sha256:")]
    assert leftovers(root) == [] and store.all() == []


async def test_cancelled_pull_cleans_up(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    """The caller goes away in the middle of a layer: the pull stops at its next chunk and
    removes what it had written; nothing enters the index; a new pull of it works."""
    reg, host = registry
    reg.auth = False
    pushed = reg.push("slow/app:v1", [layer_of("slow", 300_000)])
    reg.faults[pushed.layers[0]] = "stall"
    root = tmp_path / "images"
    store = new_store(root, host)
    task = asyncio.ensure_future(store.pull(f"{host}/slow/app:v1"))
    await asyncio.to_thread(wait_for, lambda: pushed.layers[0] in reg.blob_requests(), "the layer request")
    await asyncio.to_thread(wait_for, lambda: bool(leftovers(root)), "the unpacking directory")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    reg.release.set()  # the rest arrives; the pull sees it was cancelled
    await asyncio.to_thread(wait_for, lambda: store.pulling() == 0, "the pull thread to stop")
    assert leftovers(root) == [] and store.all() == [] and not (root / "index.json").exists()
    del reg.faults[pushed.layers[0]]
    assert await store.pull(f"{host}/slow/app:v1") == pushed.config


def test_store_start_sweeps_a_killed_pull(tmp_path: Path) -> None:
    root = tmp_path / "images"
    store = ImageStore(str(root))
    kept = root / "snapshots" / ("a" * 64) / "fs"
    kept.mkdir(parents=True)
    (root / "snapshots" / ".unpack-x1y2" / "fs" / "usr").mkdir(parents=True)
    (root / "blobs" / "sha256" / f".{'b' * 64}.k3j4.tmp").write_bytes(b"half")
    (root / ".index.json.abcd.tmp").write_bytes(b"{")
    assert len(leftovers(root)) == 3
    del store
    ImageStore(str(root))
    assert leftovers(root) == [] and kept.is_dir()


# --------------------------------------------------------------------------- bad input


def _bad_manifest(reg: FakeRegistry) -> None:
    reg.manifests["bad/app:v1"] = (MANIFEST, b"{not json")


def _manifest_not_object(reg: FakeRegistry) -> None:
    reg.manifests["bad/app:v1"] = (MANIFEST, b"[1, 2]")


def _manifest_without_layers(reg: FakeRegistry) -> None:
    cfg = reg.blob(b"{}")
    body = {"schemaVersion": 2, "config": {"digest": cfg, "size": 2}}
    reg.manifests["bad/app:v1"] = (MANIFEST, json.dumps(body).encode())


def _bad_config(reg: FakeRegistry) -> None:
    reg.push("bad/app:v1", [layer_of("a")], raw_config=b"\x00 not json")


def _config_without_diff_ids(reg: FakeRegistry) -> None:
    reg.push("bad/app:v1", [layer_of("a")], raw_config=b'{"rootfs": {}}')


def _count_mismatch(reg: FakeRegistry) -> None:
    one = "sha256:" + hashlib.sha256(gzip.decompress(layer_of("a"))).hexdigest()
    reg.push("bad/app:v1", [layer_of("a"), layer_of("b")], diff_ids=[one])


def _huge_layer(reg: FakeRegistry) -> None:
    reg.push("bad/app:v1", [layer_of("a")], sizes=[65 * 1024**3])


def _more_than_declared(reg: FakeRegistry) -> None:
    pushed = reg.push("bad/app:v1", [layer_of("a")])
    reg.faults[pushed.layers[0]] = "more"


def _fewer_than_declared(reg: FakeRegistry) -> None:
    reg.push("bad/app:v1", [layer_of("a")], sizes=[len(layer_of("a")) + 10])


def _index_without_amd64(reg: FakeRegistry) -> None:
    body = {
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [{"digest": "sha256:" + "2" * 64, "platform": {"os": "windows"}}],
    }
    reg.manifests["bad/app:v1"] = (INDEX, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(_bad_manifest, "manifest is not a JSON object", id="bad-manifest"),
        pytest.param(_manifest_not_object, "manifest is not a JSON object", id="manifest-not-object"),
        pytest.param(
            _manifest_without_layers, "the manifest has no list of layers", id="manifest-without-layers"
        ),
        pytest.param(_bad_config, "the config does not parse", id="bad-config"),
        pytest.param(
            _config_without_diff_ids, "the config has no rootfs.diff_ids", id="config-without-diff-ids"
        ),
        pytest.param(
            _count_mismatch, "the manifest lists 2 layers, the config 1 diff IDs", id="count-mismatch"
        ),
        pytest.param(
            _huge_layer, r"declares 69793218560 bytes, more than the limit of 68719476736", id="huge-layer"
        ),
        pytest.param(
            _more_than_declared,
            r"the registry sends \d+ bytes, the manifest says \d+",
            id="more-than-declared",
        ),
        pytest.param(
            _fewer_than_declared,
            r"the registry sends \d+ bytes, the manifest says \d+",
            id="fewer-than-declared",
        ),
        pytest.param(_index_without_amd64, "no linux/amd64 manifest", id="index-without-amd64"),
    ],
)
async def test_bad_input_is_invalid_argument(
    tmp_path: Path, registry: tuple[FakeRegistry, str], make: Callable[[FakeRegistry], None], message: str
) -> None:
    reg, host = registry
    reg.auth = False
    make(reg)
    root = tmp_path / "images"
    store = new_store(root, host)
    with pytest.raises(errors.InvalidArgumentError, match=f"pull {host}/bad/app:v1: .*{message}"):
        await store.pull(f"{host}/bad/app:v1")
    assert leftovers(root) == [] and store.all() == []
    assert not list((root / "snapshots").iterdir())
    if make is _huge_layer:  # refused before anything was fetched
        assert len(reg.blob_requests()) == 1  # the config


async def test_layers_larger_than_the_free_space(tmp_path: Path, registry: tuple[FakeRegistry, str]) -> None:
    reg, host = registry
    reg.auth = False
    reg.push("bad/app:v1", [layer_of("a"), layer_of("b")], sizes=[2**50, 2**50])
    store = ImageStore(
        str(tmp_path / "images"), PullSettings(insecure=frozenset({host})), max_layer_size=2**60
    )
    with pytest.raises(
        errors.ResourceExhaustedError, match=r"declare 2251799813685248 bytes and \d+ are free"
    ):
        await store.pull(f"{host}/bad/app:v1")
    assert len(reg.blob_requests()) == 1
