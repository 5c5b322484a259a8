"""Readiness for the runtime's Status, the config template with the pod CIDR, the cache's files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from backends.cni import NOT_READY, Attachment, ConfigError
from backends.cni.cache import AttachmentCache, CacheEntry
from backends.contract.errors import InvalidArgumentError
from tests.cni.conftest import Env

TEMPLATE = """{
  "cniVersion": "1.0.0",
  "name": "podnet",
  "plugins": [{
    "type": "bridge",
    "ipam": {"type": "host-local", "subnet": "{{ .PodCIDR }}",
             "ranges": {{.HostLocalRanges}}, "routes": {{.DefaultRoutes}}}
  }]
}"""


def network(env: Env, version: str = "1.0.0", **fake: object) -> dict[str, Any]:
    return {
        "cniVersion": version,
        "name": "net1",
        "plugins": [env.plugin("bridge", **fake) | {"ipam": {"type": "host-local"}}, env.plugin("portmap")],
    }


async def test_ready_with_a_valid_config_and_its_plugins(env: Env) -> None:
    env.plugins("bridge", "host-local", "portmap")
    env.write(network(env))
    ready = await env.client().readiness()
    assert (ready.ready, ready.reason, ready.message) == (True, "", "")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("nothing", "{conf}: no network config"),
        ("invalid", "{conf}/10-test.conflist: plugins: must be a non-empty list"),
        ("no-ipam", "CNI network net1 ({conf}/10-test.conflist): plugin host-local not found in {bin}"),
        ("no-plugins", "plugin bridge, host-local, portmap not found in {bin}"),
    ],
    ids=["no-config", "invalid-config", "ipam-missing", "plugins-missing"],
)
async def test_not_ready_names_the_directory_and_why(env: Env, setup: str, message: str) -> None:
    if setup == "invalid":
        env.write({"cniVersion": "1.0.0", "name": "net1", "plugins": []})
    elif setup != "nothing":
        env.write(network(env))
        env.plugins(*{"no-ipam": ["bridge", "portmap"], "no-plugins": []}[setup])
    ready = await env.client().readiness()
    assert (ready.ready, ready.reason) == (False, NOT_READY)
    assert message.format(conf=env.conf_dir, bin=env.bin_dir) in ready.message


async def test_not_ready_when_a_1_1_0_plugin_says_so(env: Env) -> None:
    env.plugins("bridge", "host-local", "portmap")
    env.write(network(env, "1.1.0", STATUS={"error": {"code": 50, "msg": "IPAM exhausted"}}))
    ready = await env.client().readiness()
    assert (ready.ready, ready.reason) == (False, NOT_READY)
    assert "bridge STATUS failed (code 50): IPAM exhausted" in ready.message


async def test_the_template_is_rendered_with_the_pod_cidrs(env: Env, tmp_path: Path) -> None:
    template = tmp_path / "template.json"
    template.write_text(TEMPLATE)
    client = env.client(conf_template=str(template))
    ready = await client.readiness()
    assert not ready.ready and f"the template {template} waits for the pod CIDR" in ready.message
    client.set_pod_cidr("10.244.1.0/24, fd00:1::/64")
    out = env.conf_dir / "10-cri-shim-net.conflist"
    ipam = json.loads(out.read_text())["plugins"][0]["ipam"]
    assert ipam == {
        "type": "host-local",
        "subnet": "10.244.1.0/24",
        "ranges": [[{"subnet": "10.244.1.0/24"}], [{"subnet": "fd00:1::/64"}]],
        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
    }
    assert client.network().name == "podnet"
    stamp = out.stat().st_mtime_ns, out.stat().st_ino
    client.set_pod_cidr("10.244.1.0/24,fd00:1::/64")  # the same: not rewritten
    assert (out.stat().st_mtime_ns, out.stat().st_ino) == stamp
    client.set_pod_cidr("10.245.0.0/24")
    assert client.network().plugins[0].raw["ipam"]["subnet"] == "10.245.0.0/24"
    assert [p.name for p in env.conf_dir.iterdir()] == ["10-cri-shim-net.conflist"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"subnet": "{{.PodSubnet}}"}', "{{.PodSubnet}}: unknown placeholder"),
        ('{"subnet": {{.PodCIDR}}}', "not JSON"),
        ('{"name": "x", "cniVersion": "1.0.0", "subnet": "{{.PodCIDR}}"}', "(rendered): type: missing"),
    ],
    ids=["unknown-placeholder", "not-json", "not-a-network"],
)
def test_a_bad_template_is_named(env: Env, tmp_path: Path, text: str, problem: str) -> None:
    template = tmp_path / "template.json"
    template.write_text(text)
    with pytest.raises(ConfigError) as info:
        env.client(conf_template=str(template)).set_pod_cidr("10.244.1.0/24")
    assert info.value.message.startswith(str(template))
    assert problem in info.value.message
    assert not env.conf_dir.exists()


async def test_a_template_mended_after_the_pod_cidr_came_is_rendered_without_a_new_cidr(
    env: Env, tmp_path: Path
) -> None:
    env.plugins("bridge", "host-local", "portmap")
    template = tmp_path / "template.json"
    template.write_text('{"subnet": {{.PodCIDR}}}')
    client = env.client(conf_template=str(template))
    with pytest.raises(ConfigError):
        client.set_pod_cidr("10.244.1.0/24")
    ready = await client.readiness()
    assert not ready.ready and f"the template could not be rendered: {template}" in ready.message
    assert "not JSON" in ready.message
    template.write_text(TEMPLATE)
    assert (await client.readiness()).ready
    assert client.network().plugins[0].raw["ipam"]["subnet"] == "10.244.1.0/24"


def test_a_pod_cidr_that_is_no_network_is_refused(env: Env) -> None:
    with pytest.raises(InvalidArgumentError, match=r"'10\.244\.1\.0/33'"):
        env.client().set_pod_cidr("10.244.1.0/33")


async def test_the_pod_cidrs_reach_plugins_declaring_ip_ranges(env: Env) -> None:
    env.plugins("bridge", "host-local")
    net = network(env)
    net["plugins"] = [net["plugins"][0] | {"capabilities": {"ipRanges": True}}]
    env.write(net)
    client = env.client()
    client.set_pod_cidr("10.244.1.0/24")
    await client.add(Attachment("abc", "/proc/self/ns/net"))
    assert env.calls()[0]["stdin"]["runtimeConfig"] == {"ipRanges": [[{"subnet": "10.244.1.0/24"}]]}


def test_cache_entries_are_found_by_container_and_unreadable_ones_skipped(tmp_path: Path) -> None:
    cache = AttachmentCache(str(tmp_path))
    entry = CacheEntry("net1", "c1", "eth0", "/run/netns/x", "IgnoreUnknown=1", {}, {"name": "net1"}, None)
    cache.write(entry)
    cache.write(CacheEntry("net2", "c1", "eth1", "", "", {}, {}, {"ips": []}))
    cache.write(CacheEntry("net2", "c2", "eth0", "", "", {}, {}, None))
    (tmp_path / "net2" / "c2" / "eth9.json").write_text("{")
    assert cache.read("net1", "c1", "eth0") == entry
    assert [(e.network, e.container_id, e.ifname) for e in cache.entries("c1")] == [
        ("net1", "c1", "eth0"),
        ("net2", "c1", "eth1"),
    ]
    assert [e.ifname for e in cache.entries("c1", "eth1")] == ["eth1"]
    assert len(cache.entries()) == 3
    cache.remove(entry)
    assert not (tmp_path / "net1" / "c1").exists()
    assert cache.entries("c1", "eth0") == []
    assert not [n for n in os.listdir(tmp_path / "net2" / "c1") if n.endswith(".tmp")]
