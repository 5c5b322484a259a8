"""Network config: which file, validation with file and field, version choice, reload, request configs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from backends.cni import ConfigError
from backends.cni.config import ConfigDir, load_file, parse_network, request_config
from backends.contract.errors import FailedPreconditionError
from tests.cni.fakeplugin import write_json

BRIDGE = {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "subnet": "10.1.0.0/16"}}


def conflist(**over: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "net1", "plugins": [BRIDGE]} | over


def test_the_first_file_in_lexical_order_is_the_network(tmp_path: Path) -> None:
    write_json(tmp_path / "20-b.conflist", conflist(name="b"))
    write_json(tmp_path / "10-a.json", conflist(name="a"))
    write_json(tmp_path / "05-ignored.txt", conflist(name="txt"))
    (tmp_path / "00-dir.conf").mkdir()
    net = ConfigDir(str(tmp_path)).current()
    assert (net.name, net.source) == ("a", str(tmp_path / "10-a.json"))


def test_a_single_plugin_conf_is_wrapped_as_a_one_plugin_list(tmp_path: Path) -> None:
    conf = {"cniVersion": "0.4.0", "name": "single", "disableCheck": True} | BRIDGE
    net = load_file(str(write_json(tmp_path / "10-x.conf", conf)))
    assert [p.type for p in net.plugins] == ["bridge"]
    assert net.plugins[0].ipam_type == "host-local"
    assert net.raw == {"cniVersion": "0.4.0", "name": "single", "disableCheck": True, "plugins": [conf]}
    # What the cache keeps reads back as the same network.
    again = parse_network(net.raw, "cache")
    assert (again.name, again.version, again.disable_check) == ("single", "0.4.0", True)


@pytest.mark.parametrize(
    ("data", "field", "problem"),
    [
        ([1], "", "not a JSON object"),
        (conflist(name=None), "name", "missing"),
        (conflist(name="a/b"), "name", "not a network name"),
        (conflist(cniVersion=None), "cniVersion", "missing"),
        (conflist(cniVersion="0.2.0"), "cniVersion", "not supported"),
        (conflist(cniVersions="1.0.0"), "cniVersions", "list of strings"),
        (conflist(plugins=[]), "plugins", "non-empty list"),
        (conflist(plugins=[BRIDGE, {"name": "x"}]), "plugins[1].type", "missing"),
        (conflist(plugins=[BRIDGE, "portmap"]), "plugins[1]", "must be an object"),
        (conflist(plugins=[{"type": "../bin/sh"}]), "plugins[0].type", "not a plugin name"),
        (
            conflist(plugins=[{"type": "portmap", "capabilities": {"portMappings": 1}}]),
            "plugins[0].capabilities",
            "",
        ),
        (conflist(plugins=[{"type": "bridge", "ipam": {"type": ""}}]), "plugins[0].ipam.type", "missing"),
        (conflist(plugins=[{"type": "bridge", "ipam": []}]), "plugins[0].ipam", "must be an object"),
        (conflist(disableCheck="yes"), "disableCheck", "must be a boolean"),
        ({"cniVersion": "1.0.0", "name": "single"}, "type", "missing"),
    ],
    ids=[
        "not-object",
        "no-name",
        "bad-name",
        "no-version",
        "old-version",
        "versions-not-list",
        "no-plugins",
        "plugin-without-type",
        "plugin-not-object",
        "type-with-slash",
        "capability-not-bool",
        "empty-ipam-type",
        "ipam-not-object",
        "disable-check-not-bool",
        "single-without-type",
    ],
)
def test_errors_name_the_file_and_the_field(tmp_path: Path, data: object, field: str, problem: str) -> None:
    path = write_json(tmp_path / "10-x.conflist", data)
    with pytest.raises(ConfigError) as info:
        load_file(str(path))
    assert isinstance(info.value, FailedPreconditionError)
    assert info.value.source == str(path)
    assert info.value.field == field
    assert info.value.message.startswith(f"{path}: {field}" if field else str(path))
    assert problem in info.value.message


def test_a_file_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "10-x.conflist"
    path.write_text('{"name": ')
    with pytest.raises(ConfigError, match=rf"^{path}: invalid JSON"):
        load_file(str(path))


@pytest.mark.parametrize(
    ("declared", "others", "chosen"),
    [
        ("1.0.0", None, "1.0.0"),
        ("0.3.1", ["0.4.0", "1.1.0", "9.9.9"], "1.1.0"),
        ("9.0.0", ["0.3.0"], "0.3.0"),
        ("1.1.0", ["0.4.0"], "1.1.0"),
    ],
    ids=["declared", "highest-of-list", "unknown-declared-list-usable", "declared-highest"],
)
def test_the_version_is_the_highest_supported(declared: str, others: list[str] | None, chosen: str) -> None:
    data = conflist(cniVersion=declared) | ({"cniVersions": others} if others else {})
    assert parse_network(data, "x").version == chosen


def test_string_flags_are_read(tmp_path: Path) -> None:
    net = parse_network(conflist(disableCheck="true", disableGC=True), "x")
    assert (net.disable_check, net.disable_gc) == (True, True)


def test_reloaded_only_when_the_first_file_changes(tmp_path: Path) -> None:
    d = ConfigDir(str(tmp_path / "net.d"))
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/net.d: no network config"):
        d.current()
    path = write_json(tmp_path / "net.d" / "20-a.conflist", conflist(name="a"))
    first = d.current()
    assert d.current() is first  # unchanged: not read again
    write_json(path, conflist(name="a2"))  # replaced atomically
    assert d.current().name == "a2"
    write_json(tmp_path / "net.d" / "10-b.conflist", conflist(name="b"))  # sorts first
    assert d.current().name == "b"
    write_json(tmp_path / "net.d" / "10-b.conflist", conflist(name="b", plugins=[]))
    with pytest.raises(ConfigError, match=r"10-b\.conflist: plugins"):
        d.current()
    with pytest.raises(ConfigError, match=r"10-b\.conflist: plugins"):
        d.current()  # the cached error again
    os.unlink(tmp_path / "net.d" / "10-b.conflist")
    assert d.current().name == "a2"


def test_a_change_in_place_is_seen(tmp_path: Path) -> None:
    path = write_json(tmp_path / "10-a.conflist", conflist(name="a"))
    d = ConfigDir(str(tmp_path))
    assert d.current().name == "a"
    with open(path, "w") as f:  # same inode, new size
        json.dump(conflist(name="abc"), f)
    assert d.current().name == "abc"


def test_request_config_adds_name_version_and_declared_capabilities_only() -> None:
    net = parse_network(
        conflist(
            cniVersion="1.1.0",
            plugins=[
                BRIDGE | {"cni.dev/secret": 1},
                {"type": "portmap", "capabilities": {"portMappings": True, "bandwidth": False}, "snat": True},
            ],
        ),
        "x",
    )
    args = {"portMappings": [{"hostPort": 1, "containerPort": 2, "protocol": "tcp"}], "bandwidth": {"x": 1}}
    prev = {"cniVersion": "1.1.0", "ips": []}
    first = request_config(net, net.plugins[0], runtime_args=args)
    assert first == BRIDGE | {"cniVersion": "1.1.0", "name": "net1"}
    second = request_config(net, net.plugins[1], prev_result=prev, runtime_args=args)
    assert second == {
        "type": "portmap",
        "snat": True,
        "cniVersion": "1.1.0",
        "name": "net1",
        "runtimeConfig": {"portMappings": args["portMappings"]},
        "prevResult": prev,
    }
