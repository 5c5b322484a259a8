"""backends.cni.pods: a pod sandbox config as the CNI sees it, the [cni] table, and ADD/DEL by pod."""

from __future__ import annotations

import os
from typing import Any

import pytest

from backends.cni import Bandwidth, PluginError
from backends.cni.pods import CniPodNetwork, attachment, bandwidth, pod_network, quantity, settings_from
from backends.contract.errors import InternalError, InvalidArgumentError
from cri_api import api_pb2 as pb
from tests.cni.conftest import Env

SID = "a" * 64


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10M", 10_000_000),
        ("1.5Gi", 3 * 2**29),
        ("100k", 100_000),
        ("1e6", 1_000_000),
        ("1E3", 1000),
        ("2E", 2 * 10**18),
        ("1500m", 2),  # rounded up, as Quantity.Value()
        (" 7 ", 7),
    ],
)
def test_quantities(text: str, value: int) -> None:
    assert quantity(text) == value


@pytest.mark.parametrize("text", ["", "M", "10 M", "1.2.3", "10Mb", "0x10", "1e"])
def test_not_quantities(text: str) -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        quantity(text)


def test_bandwidth_from_the_annotations() -> None:
    assert bandwidth({"other": "1"}) is None
    assert bandwidth({"kubernetes.io/ingress-bandwidth": "10M"}) == Bandwidth(
        ingress_rate=10_000_000, ingress_burst=2**31 - 1
    )
    both = bandwidth({"kubernetes.io/ingress-bandwidth": "1k", "kubernetes.io/egress-bandwidth": "1P"})
    assert both == Bandwidth(1000, 2**31 - 1, 10**15, 2**31 - 1)


@pytest.mark.parametrize(
    ("value", "message"), [("999", "out of range"), ("2P", "out of range"), ("fast", "not a quantity")]
)
def test_bad_bandwidth_annotations_are_invalid(value: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"kubernetes.io/egress-bandwidth: .*{message}"):
        bandwidth({"kubernetes.io/egress-bandwidth": value})


def test_a_pod_config_as_an_attachment() -> None:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web", namespace="shop", uid="u-1"),
        port_mappings=[
            pb.PortMapping(protocol=pb.UDP, container_port=53, host_port=5353, host_ip="127.0.0.1"),
            pb.PortMapping(container_port=80),  # no host port: nothing to publish
            pb.PortMapping(protocol=pb.SCTP, container_port=0, host_port=9),  # no container port
        ],
        annotations={"kubernetes.io/ingress-bandwidth": "1M"},
        dns_config=pb.DNSConfig(servers=["10.96.0.10"], searches=["shop.svc"], options=["ndots:5"]),
    )
    att = attachment(SID, "/run/netns/x", config)
    assert att.cni_args() == (
        f"IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID={SID};K8S_POD_UID=u-1"
    )
    assert (att.container_id, att.netns, att.ifname) == (SID, "/run/netns/x", "eth0")
    assert att.runtime_args(("10.244.1.0/24",)) == {
        "portMappings": [{"hostPort": 5353, "containerPort": 53, "protocol": "udp", "hostIP": "127.0.0.1"}],
        "bandwidth": {"ingressRate": 1_000_000, "ingressBurst": 2**31 - 1},
        "ipRanges": [[{"subnet": "10.244.1.0/24"}]],
        "dns": {"servers": ["10.96.0.10"], "searches": ["shop.svc"], "options": ["ndots:5"]},
    }
    bare = attachment(SID, "/run/netns/x", pb.PodSandboxConfig())
    assert bare.runtime_args() == {}


def test_pod_network_choice() -> None:
    assert pod_network("d", {}) == "builtin"
    assert pod_network("d", {"pod_network": "cni"}) == "cni"
    with pytest.raises(InvalidArgumentError, match=r"\[handlers.d\] pod_network: 'calico'"):
        pod_network("d", {"pod_network": "calico"})


