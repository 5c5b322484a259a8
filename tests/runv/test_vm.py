"""The runv backend end to end through the stub driver: real VM processes, agent and runc."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.contract import TerminalSize
from backends.linux import procfs
from backends.runv import plumbing
from backends.runv.agent.messages import StateRequest
from backends.runv.backend import VM_CRASH_REASON, RunvBackend
from backends.runv.hypervisor import MIB, Fault
from cri_api import api_pb2 as pb
from shim.cri import errors
from tests.as_shim import AsShim
from tests.runv.helpers import Events, FakePort, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm

IMAGE = "test/busybox:1"


def _alive(pid: int) -> bool:
    st = procfs.stat(pid)
    return st is not None and st.state != "Z"


async def test_pod_lifecycle(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    sb = sandbox_record("life")
    net = await backend.lifecycle.run_sandbox(sb)
    assert net.ip == sb.backend_data["net"]["ip"] != ""
    vm = backend._shared.pods[sb.id].vm
    assert (vm.vcpus, vm.memory_bytes) == (1, 128 * MIB)
    assert sb.backend_data["vm"]["pid"] == vm.pid

    script = (
        "trap 'echo bye; exit 0' TERM; echo hello; echo oops >&2; hostname; cat /etc/resolv.conf;"
        " echo $IMAGE_ENV; sleep 30 & wait"
    )
    ct = container_record(sb, IMAGE, ["sh", "-c", script])
    await backend.lifecycle.create_container(ct, sb)
    assert ct.image_ref.startswith("sha256:")
    sink = MemorySink()
    started = await events.start(backend.lifecycle, ct, sb, sink)
    assert started > 0

    res = await backend.exec.exec_sync(ct, ["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (res.exit_code, res.stdout, res.stderr) == (7, b"out\n", b"err\n")

    stats = await AsShim().container_stats(backend.stats, [ct])
    assert stats[ct.id].memory.working_set_bytes.value > 0
    sb_stats = await AsShim().sandbox_stats(backend.stats, [sb], [ct])
    assert sb_stats[sb.id].linux.memory.usage_bytes.value > 0

    for _ in range(50):
        if b"svc.local" in sink.data["stdout"]:
            break
        await asyncio.sleep(0.1)
    out = bytes(sink.data["stdout"])
    assert out.startswith(b"hello\nlife\n"), out
    assert b"nameserver 10.0.0.10" in out and b"\n1\n" in out
    assert sink.data["stderr"] == b"oops\n"

    info = await backend.lifecycle.stop_container(ct, timeout=5)
    assert (info.exit_code, info.reason) == (0, "Completed")  # the TERM trap ran
    await asyncio.wait_for(sink.closed.wait(), 5)
    assert events.exits[ct.id].exit_code == 0
    assert sink.data["stdout"].endswith(b"bye\n")
    await backend.lifecycle.remove_container(ct)
    assert not os.path.exists(os.path.join(backend.root, "containers", ct.id))

    await backend.lifecycle.stop_sandbox(sb)
    assert not _alive(vm.pid)
    await backend.lifecycle.remove_sandbox(sb)
    assert not os.path.exists(vm.state_dir)


async def test_vm_crash_exits_containers(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    sb = sandbox_record("crash")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "60"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    ct_pid = (await backend._shared.pods[sb.id].agent.call(StateRequest(id=ct.id))).pid  # type: ignore[union-attr]
    vm_pid = backend._shared.pods[sb.id].vm.pid

    backend.inject(Fault.CRASH, sb.id)
    await events.wait_for(lambda: ct.id in events.exits and sb.id in events.not_ready)
    assert events.exits[ct.id].reason == VM_CRASH_REASON
    assert events.not_ready[sb.id] == VM_CRASH_REASON
    assert not _alive(vm_pid)
    del ct_pid  # a PID inside the VM's namespace; the cgroup check in the fixture covers it
    with pytest.raises(errors.FailedPreconditionError):
        await backend.exec.exec_sync(ct, ["true"])
    await backend.lifecycle.stop_sandbox(sb)  # cleans up the dead VM's cgroup and state
    await backend.lifecycle.remove_container(ct)


async def test_capacity_exhausted(runv: tuple[RunvBackend, Events]) -> None:
    backend, _events = runv
    big = sandbox_record("big", memory_limit_in_bytes=2 << 30)  # node has 1 GiB in this test
    with pytest.raises(errors.ResourceExhaustedError):
        await backend.lifecycle.run_sandbox(big)
    assert backend.hv.capacity()[0] == 0
    pods = [sandbox_record(f"p{i}", cpu_quota=200_000, cpu_period=100_000) for i in range(3)]
    await backend.lifecycle.run_sandbox(pods[0])
    await backend.lifecycle.run_sandbox(pods[1])  # 2 + 2 vCPUs = the node's 4
    with pytest.raises(errors.ResourceExhaustedError):
        await backend.lifecycle.run_sandbox(pods[2])
    await backend.lifecycle.stop_sandbox(pods[0])
    await backend.lifecycle.run_sandbox(pods[2])  # room again
    for p in pods[1:]:
        await backend.lifecycle.stop_sandbox(p)
    assert backend.hv.capacity()[0] == 0


async def test_boot_failure_leaves_nothing(runv: tuple[RunvBackend, Events]) -> None:
    backend, _events = runv
    backend.inject(Fault.BOOT_FAILURE)
    sb = sandbox_record("noboot")
    with pytest.raises(errors.UnavailableError, match="boot"):
        await backend.lifecycle.run_sandbox(sb)
    assert "vm" not in sb.backend_data
    assert backend.hv.capacity()[0] == 0
    assert os.listdir(backend.hv.run_dir) == []  # type: ignore[attr-defined]


async def test_agent_hang(runv: tuple[RunvBackend, Events]) -> None:
    backend, _events = runv
    backend.agent_timeout = 0.5
    sb = sandbox_record("hang")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "60"])
    backend._shared.pods[sb.id].agent.timeout = 0.5  # type: ignore[union-attr]
    backend.inject(Fault.AGENT_HANG, sb.id)
    with pytest.raises(errors.UnavailableError, match="did not answer"):
        await backend.lifecycle.create_container(ct, sb)
    vm_pid = backend._shared.pods[sb.id].vm.pid
    await backend.lifecycle.stop_sandbox(sb)  # a hung agent is killed with its VM
    assert not _alive(vm_pid)


async def test_recover_after_restart(runv_config: dict[str, object], busybox_rootfs: Path) -> None:
    first = RunvBackend("runv", dict(runv_config))
    ev1 = Events()
    await first.lifecycle.start(ev1)
    first.image_store.import_dir(IMAGE, str(busybox_rootfs))
    sb = sandbox_record("recover")
    await first.lifecycle.run_sandbox(sb)
    sb.committed = True
    ct = container_record(sb, IMAGE, ["sh", "-c", "while true; do echo tick; sleep 0.2; done"])
    await first.lifecycle.create_container(ct, sb)
    await ev1.start(first.lifecycle, ct, sb, MemorySink())
    ct.committed = True
    vm_pid = first._shared.pods[sb.id].vm.pid
    await ev1.close()
    await first.lifecycle.close()  # the shim goes away; the VM stays
    assert _alive(vm_pid)

    second = RunvBackend("runv", dict(runv_config))
    ev2 = Events()
    sink = MemorySink()
    await second.lifecycle.start(ev2)
    try:
        sb_obs, ct_obs = await second.lifecycle.recover([sb], [ct])
        assert sb_obs[sb.id].exists and sb_obs[sb.id].running
        assert ct_obs[ct.id].exists and ct_obs[ct.id].running
        assert await ev2.reattach(second.lifecycle, ct, sink)
        res = await second.exec.exec_sync(ct, ["echo", "back"])
        assert res.stdout == b"back\n"
        for _ in range(30):
            if b"tick" in sink.data["stdout"]:
                break
            await asyncio.sleep(0.1)
        assert b"tick" in sink.data["stdout"]  # output re-attached after the restart
        await second.lifecycle.stop_sandbox(sb)
        assert not _alive(vm_pid)
    finally:
        for pod in list(second._shared.pods.values()):
            await second.hv.destroy(pod.vm)
        await second.lifecycle.close()


async def test_recovery_sweeps_what_a_killed_run_sandbox_left(
    runv_config: dict[str, object], busybox_rootfs: Path
) -> None:
    """A shim killed in RunPodSandbox after the VM and its veth were made, before the record
    was: the next start removes the VM and the veth. An agent that refuses the connection
    makes that pod NOTREADY, and the others recover."""
    first = RunvBackend("runv", dict(runv_config))
    await first.lifecycle.start(Events())
    first.image_store.import_dir(IMAGE, str(busybox_rootfs))
    half = sandbox_record("half")
    await first.lifecycle.run_sandbox(half)
    host_if = first.net.veth_names(first._shared.pods[half.id].vm.id)[0]
    assert os.path.exists(f"/sys/class/net/{host_if}")
    half_pid = first._shared.pods[half.id].vm.pid
    good = sandbox_record("good")
    await first.lifecycle.run_sandbox(good)
    good.committed = True
    mute = sandbox_record("mute")
    await first.lifecycle.run_sandbox(mute)
    mute.committed = True
    await first.lifecycle.close()
    # The record the killed shim had persisted: not committed, nothing of the backend's in it.
    half = dataclasses.replace(half, backend_data={}, committed=False)
    # The agent of "mute" no longer accepts connections (its socket is gone).
    os.unlink(mute.backend_data["vm"]["channel"])

    second = RunvBackend("runv", dict(runv_config))
    await second.lifecycle.start(Events())
    try:
        sb_obs, _ = await second.lifecycle.recover([half, good, mute], [])
        assert not sb_obs[half.id].exists
        assert not _alive(half_pid)
        assert not os.path.exists(f"/sys/class/net/{host_if}")
        assert sb_obs[good.id].running
        assert sb_obs[mute.id].exists and not sb_obs[mute.id].running
        assert sb_obs[mute.id].status is not None and not sb_obs[mute.id].status.ready
    finally:
        for pod in list(second._shared.pods.values()):
            await second.hv.destroy(pod.vm)
        for sb in (good, mute):
            await plumbing.unplumb(second._shared, sb)
        await second.lifecycle.close()


def _registry_up() -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen("http://127.0.0.1:5000/v2/", timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.skipif(
    not _registry_up(), reason="no local registry on 127.0.0.1:5000 (scripts/testenv/up starts one)"
)
async def test_pulled_image_runs_in_vm(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    ref = "127.0.0.1:5000/busybox:1.36"
    image_id = await backend.images.pull_image(pb.ImageSpec(image=ref), None, None)
    status = await backend.images.image_status(pb.ImageSpec(image=ref))
    assert status is not None and status.id == image_id and ref in status.repo_tags
    sb = sandbox_record("pulled")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, ref, ["sleep", "30"])
    await backend.lifecycle.create_container(ct, sb)
    assert ct.image_ref == image_id
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    res = await backend.exec.exec_sync(ct, ["sh", "-c", "touch /new && ls / && grep -c . /etc/passwd"])
    assert res.exit_code == 0 and b"new" in res.stdout, res
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_container(ct)


class FakeIO:
    """A StreamIO with scripted stdin."""

    def __init__(self, stdin: list[bytes] | None, tty: bool = False) -> None:
        self.stdin = stdin is not None
        self.stdout = True
        self.stderr = not tty
        self.tty = tty
        self._in = list(stdin or [])
        self.out = bytearray()
        self.err = bytearray()

    async def read_stdin(self) -> bytes:
        return self._in.pop(0) if self._in else b""

    async def write_stdout(self, data: bytes) -> None:
        self.out += data

    async def write_stderr(self, data: bytes) -> None:
        self.err += data

    async def resizes(self) -> AsyncIterator[TerminalSize]:
        yield TerminalSize(100, 40)


async def test_streaming_exec_port_forward_and_hotplug(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    sb = sandbox_record("stream")
    await backend.lifecycle.run_sandbox(sb)
    # A one-shot TCP server inside the VM's network namespace.
    ct = container_record(sb, IMAGE, ["sh", "-c", "echo pong | nc -l -p 8080; sleep 30"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())

    io = FakeIO([b"line1\n", b"line2\n"])
    code = await backend.exec.exec(ct, ["sh", "-c", "cat; echo e >&2; exit 4"], io)
    assert (code, bytes(io.out), bytes(io.err)) == (4, b"line1\nline2\n", b"e\n")

    tty = FakeIO(None, tty=True)
    code = await backend.exec.exec(ct, ["sh", "-c", "stty size 2>/dev/null || echo nostty; [ -t 1 ]"], tty)
    assert code == 0, bytes(tty.out)

    for _ in range(50):  # nc may not listen yet
        port = FakePort(b"ping\n")
        try:
            await backend.exec.port_forward(sb, 8080, port)
        except errors.CriError:
            await asyncio.sleep(0.1)
            continue
        break
    assert bytes(port.got) == b"pong\n"

    res = pb.LinuxContainerResources(cpu_quota=300_000, cpu_period=100_000, memory_limit_in_bytes=256 * MIB)
    await backend.resources.update_container_resources(ct, res)
    vm = backend._shared.pods[sb.id].vm
    assert vm.vcpus == 3 and vm.memory_bytes >= 256 * MIB  # hot-plugged
    with open(f"/sys/fs/cgroup/memory/{backend.hv.cgroup_parent}/{vm.id}/memory.limit_in_bytes") as fh:  # type: ignore[attr-defined]
        assert int(fh.read()) == vm.memory_bytes
    with pytest.raises(errors.ResourceExhaustedError):  # the test node has 4 vCPUs
        await backend.resources.update_container_resources(
            ct, pb.LinuxContainerResources(cpu_quota=900_000, cpu_period=100_000)
        )
    await backend.lifecycle.stop_sandbox(sb)


async def test_attach_feeds_stdin(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    sb = sandbox_record("attach")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sh", "-c", "read line; echo got:$line"], stdin=True, stdin_once=True)
    await backend.lifecycle.create_container(ct, sb)
    sink = MemorySink()
    await events.start(backend.lifecycle, ct, sb, sink)
    io = FakeIO([b"hi\n"])
    await asyncio.wait_for(backend.exec.attach(ct, io), 10)
    assert bytes(io.out) == b"got:hi\n"
    assert sink.data["stdout"] == b"got:hi\n"  # the log sees what the attached client sees
    await events.wait_for(lambda: ct.id in events.exits)
    assert events.exits[ct.id].exit_code == 0
    await backend.lifecycle.stop_sandbox(sb)


@pytest.mark.skipif(
    not _registry_up(), reason="no local registry on 127.0.0.1:5000 (scripts/testenv/up starts one)"
)
async def test_image_pulled_elsewhere_is_fetched_by_name(runv: tuple[RunvBackend, Events]) -> None:
    backend, _events = runv
    ref = "127.0.0.1:5000/busybox:1.36"
    assert await backend.images.image_status(pb.ImageSpec(image=ref)) is None
    sb = sandbox_record("byname")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, ref, ["true"])
    await backend.lifecycle.create_container(ct, sb)  # e.g. `crictl pull` went to the docker handler
    status = await backend.images.image_status(pb.ImageSpec(image=ref))
    assert status is not None and ct.image_ref == status.id
    with pytest.raises(errors.NotFoundError):
        await backend.lifecycle.create_container(container_record(sb, "sha256:" + "e" * 64, ["true"]), sb)
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_container(ct)
