"""A pod VM's place on the pod network: its IP, a veth from the bridge into the VM, its host
ports; made by RunPodSandbox (or ahead of it, for a warm VM) and undone by StopPodSandbox,
a failed RunPodSandbox and recovery. The host side (bridge, IPAM, rules) is
:mod:`backends.runv.network`.
"""

from __future__ import annotations

from typing import Any

from backends import contract
from backends.runv.agent import messages as m

from .context import Shared
from .state import Pod


async def plumb(shared: Shared, sandbox: contract.SandboxRecord, pod: Pod, ports: list[Any]) -> str:
    """Give the VM its pod IP on the bridge and publish its host ports; return the IP.

    A warm VM is wired already: its IP passes to the sandbox, and only the host
    ports are left to publish.
    """
    net = shared.net
    warm, pod.warm_net = pod.warm_net, None
    if warm is not None:
        ip = warm["ip"]
        net.transfer(ip, warm["holder"], sandbox.id)
    else:
        ip = net.allocate(sandbox.id)
    host_if, _peer = net.veth_names(pod.vm.id)
    # Recorded first: whatever exists of it is undone by unplumb, now or after a restart.
    sandbox.backend_data["net"] = {
        "ip": ip,
        "host_if": host_if,
        "bridge": net.bridge,
        "ports": [p.to_dict() for p in ports],
    }
    if warm is None:
        await wire(shared, pod, ip)
    await net.add_host_ports(sandbox.id, ip, ports)
    return ip


async def wire(shared: Shared, pod: Pod, ip: str) -> None:
    """A veth from the bridge into the VM, configured by the agent with ``ip``."""
    net = shared.net
    agent = shared.agent(pod)
    _host_if, peer = net.veth_names(pod.vm.id)
    await net.create_veth(pod.vm.id)
    guest_if = await shared.hv.attach_interface(pod.vm, peer)
    await agent.call(
        m.NetworkRequest(
            interface=guest_if,
            name="eth0",
            address=f"{ip}/{net.prefix}",
            gateway=net.gateway,
            mtu=net.mtu,
        )
    )


async def unplumb(shared: Shared, sandbox: contract.SandboxRecord) -> None:
    """Release the pod's network: host-port rules, veth, IP. Idempotent."""
    data = sandbox.backend_data.get("net")
    if not data:
        return
    await shared.net.remove_host_ports(sandbox.id)
    await shared.net.delete_veth(str(data.get("host_if", "")))
    shared.net.release(str(data.get("ip", "")), sandbox.id)
    sandbox.backend_data.pop("net", None)


async def unwire_warm(shared: Shared, pod: Pod) -> None:
    """Release what a warm VM's network held, if no sandbox took it."""
    warm, pod.warm_net = pod.warm_net, None
    if warm is not None:
        await shared.net.delete_veth(shared.net.veth_names(pod.vm.id)[0])
        shared.net.release(warm["ip"], warm["holder"])
