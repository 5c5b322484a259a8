"""A pod VM on the node's CNI network (``pod_network = "cni"``), in Kata's "tcfilter" model.

The VM process has a network namespace of its own (``VMSpec.own_netns``: the stub's VM is one;
QEMU is started in one, with its tap in it). RunPodSandbox pins that namespace and ADDs it
(:mod:`backends.cni.pinned`, as docker does its pause process's): the plugins make ``eth0``
there with the pod's addresses, routes and MTU, and publish its host ports (``portmap``; runv's
own DNAT is not used). The stub's guest is that namespace, so nothing is left to do. QEMU's tap
is redirected to ``eth0`` and back (:meth:`~backends.runv.drivers.qemu.QemuHypervisor.join_interface`),
and the agent gives the guest's NIC what the plugins gave ``eth0``: its MAC, MTU, global
addresses and the routes they added, read from the namespace (as Kata reads it) rather than
from the result, so that what a plugin did beyond its result is there too.

Stop, remove, a failed RunPodSandbox and recovery release it through the same
:class:`~backends.cni.pinned.CniPods` (sandbox.py, recovery.py).
"""

from __future__ import annotations

import json
from typing import Any

from backends import contract
from backends.cni.pinned import NETNS
from backends.cni.pods import IFNAME
from backends.contract import errors
from backends.runv import host
from backends.runv.agent import messages as m

from .context import Shared
from .state import Pod


async def attach(shared: Shared, sandbox: contract.SandboxRecord, pod: Pod) -> contract.SandboxNetwork:
    """ADD the pod's VM; on failure the caller releases (``CniPods.release``)."""
    assert shared.cni is not None
    vm = pod.vm
    if not vm.own_netns:  # pinning the VM process's namespace would pin the host's
        raise errors.InternalError(f"VM {vm.id} has no network namespace of its own for CNI")
    net = await shared.cni.attach(sandbox, vm.pid)
    netns = str(sandbox.backend_data[NETNS])
    guest_if = await shared.hv.join_interface(vm, netns, IFNAME)
    if guest_if:
        request = await guest_network(shared.net.ip_cmd, netns, IFNAME, guest_if)
        await shared.agent(pod).call(request)
    return net


async def _ip_json(ip: str, netns: str, *args: str) -> list[dict[str, Any]]:
    argv = ("nsenter", f"--net={netns}", ip, "-j", *args)
    out = await host.must(f"cannot read the pod's network in {netns}", *argv)
    try:
        data = json.loads(out or "[]")
    except ValueError:
        raise errors.InternalError(f"`{' '.join(argv)}` printed no JSON: {out[:200]}") from None
    if not isinstance(data, list):
        raise errors.InternalError(f"`{' '.join(argv)}` printed no list: {out[:200]}")
    return [d for d in data if isinstance(d, dict)]


async def guest_network(ip: str, netns: str, ifname: str, guest_if: str) -> m.NetworkRequest:
    """The agent's ``network`` request that gives ``guest_if`` (named ``ifname`` in the guest)
    the configuration of ``ifname`` in ``netns``."""
    links = await _ip_json(ip, netns, "addr", "show", "dev", ifname)
    link = links[0] if links else {}
    infos = [a for a in link.get("addr_info", []) if a.get("scope") == "global"]
    infos.sort(key=lambda a: a.get("family") != "inet")  # IPv4 first, as the pod IP is
    addresses = [f"{a['local']}/{a['prefixlen']}" for a in infos]
    if not addresses:
        raise errors.InternalError(f"the CNI plugins gave {ifname} in {netns} no address")
    routes = []
    for family in ("-4", "-6"):
        for r in await _ip_json(ip, netns, family, "route", "show", "dev", ifname):
            # The kernel's own (the subnet of an address) come again with the address.
            if r.get("protocol") == "kernel" or r.get("type", "unicast") != "unicast" or "dst" not in r:
                continue
            routes.append(m.Route(destination=str(r["dst"]), via=str(r.get("gateway", ""))))
    return m.NetworkRequest(
        interface=guest_if,
        name=ifname,
        address=addresses[0],
        more_addresses=addresses[1:],
        mtu=int(link.get("mtu", 0)),
        mac=str(link.get("address", "")),
        routes=routes,
    )
