"""The stub driver's VM template: cloned VMs are what unshare made, and outlive the template."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.linux import procfs
from backends.runv.backend import RunvBackend
from backends.runv.drivers.stub import StubHypervisor
from backends.runv.hypervisor import MIB, VM, BootError, Fault, VMSpec
from tests.runv.helpers import Events, container_record, needs_vm, sandbox_record

pytestmark = needs_vm

NAMESPACES = ("pid", "mnt", "uts", "ipc", "net")


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()


def _nspid(pid: int) -> list[int]:
    """The process's PID in each PID namespace it is in, the host's first."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return []


def _agent(vm: VM) -> int:
    kids = procfs.children(vm.pid)
    assert len(kids) == 1, f"the VM process should have one child, the agent: {kids}"
    return kids[0]


def _fd_targets(pid: int) -> set[str]:
    out = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            pass
    return out


async def _gone(pid: int) -> bool:
    """Whether ``pid`` leaves /proc altogether (reaped, not a zombie), within 10 s (a busy node)."""
    for _ in range(500):
        if not os.path.exists(f"/proc/{pid}"):
            return True
        await asyncio.sleep(0.02)
    return False


def _stub(runv_config: dict[str, Any], **more: Any) -> StubHypervisor:
    return StubHypervisor({**runv_config["stub"], "run_dir": runv_config["run_dir"], **more})


@pytest.fixture
async def stub(runv_config: dict[str, Any]) -> AsyncIterator[StubHypervisor]:
    hv = _stub(runv_config)
    try:
        yield hv
    finally:
        for vm in hv.leftovers(set()):
            await hv.destroy(vm)
        await hv.close()
        hv.tidy()


def _spec(host_network: bool = False) -> VMSpec:
    return VMSpec(id=uuid.uuid4().hex[:12], vcpus=1, memory_bytes=128 * MIB, host_network=host_network)


async def test_cloned_vm_is_what_unshare_made(stub: StubHypervisor) -> None:
    vm = await stub.create(_spec())
    assert stub.template is not None and stub.template.pid > 0
    agent = _agent(vm)
    # Cloned from the template, not booted by unshare.
    st = procfs.stat(vm.pid)
    assert st is not None and st.ppid == stub.template.pid
    assert (_comm(vm.pid), _comm(agent)) == ("runv-vm", "runv-agent")
    with open(f"/proc/{agent}/cmdline", "rb") as fh:
        assert fh.read().startswith(b"python\0-m\0backends.runv.agent\0--socket\0"), "ps shows the agent"
    for kind in NAMESPACES:
        assert _ns(agent, kind) != _ns(os.getpid(), kind), kind
        assert _ns(agent, kind) != _ns(stub.template.pid, kind), kind
    for kind in ("mnt", "uts", "ipc", "net"):  # the VM process lives in them (ip link ... netns PID)
        assert _ns(vm.pid, kind) == _ns(agent, kind), kind
    assert _nspid(agent)[-1] == 1  # PID 1 of the VM
    assert os.readlink(f"/proc/{vm.pid}/ns/pid_for_children") == _ns(agent, "pid")
    assert os.getsid(vm.pid) == vm.pid  # a session of its own
    pids = set(stub._cgroup(vm).pids())
    assert {vm.pid, agent} <= pids
    # /proc is the VM's own: the agent sees itself as PID 1 and no host process.
    with open(f"/proc/{agent}/root/proc/1/comm") as fh:  # through its root: its mount namespace
        assert fh.read().strip() == "runv-agent"
    # Its output goes to the console, and the template's pipes are not in the VM.
    template_pipes = {t for t in _fd_targets(stub.template.pid) if t.startswith("pipe:")}
    for pid in (vm.pid, agent):
        assert not template_pipes & _fd_targets(pid)
        assert os.readlink(f"/proc/{pid}/fd/1") == os.path.join(vm.state_dir, "console.log")
    await stub.destroy(vm)
    assert not stub.alive(vm)
    assert await _gone(vm.pid), "the template did not reap the VM process"
    assert await _gone(agent)


async def test_two_vms_share_nothing(stub: StubHypervisor) -> None:
    a, b = await asyncio.gather(stub.create(_spec()), stub.create(_spec()))
    agent_a, agent_b = _agent(a), _agent(b)
    for kind in NAMESPACES:
        assert _ns(agent_a, kind) != _ns(agent_b, kind), kind
    assert stub._cgroup(a).pids() != stub._cgroup(b).pids()
    # Pipes and sockets are named by inode; every epoll or signalfd is "anon_inode:[...]".
    shared = {t for t in _fd_targets(agent_a) & _fd_targets(agent_b) if t.startswith(("pipe:", "socket:"))}
    assert not shared, f"open files shared by two VMs: {shared}"
    for vm in (a, b):
        await stub.destroy(vm)