def test_settings_from_the_cni_table() -> None:
    s = settings_from("docker", {"conf_dir": "/n", "bin_dirs": ["/b"], "plugin_timeout": 3}, "/state")
    assert (s.conf_dir, s.bin_dirs, s.plugin_timeout) == ("/n", ("/b",), 3.0)
    # One cache per handler: a handler's recovery releases what its cache holds and no pod has.
    assert s.cache_dir == "/state/cni/docker"
    assert settings_from("runv", {"cache_dir": "/c"}).cache_dir == "/c/runv"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"conf_dri": "/x"}, r"\[cni\] unknown key 'conf_dri'"),
        ({"bin_dirs": "/usr/lib/cni"}, r"\[cni\] bin_dirs: expected a list of strings"),
        ({"bin_dirs": []}, r"\[cni\] bin_dirs: needs at least one"),
        ({"plugin_timeout": 0}, r"\[cni\] plugin_timeout: must be more than 0"),
        ({}, r"\[cni\] cache_dir: not set"),
    ],
)
def test_settings_errors_name_the_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        settings_from("docker", table)


def network(env: Env, *plugins: dict[str, Any]) -> CniPodNetwork:
    env.write({"cniVersion": "1.0.0", "name": "net1", "plugins": list(plugins)})
    return CniPodNetwork(
        settings_from("h", {"conf_dir": str(env.conf_dir), "bin_dirs": [str(env.bin_dir)]}, str(env.root))
    )


async def test_add_gives_the_pod_addresses_ipv4_first(env: Env) -> None:
    env.plugins("main")
    result = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "sandbox": "/proc/self/ns/net"}, {"name": "br0"}],
        "ips": [
            {"address": "fd00::5/64", "interface": 0},
            {"address": "10.9.0.9/24", "interface": 1},  # the host's side: not the pod's
            {"address": "10.88.0.5/24", "interface": 0},
        ],
    }
    pods = network(env, env.plugin("main", ADD={"result": result}))
    got = await pods.add(SID, "/proc/self/ns/net", pb.PodSandboxConfig())
    assert (got.ip, got.additional_ips) == ("10.88.0.5", ("fd00::5",))
    assert os.listdir(env.root / "cni" / "h" / "net1") == [SID]
    await pods.delete(SID)
    await pods.delete(SID)
    assert [c["env"]["CNI_COMMAND"] for c in env.calls()] == ["ADD", "DEL"]


async def test_a_result_with_no_pod_address_is_an_error(env: Env) -> None:
    env.plugins("main")
    result = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/x"}], "ips": []}
    pods = network(env, env.plugin("main", ADD={"result": result}))
    with pytest.raises(InternalError, match="net1: the ADD result gives eth0 no address"):
        await pods.add(SID, "/proc/self/ns/net", pb.PodSandboxConfig())


async def test_release_all_but_dels_the_others_and_asks_no_plugin_gc(env: Env) -> None:
    env.plugins("main")
    pods = network(env, env.plugin("main"))
    env.write({"cniVersion": "1.1.0", "name": "net1", "plugins": [env.plugin("main")]})
    for sid in ("b" * 64, "c" * 64):
        await pods.add(sid, "/proc/self/ns/net", pb.PodSandboxConfig())
    await pods.release_all_but(["b" * 64])
    calls = [(c["env"]["CNI_COMMAND"], c["env"].get("CNI_CONTAINERID")) for c in env.calls()]
    assert calls[2:] == [("DEL", "c" * 64)]


async def test_a_failing_del_is_raised(env: Env) -> None:
    env.plugins("main")
    pods = network(env, env.plugin("main", DEL={"error": {"code": 11, "msg": "busy"}}))
    await pods.add(SID, "/proc/self/ns/net", pb.PodSandboxConfig())
    with pytest.raises(PluginError, match=r"main DEL failed \(code 11\): busy"):
        await pods.delete(SID)
