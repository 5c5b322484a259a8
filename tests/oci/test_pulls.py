"""RegistryClient against stand-in registries: mirrors (TLS with their own CA, client
certificates), their order and the fallback to the upstream with its log lines, capabilities,
override_path, headers, skip_verify, and the faults: 500s, a redirect loop, a stalled blob,
manifests that do not parse or are too big, blobs that do not verify."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import structlog

from backends import reference
from backends.contract.errors import NotFoundError, UnavailableError
from backends.oci.registry import PullError, RegistryClient, StalledError
from backends.oci.settings import PullSettings
from tests.oci.conftest import REPO, HostsDir, toml_str
from tests.oci.standin import Image, Pki, Standin, free_port


def client(upstream: Standin, hosts_dir: HostsDir | None = None, **settings: Any) -> RegistryClient:
    ref = reference.parse(f"{upstream.netloc}/{REPO}:v1")
    config = PullSettings(
        insecure=frozenset({upstream.netloc}), config_path=hosts_dir.path if hosts_dir else "", **settings
    )
    return RegistryClient(ref, None, config)


def pull_all(reg: RegistryClient, image: Image, dest: Path) -> None:
    """What a store does: the manifest by tag, then the config and the layers by digest."""
    raw, _, digest = reg.manifest("v1")
    assert (raw, digest) == (image.manifest, image.manifest_digest)
    dest.mkdir(exist_ok=True)
    for blob in (image.config_digest, *image.layers):
        reg.blob(blob, str(dest / blob[7:]))
        assert (dest / blob[7:]).read_bytes() == image.blobs[blob]


def failures(logs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["host"], e["reason"]) for e in logs if e["event"] == "registry.host_failed"]


def test_tls_mirror_with_its_own_ca_serves_before_the_upstream(
    upstream: Standin, mirror: Standin, image: Image, pki: Pki, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    hosts_dir.write(
        upstream.netloc,
        f"""
        [host."{mirror.url}"]
          capabilities = ["pull", "resolve"]
          ca = {toml_str(pki.ca)}
        """,
    )
    pull_all(client(upstream, hosts_dir), image, tmp_path / "blobs")
    asked = mirror.api_requests()
    assert len(asked) == 2 + len(image.layers)  # the manifest, the config, the layers
    assert {s.query.get("ns") for s in asked} == {upstream.netloc}  # as containerd asks a mirror
    assert upstream.api_requests() == []


def test_mirror_whose_ca_is_not_trusted_falls_back_and_is_asked_once(
    upstream: Standin, mirror: Standin, image: Image, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    hosts_dir.write(upstream.netloc, f'[host."{mirror.url}"]\n')  # no ca: the system's CAs refuse it
    with structlog.testing.capture_logs() as logs:
        pull_all(client(upstream, hosts_dir), image, tmp_path / "blobs")
    (first, *rest) = failures(logs)
    assert first[0] == mirror.url and "TLS certificate not trusted" in first[1]
    assert rest == []  # unreachable once: not asked again during the pull (the skips are not logged)
    assert mirror.tls_failures == 1 and mirror.api_requests() == []
    assert len(upstream.api_requests()) == 2 + len(image.layers)


def test_mirror_that_requires_a_client_certificate(
    upstream: Standin, pki: Pki, image: Image, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    with Standin(pki, client_certs=True) as strict:
        strict.put(REPO, "v1", image)
        hosts_dir.write(
            upstream.netloc,
            f"""
            [host."{strict.url}"]
              ca = {toml_str(pki.ca)}
              client = [[{toml_str(pki.client_cert)}, {toml_str(pki.client_key)}]]
            """,
        )
        pull_all(client(upstream, hosts_dir), image, tmp_path / "with")
        assert len(strict.api_requests()) == 2 + len(image.layers) and strict.tls_failures == 0
        assert upstream.api_requests() == []

        hosts_dir.write(upstream.netloc, f'[host."{strict.url}"]\nca = {toml_str(pki.ca)}\n')  # no client
        with structlog.testing.capture_logs() as logs:
            pull_all(client(upstream, hosts_dir), image, tmp_path / "without")
        assert [h for h, _ in failures(logs)] == [strict.url]
        assert strict.tls_failures == 1 and len(upstream.api_requests()) == 2 + len(image.layers)


def test_mirrors_in_order_each_failure_logged_then_the_upstream(
    upstream: Standin, pki: Pki, image: Image, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    with Standin() as failing, Standin() as empty:
        failing.fault = "500"
        hosts_dir.write(
            upstream.netloc,
            f"""
            [host."{unreachable}"]
            [host."{failing.url}"]
            [host."{empty.url}"]
            """,
        )
        reg = client(upstream, hosts_dir)
        with structlog.testing.capture_logs() as logs:
            raw, _, _ = reg.manifest("v1")
        assert raw == image.manifest
        events = [e for e in logs if e["event"] == "registry.host_failed"]
        assert [(e["host"], e["reason"]) for e in events] == [
            (unreachable, "connection refused"),
            (failing.url, "HTTP 500 (UNKNOWN: the stand-in fails on purpose)"),
            (empty.url, "not found (HTTP 404)"),
        ]
        assert [e["next"] for e in events] == [failing.url, empty.url, upstream.url]
        assert all(e["log_level"] == "warning" and e["request"] == "manifest v1" for e in events)
        assert len(upstream.api_requests()) == 1


def test_a_mirror_without_resolve_is_not_asked_for_tags(
    upstream: Standin, mirror: Standin, image: Image, pki: Pki, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    hosts_dir.write(
        upstream.netloc, f'[host."{mirror.url}"]\ncapabilities = ["pull"]\nca = {toml_str(pki.ca)}\n'
    )
    pull_all(client(upstream, hosts_dir), image, tmp_path / "blobs")
    assert [s.path.rsplit("/", 1)[-1] for s in upstream.api_requests()] == ["v1"]  # the tag, upstream only
    assert all("/blobs/" in s.path for s in mirror.api_requests())
    assert len(mirror.api_requests()) == 1 + len(image.layers)


def test_no_host_may_resolve(upstream: Standin, hosts_dir: HostsDir) -> None:
    hosts_dir.write(upstream.netloc, 'capabilities = ["pull"]\n')
    with pytest.raises(PullError, match="no configured host has the 'resolve' capability"):
        client(upstream, hosts_dir).manifest("v1")


@pytest.mark.parametrize("override", [True, False], ids=["override_path", "v2-appended"])
def test_override_path(
    upstream: Standin, pki: Pki, image: Image, hosts_dir: HostsDir, override: bool
) -> None:
    with Standin(pki, root="/custom/api") as odd:
        odd.put(REPO, "v1", image)
        hosts_dir.write(
            upstream.netloc,
            f"""
            [host."{odd.url}/custom/api"]
              ca = {toml_str(pki.ca)}
              override_path = {"true" if override else "false"}
            """,
        )
        assert client(upstream, hosts_dir).manifest("v1")[0] == image.manifest
        paths = [s.path for s in odd.seen]
        if override:
            assert paths == [f"/custom/api/{REPO}/manifests/v1"] and upstream.api_requests() == []
        else:
            assert paths == [f"/custom/api/v2/{REPO}/manifests/v1"]  # not found there: upstream answers
            assert len(upstream.api_requests()) == 1


def test_configured_headers_are_sent(
    upstream: Standin, mirror: Standin, pki: Pki, hosts_dir: HostsDir
) -> None:
    mirror.fault = "500"  # so that the upstream is asked too
    hosts_dir.write(
        upstream.netloc,
        f"""
        [header]
          x-upstream = "up"
        [host."{mirror.url}"]
          ca = {toml_str(pki.ca)}
          [host."{mirror.url}".header]
            x-one = "1"
            x-many = ["a", "b"]
        """,
    )
    client(upstream, hosts_dir).manifest("v1")
    (at_mirror,) = mirror.api_requests()
    assert at_mirror.headers["x-one"] == ["1"] and at_mirror.headers["x-many"] == ["a", "b"]
    assert "x-upstream" not in at_mirror.headers
    (at_upstream,) = upstream.api_requests()
    assert at_upstream.headers["x-upstream"] == ["up"] and "x-one" not in at_upstream.headers


def test_skip_verify(upstream: Standin, mirror: Standin, image: Image, hosts_dir: HostsDir) -> None:
    hosts_dir.write(upstream.netloc, f'[host."{mirror.url}"]\nskip_verify = true\n')
    assert client(upstream, hosts_dir).manifest("v1")[0] == image.manifest
    assert len(mirror.api_requests()) == 1 and upstream.api_requests() == []


def test_500s_everywhere_name_every_host(
    upstream: Standin, mirror: Standin, pki: Pki, hosts_dir: HostsDir
) -> None:
    upstream.fault = mirror.fault = "500"
    hosts_dir.write(upstream.netloc, f'[host."{mirror.url}"]\nca = {toml_str(pki.ca)}\n')
    with pytest.raises(UnavailableError) as err:
        client(upstream, hosts_dir).manifest("v1")
    assert str(err.value) == (
        f"manifest v1 of {upstream.netloc}/{REPO}: every host failed: "
        f"{mirror.url}: HTTP 500 (UNKNOWN: the stand-in fails on purpose); "
        f"{upstream.url}: HTTP 500 (UNKNOWN: the stand-in fails on purpose)"
    )


def test_not_found_upstream_is_not_found(upstream: Standin) -> None:
    with pytest.raises(NotFoundError, match=f"manifest nope of .*: {upstream.url}: not found"):
        client(upstream).manifest("nope")


def test_redirect_loop(upstream: Standin) -> None:
    upstream.fault = "redirect_loop"
    with pytest.raises(PullError, match=r"more than 5 redirects \(a redirect loop\?\)"):
        client(upstream).manifest("v1")
    assert len(upstream.api_requests()) == 6


def test_stalled_blob_is_cancelled_after_the_progress_timeout(
    upstream: Standin, image: Image, tmp_path: Path
) -> None:
    upstream.fault = "stall"
    reg = client(upstream, progress_timeout=1)
    layer = image.layers[0]
    with pytest.raises(StalledError) as err:
        reg.blob(layer, str(tmp_path / "layer"))
    assert str(err.value).startswith(f"blob {layer} from {upstream.url}: no byte for 1s after ")
    assert os.listdir(tmp_path) == []  # nothing half-written
    with pytest.raises(StalledError, match=layer), reg.open_blob(layer) as stream:
        while stream.read(1 << 16):
            pass


def test_slow_but_moving_blob_is_not_cancelled(upstream: Standin, image: Image, tmp_path: Path) -> None:
    # progress_timeout bounds the wait for a byte, not the download: 0 turns it off entirely.
    layer = image.layers[0]
    client(upstream, progress_timeout=0).blob(layer, str(tmp_path / "layer"))
    assert (tmp_path / "layer").read_bytes() == image.blobs[layer]


BAD_ANSWERS = [
    ("garbage_manifest", "manifest", "manifest is not a JSON object"),
    ("huge_manifest", "manifest", f"manifest of {5 << 20} bytes is over the 4194304 byte limit"),
    ("wrong_digest", "blob", "blob digest mismatch for sha256:"),
]


@pytest.mark.parametrize(("fault", "what", "message"), BAD_ANSWERS, ids=[f for f, _, _ in BAD_ANSWERS])
def test_bad_answers(
    upstream: Standin, image: Image, tmp_path: Path, fault: str, what: str, message: str
) -> None:
    upstream.fault = fault
    reg = client(upstream)
    with pytest.raises(PullError, match=message):
        if what == "manifest":
            reg.manifest("v1")
        else:
            reg.blob(image.layers[0], str(tmp_path / "layer"))
    assert os.listdir(tmp_path) == []


def test_manifest_by_digest_is_verified(upstream: Standin, image: Image) -> None:
    reg = client(upstream)
    assert reg.manifest(image.manifest_digest)[2] == image.manifest_digest
    upstream.fault = "garbage_manifest"
    with pytest.raises(PullError, match="manifest digest mismatch"):
        reg.manifest(image.manifest_digest)


def test_blob_bigger_than_declared(upstream: Standin, image: Image, tmp_path: Path) -> None:
    layer = image.layers[0]
    with pytest.raises(
        PullError, match=f"blob of {len(image.blobs[layer])} bytes where the manifest declares 10"
    ):
        client(upstream).blob(layer, str(tmp_path / "layer"), size=10)
