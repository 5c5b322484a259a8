# ruff: noqa: ASYNC230
# The agent owns its VM: small local file writes are not worth a thread hop here.
"""The VM as a whole: hello, setup (hostname, DNS, sysctls), a hot-plugged NIC, shutdown."""

from __future__ import annotations

import os
import socket

from backends.runv.agent import containers, proc
from backends.runv.agent.guest import Guest
from backends.runv.agent.messages import (
    Empty,
    Hello,
    HelloRequest,
    NetworkRequest,
    NetworkResult,
    SetupRequest,
    ShutdownRequest,
)
from backends.runv.agent.protocol import AgentError

# Of the operations (2: stamped, resumable output; 3: Mount.options applied; 4: checkpoint,
# thaw, restore_prepare of agent/criu.py); the frame's version
# byte is protocol.VERSION.
VERSION = 4


async def hello(g: Guest, req: HelloRequest) -> Hello:
    return Hello(version=VERSION, pid=os.getpid(), containers=len(g.containers))


async def setup(g: Guest, req: SetupRequest) -> Empty:
    os.makedirs(g.etc_dir, exist_ok=True)
    hostname = req.hostname or socket.gethostname()
    proc.sethostname(hostname)
    with open(os.path.join(g.etc_dir, "hostname"), "w") as fh:
        fh.write(hostname + "\n")
    with open(os.path.join(g.etc_dir, "hosts"), "w") as fh:
        fh.write(f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n")
    dns = req.dns
    lines = [f"nameserver {s}" for s in dns.servers]
    if dns.searches:
        lines.append("search " + " ".join(dns.searches))
    if dns.options:
        lines.append("options " + " ".join(dns.options))
    with open(os.path.join(g.etc_dir, "resolv.conf"), "w") as fh:
        fh.write("".join(line + "\n" for line in lines))
    code, _, err = await proc.run(g.reaper, ["ip", "link", "set", "lo", "up"])
    if code != 0:
        raise AgentError("failed", f"loopback up: {err.decode(errors='replace')}")
    for key, value in req.sysctls.items():
        path = "/proc/sys/" + key.replace(".", "/")
        try:
            with open(path, "w") as fh:
                fh.write(value)
        except OSError as exc:
            raise AgentError("invalid", f"sysctl {key}: {exc.strerror}") from None
    return Empty()


async def network(g: Guest, req: NetworkRequest) -> NetworkResult:
    """Configure a NIC the host hot-plugged: rename, MAC, MTU, addresses, up, routes."""
    name = req.name or req.interface
    steps = []
    if name != req.interface:
        steps.append(["ip", "link", "set", "dev", req.interface, "name", name])
    if req.mac:
        steps.append(["ip", "link", "set", "dev", name, "address", req.mac])
    if req.mtu:
        steps.append(["ip", "link", "set", "dev", name, "mtu", str(req.mtu)])
    steps += [["ip", "addr", "replace", a, "dev", name] for a in (req.address, *req.more_addresses)]
    steps.append(["ip", "link", "set", "dev", name, "up"])
    if req.gateway:
        steps.append(["ip", "route", "replace", "default", "via", req.gateway, "dev", name])
    for r in req.routes:
        via = ["via", r.via] if r.via else []
        family = ["-6"] if ":" in r.destination + r.via else []  # "default" names no family
        steps.append(["ip", *family, "route", "replace", r.destination, *via, "dev", name])
    for argv in steps:
        await g.run(argv)
    return NetworkResult(name=name)


async def shutdown(g: Guest, req: ShutdownRequest) -> Empty:
    containers.kill_all(g)
    g.stopping.set()
    return Empty()
