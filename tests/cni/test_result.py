"""Results of every supported version read into one type; the pod's addresses picked from them."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from backends.cni import DNS, Interface, IPConfig, Route
from backends.cni.result import parse_result

NETNS = "/run/netns/pod"
HOST_IFACES = [{"name": "cni0", "mac": "00:11:22:33:44:55"}, {"name": "veth1", "mac": "55:44:33:22:11:11"}]
POD_IFACE = {"name": "eth0", "mac": "99:88:77:66:55:44", "sandbox": NETNS}


def old_style(version: str) -> dict[str, Any]:
    """0.3.x / 0.4.0: every IP says its version."""
    return {
        "cniVersion": version,
        "interfaces": [*HOST_IFACES, POD_IFACE],
        "ips": [
            {"version": "4", "address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 2},
            {"version": "6", "address": "fd00::5/64", "gateway": "fd00::1", "interface": 2},
        ],
        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0", "gw": "fd00::1"}],
        "dns": {
            "nameservers": ["10.1.0.1"],
            "domain": "cluster.local",
            "search": ["a.b"],
            "options": ["ndots:5"],
        },
    }


def new_style(version: str) -> dict[str, Any]:
    result = old_style(version)
    for ip in result["ips"]:
        del ip["version"]
    return result


EXPECTED_IPS = (
    IPConfig(ipaddress.ip_interface("10.1.0.5/16"), ipaddress.ip_address("10.1.0.1"), 2),
    IPConfig(ipaddress.ip_interface("fd00::5/64"), ipaddress.ip_address("fd00::1"), 2),
)


@pytest.mark.parametrize(
    "raw",
    [old_style("0.3.0"), old_style("0.3.1"), old_style("0.4.0"), new_style("1.0.0"), new_style("1.1.0")],
    ids=["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
)
def test_every_version_reads_the_same(raw: dict[str, Any]) -> None:
    result = parse_result(raw, "1.0.0")
    assert result.cni_version == raw["cniVersion"]
    assert result.interfaces == (
        Interface("cni0", "00:11:22:33:44:55"),
        Interface("veth1", "55:44:33:22:11:11"),
        Interface("eth0", "99:88:77:66:55:44", sandbox=NETNS),
    )
    assert result.ips == EXPECTED_IPS
    assert result.routes == (
        Route(ipaddress.ip_network("0.0.0.0/0")),
        Route(ipaddress.ip_network("::/0"), ipaddress.ip_address("fd00::1")),
    )
    assert result.dns == DNS(("10.1.0.1",), "cluster.local", ("a.b",), ("ndots:5",))
    assert result.raw is raw
    assert [str(ip) for ip in result.pod_addresses("eth0").ordered()] == ["10.1.0.5", "fd00::5"]


def test_the_fields_of_1_1_0_are_read() -> None:
    raw = new_style("1.1.0")
    raw["interfaces"][2] |= {"mtu": 1450, "socketPath": "/run/x.sock", "pciID": "0000:04:00.5"}
    raw["routes"][0] |= {"mtu": 1400, "advmss": 1360, "priority": 10, "table": 100, "scope": 0}
    result = parse_result(raw, "1.1.0")
    assert result.interfaces[2] == Interface(
        "eth0", "99:88:77:66:55:44", 1450, NETNS, "/run/x.sock", "0000:04:00.5"
    )
    assert result.routes[0] == Route(ipaddress.ip_network("0.0.0.0/0"), None, 1400, 1360, 10, 100, 0)


def test_a_result_without_cni_version_takes_the_configs() -> None:
    raw = new_style("1.0.0")
    del raw["cniVersion"]
    assert parse_result(raw, "0.4.0").cni_version == "0.4.0"


def test_ipam_style_result_without_interfaces_gives_all_ips() -> None:
    raw = {"cniVersion": "1.0.0", "ips": [{"address": "fd00::7/64"}, {"address": "10.2.0.7/24"}]}
    addresses = parse_result(raw, "1.0.0").pod_addresses("eth0")
    assert (str(addresses.ipv4), str(addresses.ipv6)) == ("10.2.0.7", "fd00::7")


def test_only_the_pod_interface_ips_are_the_pods() -> None:
    raw = new_style("1.0.0")
    raw["ips"] = [
        {"address": "192.168.9.1/24", "interface": 0},  # on the host's bridge
        {"address": "10.1.0.9/16", "interface": 1},  # a host interface named like nothing in the pod
        {"address": "10.1.0.5/16", "interface": 2},
    ]
    raw["interfaces"].append({"name": "net1", "sandbox": NETNS})
    raw["ips"].append({"address": "10.3.0.5/16", "interface": 3})
    result = parse_result(raw, "1.0.0")
    assert result.pod_addresses("eth0").ordered() == (ipaddress.ip_address("10.1.0.5"),)
    assert result.pod_addresses("net1").ordered() == (ipaddress.ip_address("10.3.0.5"),)
    assert result.pod_addresses("eth9").ordered() == ()


def test_eth0_on_the_host_is_not_the_pods() -> None:
    raw = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0"}],
        "ips": [{"address": "10.1.0.5/16", "interface": 0}],
    }
    assert parse_result(raw, "1.0.0").pod_addresses("eth0").ordered() == ()


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ([], "not a JSON object"),
        ({"cniVersion": "0.2.0", "ip4": {}}, "cniVersion '0.2.0'"),
        ({"ips": [{"address": "10.1.0.5"}], "cniVersion": "1.0.0"}, "ips[0].address"),
        ({"ips": [{"address": "10.1.0.5/16", "interface": 0}]}, "ips[0].interface 0"),
        ({"ips": [{"address": "10.1.0.5/16", "gateway": "x"}]}, "ips[0].gateway"),
        ({"ips": {"address": "10.1.0.5/16"}}, "ips is not a list"),
        ({"interfaces": [{"mac": "x"}]}, "interfaces[0].name is missing"),
        ({"interfaces": [{"name": "eth0", "mtu": -1}]}, "interfaces[0].mtu"),
        ({"routes": [{"dst": "nowhere"}]}, "routes[0].dst"),
        ({"dns": {"nameservers": "10.0.0.1"}}, "dns.nameservers"),
    ],
    ids=[
        "not-object",
        "old-version",
        "address-without-prefix",
        "interface-index-out-of-range",
        "bad-gateway",
        "ips-not-list",
        "interface-without-name",
        "negative-mtu",
        "bad-route",
        "nameservers-not-list",
    ],
)
def test_malformed_results_name_the_field(raw: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_result(raw, "1.0.0")
