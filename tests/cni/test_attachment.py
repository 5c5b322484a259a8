"""An attachment's CNI_ARGS and capability arguments, and what it refuses."""

from __future__ import annotations

import pytest

from backends.cni import Attachment, Bandwidth, DnsArgs, IpRange, PortMapping
from backends.contract.errors import InvalidArgumentError


def test_cni_args_are_the_kubelets() -> None:
    att = Attachment("abc", "/run/netns/x", pod_namespace="kube-system", pod_name="dns", pod_uid="u-1")
    assert att.cni_args() == (
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1"
    )
    bare = Attachment("abc", "/run/netns/x", extra_args=(("IP", "10.1.0.9/24"),))
    assert bare.cni_args() == "IgnoreUnknown=1;K8S_POD_INFRA_CONTAINER_ID=abc;IP=10.1.0.9/24"


def test_capability_arguments_follow_the_conventions() -> None:
    att = Attachment(
        "abc",
        "/run/netns/x",
        port_mappings=(
            PortMapping(8080, 80, "TCP", "127.0.0.1"),
            PortMapping(0, 53, "udp"),
            PortMapping(53, 53, "udp"),
        ),
        bandwidth=Bandwidth(ingress_rate=1000, ingress_burst=2000),
        dns=DnsArgs(servers=("10.96.0.10",), searches=("svc.cluster.local",), options=("ndots:5",)),
    )
    assert att.runtime_args(("10.244.1.0/24", "fd00:1::/64")) == {
        "portMappings": [
            {"hostPort": 8080, "containerPort": 80, "protocol": "tcp", "hostIP": "127.0.0.1"},
            {"hostPort": 53, "containerPort": 53, "protocol": "udp"},
        ],
        "bandwidth": {"ingressRate": 1000, "ingressBurst": 2000},
        "ipRanges": [[{"subnet": "10.244.1.0/24"}], [{"subnet": "fd00:1::/64"}]],
        "dns": {"servers": ["10.96.0.10"], "searches": ["svc.cluster.local"], "options": ["ndots:5"]},
    }


def test_explicit_ip_ranges_win_over_the_pod_cidrs() -> None:
    att = Attachment(
        "abc", "/run/netns/x", ip_ranges=((IpRange("10.5.0.0/16", "10.5.0.10", "10.5.0.20", "10.5.0.1"),),)
    )
    assert att.runtime_args(("10.244.1.0/24",)) == {
        "ipRanges": [
            [
                {
                    "subnet": "10.5.0.0/16",
                    "rangeStart": "10.5.0.10",
                    "rangeEnd": "10.5.0.20",
                    "gateway": "10.5.0.1",
                }
            ]
        ]
    }
    assert Attachment("abc", "/run/netns/x").runtime_args() == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"container_id": ""},
        {"container_id": "-abc"},
        {"container_id": "a/b"},
        {"ifname": ""},
        {"ifname": "a" * 16},
        {"ifname": ".."},
        {"ifname": "eth:0"},
        {"ifname": "eth 0"},
        {"pod_name": "a;b"},
        {"extra_args": (("K", "v=w"),)},
    ],
    ids=[
        "empty-id",
        "id-dash",
        "id-slash",
        "empty-if",
        "long-if",
        "dotdot-if",
        "colon-if",
        "space-if",
        "semicolon",
        "equals",
    ],
)
def test_invalid_attachments_are_refused(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"container_id": "abc", "netns": "/run/netns/x"} | kwargs
    with pytest.raises(InvalidArgumentError):
        Attachment(**fields)  # type: ignore[arg-type]