async def test_kill_of_vm_pid_takes_the_whole_vm(runv_config: dict[str, Any], busybox_rootfs: Path) -> None:
    backend = RunvBackend("runv", runv_config)
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir("test/busybox:1", str(busybox_rootfs), {})
    try:
        sb = sandbox_record("kill")
        await backend.lifecycle.run_sandbox(sb)
        vm = backend._shared.pods[sb.id].vm
        ct = container_record(sb, "test/busybox:1", ["sleep", "60"])
        await backend.lifecycle.create_container(ct, sb)
        await backend.lifecycle.start_container(ct, sb)
        cg = backend.hv._cgroup(vm)  # type: ignore[attr-defined]
        pids = set(cg.pids())
        assert len(pids) >= 3, pids  # VM process, agent, container
        os.kill(vm.pid, signal.SIGKILL)
        await asyncio.wait_for(backend.hv.wait(vm), 10)
        for pid in pids:
            assert await _gone(pid), f"process {pid} of the killed VM lives on"
    finally:
        await events.close()
        for pod in list(backend._shared.pods.values()):
            await backend.hv.destroy(pod.vm)
        await backend.lifecycle.close()


async def test_agent_death_ends_the_vm_process(stub: StubHypervisor) -> None:
    vm = await stub.create(_spec())
    os.kill(_agent(vm), signal.SIGKILL)
    await asyncio.wait_for(stub.wait(vm), 10)
    assert not stub.alive(vm)
    await stub.destroy(vm)


async def test_vm_outlives_its_template_and_a_new_one_serves(stub: StubHypervisor) -> None:
    vm = await stub.create(_spec())
    assert stub.template is not None
    old = stub.template.pid
    os.kill(old, signal.SIGKILL)
    assert await _gone(old)
    assert stub.alive(vm)
    _r, w = await asyncio.open_unix_connection(vm.channel)  # the agent still answers
    w.close()
    second = await stub.create(_spec())
    assert stub.template.pid not in (0, old)
    assert procfs.stat(second.pid).ppid == stub.template.pid  # type: ignore[union-attr]
    for v in (vm, second):
        await stub.destroy(v)
        assert not stub.alive(v)


async def test_adopted_after_the_driver_restarts(runv_config: dict[str, Any]) -> None:
    first = _stub(runv_config)
    vm = await first.create(_spec())
    await first.close()  # the shim goes: its template ends, the VM stays
    second = _stub(runv_config)
    try:
        found = {v.id: v for v in second.leftovers(set())}
        assert found[vm.id].pid == vm.pid
        assert await second.adopt(found[vm.id])
        await second.destroy(found[vm.id])
        assert not second.alive(vm)
    finally:
        await second.close()
        second.tidy()


async def test_boot_failure(stub: StubHypervisor) -> None:
    await stub.create(_spec())  # the template is up
    assert stub.template is not None
    pid = stub.template.pid
    stub.inject(Fault.BOOT_FAILURE)
    spec = _spec()
    with pytest.raises(BootError, match="injected boot failure"):
        await stub.create(spec)
    assert not os.path.exists(os.path.join(stub.run_dir, spec.id))
    assert stub.template.pid == pid  # a VM's failure is not the template's


async def test_host_network(stub: StubHypervisor) -> None:
    vm = await stub.create(_spec(host_network=True))
    agent = _agent(vm)
    assert _ns(agent, "net") == _ns(os.getpid(), "net")
    for kind in ("pid", "mnt", "uts", "ipc"):
        assert _ns(agent, kind) != _ns(os.getpid(), kind), kind
    await stub.destroy(vm)


async def test_disabled_boots_with_unshare(runv_config: dict[str, Any]) -> None:
    hv = _stub(runv_config, template=False)
    try:
        vm = await hv.create(_spec())
        assert hv.template is None
        assert _comm(vm.pid) == "unshare"
        await hv.destroy(vm)
    finally:
        await hv.close()
        hv.tidy()


async def test_falls_back_when_the_template_cannot_start(runv_config: dict[str, Any], tmp_path: Path) -> None:
    refusing = tmp_path / "python"
    refusing.write_text('#!/bin/sh\necho \'{"error": "unshare: Operation not permitted"}\'\n')
    refusing.chmod(0o755)
    hv = _stub(runv_config)
    assert hv.template is not None
    hv.template.python = str(refusing)
    try:
        vm = await hv.create(_spec())
        assert hv.template is None  # not tried again
        assert _comm(vm.pid) == "unshare"
        await hv.destroy(vm)
    finally:
        await hv.close()
        hv.tidy()


async def test_backend_start_brings_the_template_up_and_close_ends_it(runv_config: dict[str, Any]) -> None:
    backend = RunvBackend("runv", runv_config)
    await backend.lifecycle.start(Events())
    hv = backend.hv
    assert isinstance(hv, StubHypervisor) and hv.template is not None and hv._preparing is not None
    await hv._preparing
    pid = hv.template.pid
    assert pid > 0 and _comm(pid).startswith("python")
    await backend.lifecycle.close()
    assert hv.template.pid == 0
    assert await _gone(pid)
