"""Fixtures of the backends/oci tests: certificates (made once by openssl), stand-in registries,
a hosts.toml directory."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oci.standin import Image, Pki, Standin, make_image, make_pki

REPO = "team/app"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture(scope="session")
def image() -> Image:
    return make_image({"hello.txt": b"hello from the stand-in\n", "etc/motd": b"motd\n"}, layers=2)


@pytest.fixture
def upstream(image: Image) -> Iterator[Standin]:
    """The image's own registry: plain HTTP (listed as insecure by the tests that use it)."""
    with Standin() as reg:
        reg.put(REPO, "v1", image)
        yield reg


@pytest.fixture
def mirror(pki: Pki, image: Image) -> Iterator[Standin]:
    """A TLS mirror whose certificate only the stand-in CA signs."""
    with Standin(pki) as reg:
        reg.put(REPO, "v1", image)
        yield reg


class HostsDir:
    """A config_path directory: ``write(namespace, toml)`` adds a hosts.toml."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(exist_ok=True)

    @property
    def path(self) -> str:
        return str(self.root)

    def write(self, namespace: str, text: str) -> str:
        directory = self.root / namespace
        directory.mkdir(exist_ok=True)
        path = directory / "hosts.toml"
        path.write_text(textwrap.dedent(text))
        return str(path)


@pytest.fixture
def hosts_dir(tmp_path: Path) -> HostsDir:
    return HostsDir(tmp_path / "certs.d")


def toml_str(path: str) -> str:
    """A path as a TOML basic string."""
    return '"' + os.fspath(path).replace("\\", "\\\\").replace('"', '\\"') + '"'
