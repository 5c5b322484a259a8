"""The deployment files agree with the shim's own defaults and with each other."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from shim.config import DEFAULT_LISTEN, ServerConfig, parse

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SOCKET_PATH = DEFAULT_LISTEN.removeprefix("unix://")


def unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment, method-assign]
    parser.read_string((DEPLOY / "systemd" / name).read_text())
    return parser


def yaml_scalars(path: Path) -> dict[str, str]:
    """Top-level and nested `key: value` scalars of a simple YAML file (no PyYAML in the venv)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z][\w-]*):\s+([^#|{\[]\S*)\s*(#.*)?$", line)
        if m:
            out[m.group(1)] = m.group(2).strip("\"'")
    return out


def block_scalar(path: Path, key: str) -> str:
    """The text of a `key: |` block in YAML, dedented."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"{key}: |")
    indent = len(lines[start]) - len(lines[start].lstrip()) + 2
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        body.append(line[indent:])
    return "\n".join(body) + "\n"


def test_socket_unit_matches_the_default_listen_address() -> None:
    sock = unit("cri-shim.socket")
    assert sock["Socket"]["ListenStream"] == SOCKET_PATH
    assert sock["Socket"]["SocketMode"] == "0660"
    assert sock["Socket"]["SocketGroup"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("Type", "notify"), ("NotifyAccess", "main"), ("Restart", "always")],
    ids=["notify", "notify-access", "restart"],
)
def test_service_unit(key: str, value: str) -> None:
    assert unit("cri-shim.service")["Service"][key] == value


def test_service_unit_starts_after_docker_with_the_activated_socket() -> None:
    svc = unit("cri-shim.service")
    assert "docker.service" in svc["Unit"]["After"].split()
    assert "cri-shim.socket" in svc["Unit"]["Requires"].split()
    assert "--listen fd://" in svc["Service"]["ExecStart"]


@pytest.mark.parametrize("name", ["kubelet-config.yaml", "crictl"], ids=["kubelet-config", "crictl"])
def test_endpoints_point_at_the_default_socket(name: str) -> None:
    if name == "crictl":
        values = yaml_scalars(DEPLOY / "crictl.yaml")
        keys = ("runtime-endpoint", "image-endpoint")
    else:
        values = yaml_scalars(DEPLOY / "kubernetes" / name)
        keys = ("containerRuntimeEndpoint", "imageServiceEndpoint")
    for key in keys:
        assert values[key] == DEFAULT_LISTEN, key


def test_kubelet_cgroup_driver_matches_runtime_config_default() -> None:
    assert yaml_scalars(DEPLOY / "kubernetes" / "kubelet-config.yaml")["cgroupDriver"] == (
        ServerConfig().cgroup_driver
    )
    assert (
        f"--cgroup-driver={ServerConfig().cgroup_driver}"
        in (DEPLOY / "kubernetes" / "kubelet.env").read_text()
    )


def test_daemonset_config_is_a_valid_shim_config() -> None:
    import tomllib

    cfg = parse(tomllib.loads(block_scalar(DEPLOY / "kubernetes" / "daemonset.yaml", "config.toml")))
    assert cfg.server.listen == DEFAULT_LISTEN
    assert cfg.server.default_handler == "docker"
    assert cfg.handlers["docker"].options["endpoint"] == "unix:///var/run/docker.sock"
    assert cfg.server.cgroup_driver == ServerConfig().cgroup_driver


def test_daemonset_mounts_what_a_node_needs() -> None:
    text = (DEPLOY / "kubernetes" / "daemonset.yaml").read_text()
    for path in (
        "/run/cri-shim",
        "/var/lib/cri-shim",
        "/var/log/pods",
        "/var/run/docker.sock",
        "/sys/fs/cgroup",
    ):
        assert f"mountPath: {path}" in text, path
        assert f"path: {path}" in text, path
    assert "hostPID: true" in text and "hostNetwork: true" in text
