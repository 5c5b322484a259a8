"""User namespaces in runv: a pod whose root is not the VM's root."""

from __future__ import annotations

import asyncio

from backends.contract import Capability
from backends.runv.backend import RunvBackend
from cri_api import api_pb2 as pb
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm

IMAGE = "test/busybox:1"


async def test_a_pod_in_its_own_user_namespace(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    assert backend.capabilities & Capability.USER_NAMESPACES
    sb = sandbox_record("userns")
    userns = sb.config.linux.security_context.namespace_options.userns_options
    userns.mode = pb.POD
    userns.uids.add(container_id=0, host_id=1000, length=100000)
    userns.gids.add(container_id=0, host_id=1000, length=100000)
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(
        sb, IMAGE, ["sh", "-c", "cat /proc/self/uid_map /proc/self/gid_map; id -u; sleep 60"]
    )
    await backend.lifecycle.create_container(ct, sb)
    sink = MemorySink()
    await events.start(backend.lifecycle, ct, sb, sink)
    for _ in range(50):
        if sink.data["stdout"].count(b"\n") >= 3:
            break
        await asyncio.sleep(0.1)
    lines = [line.split() for line in bytes(sink.data["stdout"]).decode().splitlines()]
    assert lines[:3] == [["0", "1000", "100000"], ["0", "1000", "100000"], ["0"]], lines
    # An exec joins the same user namespace.
    res = await backend.exec.exec_sync(ct, ["cat", "/proc/self/uid_map"])
    assert res.stdout.split() == [b"0", b"1000", b"100000"]
    await backend.lifecycle.stop_container(ct, 1)
    await backend.lifecycle.remove_container(ct)
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
