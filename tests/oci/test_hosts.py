"""hosts.toml parsing (backends/oci/hosts.py): which hosts a pull asks, in which order, and the
errors of a file that cannot be used (naming the file and the key, at load time)."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest

from backends.oci.hosts import HostsConfigError, load_hosts
from backends.oci.settings import PullSettings
from tests.oci.conftest import HostsDir, toml_str
from tests.oci.standin import Pki


def test_no_config_path_asks_the_registry_itself() -> None:
    hosts = load_hosts("")
    (only,) = hosts.for_domain("registry.example:5000")
    assert (only.url, only.root, only.mirror) == ("https://registry.example:5000", "/v2", False)
    (hub,) = hosts.for_domain("docker.io")
    assert hub.url == "https://registry-1.docker.io"
    (plain,) = hosts.for_domain("127.0.0.1:5000", insecure={"127.0.0.1:5000"})
    assert plain.scheme == "http" and plain.tls is None


def test_mirrors_in_order_then_the_server(hosts_dir: HostsDir) -> None:
    hosts_dir.write(
        "registry.example",
        """
        server = "https://upstream.example"
        capabilities = ["pull", "resolve"]

        [host."https://second.example"]
          capabilities = ["pull"]
        [host."http://first.example:8080/cache"]
          capabilities = ["pull", "resolve"]
          [host."http://first.example:8080/cache".header]
            x-one = "1"
            x-many = ["a", "b"]
        [host."https://raw.example/v2/upstream"]
          override_path = true
        """,
    )
    hosts = load_hosts(hosts_dir.path).for_domain("registry.example")
    assert [h.url for h in hosts] == [
        "https://second.example",
        "http://first.example:8080/cache",
        "https://raw.example/v2/upstream",
        "https://upstream.example",
    ]
    second, first, raw, server = hosts
    assert second.capabilities == {"pull"} and second.mirror
    assert first.root == "/cache/v2" and first.tls is None
    assert first.headers == (("x-one", "1"), ("x-many", "a"), ("x-many", "b"))
    assert raw.root == "/v2/upstream"  # override_path: no /v2 added
    assert server.capabilities == {"pull", "resolve"} and not server.mirror


def test_namespace_lookup_order(hosts_dir: HostsDir) -> None:
    hosts_dir.write("_default", '[host."https://everyone.example"]\n')
    hosts_dir.write("reg.example:5000", '[host."https://colon.example"]\n')
    hosts_dir.write("reg.example_5000_", '[host."https://underscore.example"]\n')
    hosts = load_hosts(hosts_dir.path)
    assert hosts.for_domain("reg.example:5000")[0].url == "https://underscore.example"
    shutil.rmtree(hosts_dir.root / "reg.example_5000_")
    hosts = load_hosts(hosts_dir.path)
    assert hosts.for_domain("reg.example:5000")[0].url == "https://colon.example"
    other = hosts.for_domain("other.example")
    assert [h.url for h in other] == ["https://everyone.example", "https://other.example"]


def test_default_namespace_server_replaces_the_registry(hosts_dir: HostsDir) -> None:
    hosts_dir.write("_default", 'server = "https://only.example"\n')
    assert [h.url for h in load_hosts(hosts_dir.path).for_domain("a.example")] == ["https://only.example"]


def test_server_without_scheme_and_insecure(hosts_dir: HostsDir) -> None:
    hosts_dir.write("plain.example:5000", "capabilities = ['pull', 'resolve']\n")
    (server,) = load_hosts(hosts_dir.path).for_domain("plain.example:5000", insecure={"plain.example:5000"})
    assert server.url == "http://plain.example:5000"  # no server: insecure decides the scheme


def test_tls_settings_load_and_relative_paths(hosts_dir: HostsDir, pki: Pki) -> None:
    directory = hosts_dir.root / "tls.example"
    directory.mkdir(parents=True)
    shutil.copy(pki.ca, directory / "ca.crt")
    hosts_dir.write(
        "tls.example",
        f"""
        ca = "ca.crt"
        client = [[{toml_str(pki.client_cert)}, {toml_str(pki.client_key)}]]
        [host."https://m.example"]
          skip_verify = true
          dial_timeout = "1m30s"
        """,
    )
    mirror, server = load_hosts(hosts_dir.path).for_domain("tls.example")
    assert mirror.tls is not None and mirror.tls.verify_mode == ssl.CERT_NONE
    assert not mirror.tls.check_hostname
    assert mirror.dial_timeout == 90
    assert server.tls is not None and server.tls.verify_mode == ssl.CERT_REQUIRED
    assert any("registry-ca" in str(c.get("subject")) for c in server.tls.get_ca_certs())


def test_docker_certs_directory(hosts_dir: HostsDir, pki: Pki) -> None:
    directory = hosts_dir.root / "dockerish.example"
    directory.mkdir(parents=True)
    shutil.copy(pki.ca, directory / "ca.crt")
    shutil.copy(pki.client_cert, directory / "client.cert")
    shutil.copy(pki.client_key, directory / "client.key")
    (server,) = load_hosts(hosts_dir.path).for_domain("dockerish.example")
    assert server.tls is not None
    assert any("registry-ca" in str(c.get("subject")) for c in server.tls.get_ca_certs())


BAD_FILES = [
    ("not-toml", 'server = "https://x\n', "not valid TOML"),
    ("unknown-top", 'servr = "https://x"\n', "key servr: unknown key"),
    (
        "unknown-host-key",
        '[host."https://m"]\ncapability = ["pull"]\n',
        'key host."https://m".capability: unknown',
    ),
    ("skip-verify-type", '[host."https://m"]\nskip_verify = "yes"\n', "skip_verify: must be true or false"),
    ("bad-capability", 'capabilities = ["pull", "fetch"]\n', "capabilities: 'fetch' is not one of"),
    ("capabilities-string", 'capabilities = "pull"\n', "capabilities: must be a list of strings"),
    ("server-not-url", 'server = "ftp://x"\n', "key server: 'ftp://x' is not an http"),
    ("server-type", "server = 5\n", "key server: must be a URL string"),
    ("header-type", "[header]\nx-a = 1\n", "header.x-a: must be a string or a list"),
    ("header-name", '[header]\n"bad name" = "v"\n', "is not a valid header name"),
    ("missing-ca", 'ca = "nowhere.pem"\n', "key ca: "),
    ("client-shape", "client = [[1, 2]]\n", "key client: [1, 2] is neither"),
    ("dial-timeout", 'dial_timeout = "soon"\n', "dial_timeout: must be a duration"),
    ("proxy", 'proxy = "http://p:3128"\n', "key proxy: a proxy per host is not supported"),
    ("nested-host", '[host."https://m"]\n[host."https://m".host."https://n"]\n', "unknown key"),
]


@pytest.mark.parametrize(
    ("text", "message"), [(t, m) for _, t, m in BAD_FILES], ids=[i for i, _, _ in BAD_FILES]
)
def test_bad_hosts_toml_names_file_and_key(hosts_dir: HostsDir, text: str, message: str) -> None:
    path = hosts_dir.write("bad.example", text)
    with pytest.raises(HostsConfigError, match="^" + path.replace(".", r"\.") + ": ") as err:
        load_hosts(hosts_dir.path)
    assert message in str(err.value)
    # The store's settings parse it when made (at start), with the same error.
    with pytest.raises(HostsConfigError, match=r"bad\.example"):
        PullSettings(config_path=hosts_dir.path)


def test_config_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(HostsConfigError, match="not a directory"):
        load_hosts(str(tmp_path / "file"))
    assert load_hosts(str(tmp_path / "absent")).namespaces == {}
