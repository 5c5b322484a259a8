"""The client with Debian's CNI plugins (loopback, bridge, host-local, portmap) in namespaces of our own.

Everything is made here and removed after (tests/cni/realnet.py): network namespaces
``cnitest-<rand>-N``, a bridge ``cnitest0-<rand>``, a subnet in 10.250.0.0/16 used only on that
bridge (no gateway on the host, no routes out), host-local's store under tmp, and the iptables
chains portmap adds. Traffic goes only between our namespaces.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.cni import (
    Attachment,
    CniClient,
    CniSettings,
    PluginError,
    PluginTimeoutError,
    PortMapping,
)
from tests.cni import fakeplugin
from tests.cni.conftest import REAL_MARKER
from tests.cni.realnet import PLUGIN_DIR, Net, own_network, run, why_not

pytestmark = [getattr(pytest.mark, REAL_MARKER), pytest.mark.skipif(bool(why_not()), reason=why_not())]


class Host(Net):
    def client(self, **settings: Any) -> CniClient:
        base: dict[str, Any] = {
            "conf_dir": str(self.conf_dir),
            "bin_dirs": (str(self.bin_dir), PLUGIN_DIR),
            "cache_dir": str(self.root / "cache"),
            "plugin_timeout": 30.0,
        }
        return CniClient(CniSettings(**(base | settings)))


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    with own_network(tmp_path, "cnitest", 250, Host) as net:
        yield net


def exchange(server_ns: str, server_ip: str, client_ns: str) -> str:
    """A TCP round trip from one namespace to the other: what the client got back."""
    serve = (
        "import socket\n"
        "s = socket.socket()\n"
        f"s.bind(({server_ip!r}, 7777))\n"
        "s.listen(1)\n"
        "s.settimeout(30)\n"
        "print('ready', flush=True)\n"
        "c, _ = s.accept()\n"
        "c.sendall(c.recv(64)[::-1])\n"
        "c.close()\n"
    )
    ask = (
        "import socket\n"
        f"s = socket.create_connection(({server_ip!r}, 7777), timeout=10)\n"
        "s.sendall(b'ping')\n"
        "print(s.recv(64).decode())\n"
    )
    with subprocess.Popen(
        ["ip", "netns", "exec", os.path.basename(server_ns), sys.executable, "-c", serve],
        stdout=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            return run("ip", "netns", "exec", os.path.basename(client_ns), sys.executable, "-c", ask).strip()
        finally:
            server.kill()


async def test_pods_get_addresses_reach_each_other_and_del_frees_everything(host: Host) -> None:
    host.write_conflist()
    client = host.client()
    assert (await client.readiness()).ready
    ns1, ns2 = host.netns(), host.netns()
    pod1 = Attachment(
        f"pod1{host.rand}",
        ns1,
        pod_namespace="default",
        pod_name="one",
        pod_uid="u1",
        port_mappings=(PortMapping(31000 + secrets.randbelow(1000), 80),),
    )
    pod2 = Attachment(f"pod2{host.rand}", ns2, pod_namespace="default", pod_name="two", pod_uid="u2")

    r1 = await client.add(pod1)
    r2 = await client.add(pod2)
    ip1, ip2 = (r.pod_addresses("eth0").ipv4 for r in (r1, r2))
    assert ip1 in host.subnet and ip2 in host.subnet and ip1 != ip2
    assert host.addresses(ns1) == [f"{ip1}/24"]
    assert host.reserved() == {str(ip1): pod1.container_id, str(ip2): pod2.container_id}
    assert len(host.ports()) == 2
    assert any(f'id: \\"{pod1.container_id}\\"' in line for _, _, line in host.iptables())

    assert exchange(ns2, str(ip2), ns1) == "gnip"
    assert exchange(ns1, str(ip1), ns2) == "gnip"

    await client.delete(pod1)
    assert host.reserved() == {str(ip2): pod2.container_id}
    assert len(host.ports()) == 1
    assert host.iptables() == set()  # pod2 maps no port
    await client.delete(pod1)  # again: nothing left to do
    assert client.cached_result(pod1.container_id) is None


async def test_del_after_the_config_was_removed_and_the_netns_is_gone(host: Host) -> None:
    conflist = host.write_conflist()
    ns = host.netns()
    pod = Attachment(
        f"pod3{host.rand}", ns, port_mappings=(PortMapping(32000 + secrets.randbelow(1000), 80),)
    )
    result = await host.client().add(pod)
    assert host.reserved() == {str(result.pod_addresses("eth0").ipv4): pod.container_id}
    conflist.unlink()
    run("ip", "netns", "del", os.path.basename(ns))
    host.namespaces.remove(os.path.basename(ns))
    restarted = host.client()
    assert not (await restarted.readiness()).ready
    await restarted.delete(pod)
    assert host.reserved() == {}
    assert host.ports() == []
    assert host.iptables() == set()


@pytest.mark.parametrize("how", ["fails", "hangs"])
async def test_a_chained_plugin_that_fails_or_hangs_leaves_nothing(host: Host, how: str) -> None:
    fakeplugin.install(host.bin_dir, "breaker")
    pids = host.root / "pids"
    action = {"fails": {"error": {"code": 7, "msg": "refused"}}, "hangs": {"hang": str(pids)}}[how]
    host.write_conflist({"type": "breaker", "fake": {"ADD": action}})
    ns = host.netns()
    pod = Attachment(
        f"pod4{host.rand}", ns, port_mappings=(PortMapping(33000 + secrets.randbelow(1000), 80),)
    )
    client = host.client(plugin_timeout=5.0)
    with pytest.raises(PluginTimeoutError if how == "hangs" else PluginError, match="breaker ADD"):
        await client.add(pod)
    if how == "hangs":
        assert not any(fakeplugin.alive(int(pid)) for pid in pids.read_text().split())
    assert host.reserved() == {}
    assert host.ports() == []
    assert run("ip", "-n", os.path.basename(ns), "-o", "link").count(": eth0") == 0
    assert host.iptables() == set()
    assert client.cached_result(pod.container_id) is None
    assert not list((host.root / "cache").rglob("*.json"))
