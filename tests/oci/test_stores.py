"""The registry configuration through the stores that use it: runv's ImageStore pulling through a
TLS mirror (a stand-in, and the testenv registry behind a pull-through stand-in that wants a
client certificate), a stalled layer, and the fake recording the hosts a pull would ask."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from backends import fake
from backends.oci.hosts import HostsConfigError
from backends.oci.settings import PullSettings
from backends.runv.images.store import ImageStore
from cri_api import api_pb2 as pb
from shim.cri import errors
from tests.oci.conftest import REPO, HostsDir, toml_str
from tests.oci.standin import Image, Pki, Standin

TESTENV_REGISTRY = "127.0.0.1:5000"


def mirror_toml(mirror: Standin, pki: Pki, client: bool = True) -> str:
    pair = f"client = [[{toml_str(pki.client_cert)}, {toml_str(pki.client_key)}]]" if client else ""
    return f"""
    [host."{mirror.url}"]
      capabilities = ["pull", "resolve"]
      ca = {toml_str(pki.ca)}
      {pair}
    """


def leftovers(root: Path) -> list[str]:
    """Temporary files and directories a failed pull might leave in a store."""
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(root)
        for n in (*dirs, *files)
        if n.startswith(".") or n.endswith(".tmp")
    ]


async def test_runv_store_pulls_through_a_tls_mirror(
    upstream: Standin, pki: Pki, image: Image, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    with Standin(pki, client_certs=True) as mirror:
        mirror.put(REPO, "v1", image)
        hosts_dir.write(upstream.netloc, mirror_toml(mirror, pki))
        settings = PullSettings(config_path=hosts_dir.path, insecure=frozenset({upstream.netloc}))
        store = ImageStore(str(tmp_path / "images"), settings)
        image_id = await store.pull(f"{upstream.netloc}/{REPO}:v1")
        assert image_id == image.config_digest
        img = store.resolve(f"{upstream.netloc}/{REPO}:v1")
        assert img is not None and img.repo_digests == [f"{upstream.netloc}/{REPO}@{image.manifest_digest}"]
        files = {name for lower in store.lowers(img) for name in os.listdir(lower)}
        assert {"hello.txt", "etc"} <= files
        assert len(mirror.api_requests()) == 2 + len(image.layers) and upstream.api_requests() == []


async def test_runv_store_stalled_layer(
    upstream: Standin, pki: Pki, image: Image, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    with Standin(pki) as mirror:
        mirror.put(REPO, "v1", image)
        mirror.fault = upstream.fault = "stall"
        hosts_dir.write(upstream.netloc, mirror_toml(mirror, pki, client=False))
        settings = PullSettings(
            config_path=hosts_dir.path, insecure=frozenset({upstream.netloc}), progress_timeout=1
        )
        store = ImageStore(str(tmp_path / "images"), settings)
        with pytest.raises(errors.CriError) as err:
            await store.pull(f"{upstream.netloc}/{REPO}:v1")
        assert f"from {mirror.url}: no byte for 1s" in str(err.value)
        assert image.config_digest in str(err.value)  # the first blob of the pull stalls
        assert store.all() == [] and leftovers(tmp_path / "images") == []


def _testenv_registry_up() -> bool:
    try:
        with urllib.request.urlopen(f"http://{TESTENV_REGISTRY}/v2/", timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.skipif(
    not _testenv_registry_up(), reason="no testenv registry on 127.0.0.1:5000 (scripts/testenv/up)"
)
async def test_testenv_registry_behind_a_tls_mirror_with_client_certificates(
    pki: Pki, hosts_dir: HostsDir, tmp_path: Path
) -> None:
    with Standin(pki, client_certs=True, upstream=f"http://{TESTENV_REGISTRY}") as mirror:
        hosts_dir.write(TESTENV_REGISTRY, mirror_toml(mirror, pki))
        store = ImageStore(str(tmp_path / "images"), PullSettings(config_path=hosts_dir.path))
        ref = f"{TESTENV_REGISTRY}/busybox:1.36"
        await store.pull(ref)
        img = store.resolve(ref)
        assert img is not None
        assert any(os.path.exists(os.path.join(lower, "bin", "busybox")) for lower in store.lowers(img))
        asked = mirror.api_requests()
        assert asked and all(s.query == {"ns": TESTENV_REGISTRY} for s in asked)
        assert mirror.tls_failures == 0


# --------------------------------------------------------------------------- the fake


async def test_fake_records_the_hosts_a_pull_would_ask(hosts_dir: HostsDir) -> None:
    hosts_dir.write(
        "registry.k8s.io",
        """
        [host."https://pull-only.example"]
          capabilities = ["pull"]
        [host."https://mirror.example:8443"]
          capabilities = ["pull", "resolve"]
        """,
    )
    backend = fake.create("fake", {"registry_config_path": hosts_dir.path, "pull_seconds": 0})
    images = backend.runtime.images
    auth = pb.AuthConfig(username="u", password="p")
    await images.pull_image(pb.ImageSpec(image="registry.k8s.io/pause:3.10"), auth, None)
    await images.pull_image(pb.ImageSpec(image="registry.k8s.io/pause@sha256:" + "a" * 64), None, None)
    await images.pull_image(pb.ImageSpec(image="quay.io/x/y:1"), None, None)
    by_tag, by_digest, other = backend.pulls
    assert by_tag == ("registry.k8s.io/pause:3.10", auth)  # the record is still (image, auth)
    assert by_tag.hosts == ("https://mirror.example:8443", "https://registry.k8s.io")
    assert by_digest.hosts == (
        "https://pull-only.example",
        "https://mirror.example:8443",
        "https://registry.k8s.io",
    )
    assert other.hosts == ("https://quay.io",)


def test_fake_refuses_a_bad_hosts_toml_at_start(hosts_dir: HostsDir) -> None:
    path = hosts_dir.write("registry.k8s.io", '[host."https://m.example"]\nskip_verify = "no"\n')
    with pytest.raises(HostsConfigError) as err:
        fake.create("fake", {"registry_config_path": hosts_dir.path})
    assert str(err.value).startswith(
        f'{path}: key host."https://m.example".skip_verify: must be true or false'
    )
