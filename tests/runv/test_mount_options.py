"""Mount.mount_options in runv's VMs (stub and qemu): the guest binds the share with their flags,
so noexec stops a binary copied into the host directory, which still runs from a plain mount."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from backends.contract import Capability
from backends.contract.errors import FailedPreconditionError
from backends.runv.agent import messages as m
from backends.runv.agent import oci
from backends.runv.backend import RunvBackend
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record
from tests.runv.test_qemu import IMAGE as QEMU_IMAGE
from tests.runv.test_qemu import _qemu_config, needs_qemu

IMAGE = "test/busybox:1"
BUSYBOX_BIN = shutil.which("busybox") or "/bin/busybox"


@needs_vm
@pytest.mark.skipif(not Path(BUSYBOX_BIN).exists(), reason="no static busybox on this host")
async def test_noexec_stops_a_binary_of_the_mount(runv: tuple[RunvBackend, Events], tmp_path: Path) -> None:
    await _noexec_stops_a_binary(*runv, tmp_path)


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path(BUSYBOX_BIN).exists(), reason="no static busybox on this host")
async def test_noexec_in_a_qemu_vm(runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path) -> None:
    backend = RunvBackend("runv", _qemu_config(runv_config))
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(QEMU_IMAGE, str(busybox_rootfs))
    try:
        await _noexec_stops_a_binary(backend, events, tmp_path)
    finally:
        await events.close()
        await backend.lifecycle.close()


async def _noexec_stops_a_binary(backend: RunvBackend, events: Events, tmp_path: Path) -> None:
    assert backend.capabilities & Capability.MOUNT_OPTIONS
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy(BUSYBOX_BIN, shared / "busybox")
    sb = sandbox_record("mntopts")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "60"])
    ct.config.mounts.add(host_path=str(shared), container_path="/plain")
    ct.config.mounts.add(
        host_path=str(shared), container_path="/locked", mount_options=["noexec", "nodev", "nosuid"]
    )
    ct.config.mounts.add(host_path=str(shared), container_path="/ro", mount_options=["ro"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    try:
        ok = await backend.exec.exec_sync(ct, ["/plain/busybox", "echo", "hi"])
        assert (ok.exit_code, ok.stdout) == (0, b"hi\n")
        # runv answers an exec that cannot start with an error (as containerd does), not an exit code.
        with pytest.raises(FailedPreconditionError, match="eaccess /locked/busybox: permission denied"):
            await backend.exec.exec_sync(ct, ["/locked/busybox", "echo", "hi"])
        info = (await backend.exec.exec_sync(ct, ["cat", "/proc/self/mountinfo"])).stdout.decode()
        line = next(x for x in info.splitlines() if " /locked " in x)
        assert {"noexec", "nodev", "nosuid"} <= set(line.split()[5].split(",")), line
        wrote = await backend.exec.exec_sync(ct, ["sh", "-c", "echo x > /ro/new"])
        assert wrote.exit_code != 0 and not (shared / "new").exists()
    finally:
        await backend.lifecycle.stop_container(ct, 1)
        await backend.lifecycle.remove_container(ct)
        await backend.lifecycle.stop_sandbox(sb)
        await backend.lifecycle.remove_sandbox(sb)


@needs_vm
async def test_an_agent_that_predates_the_options_is_refused_them(
    runv: tuple[RunvBackend, Events], tmp_path: Path
) -> None:
    """A VM booted before an upgrade runs an agent that would ignore the options: refused, nothing made."""
    backend, _ = runv
    sb = sandbox_record("oldagent")
    await backend.lifecycle.run_sandbox(sb)
    try:
        backend._shared.pods[sb.id].agent_version = 2
        ct = container_record(sb, IMAGE, ["sleep", "60"])
        ct.config.mounts.add(host_path=str(tmp_path), container_path="/locked", mount_options=["noexec"])
        with pytest.raises(FailedPreconditionError, match="need a guest agent of operations version 3"):
            await backend.lifecycle.create_container(ct, sb)
        assert not os.path.exists(os.path.join(backend._shared.containers_dir, ct.id))
        plain = container_record(sb, IMAGE, ["sleep", "60"])
        plain.config.mounts.add(host_path=str(tmp_path), container_path="/ro", mount_options=["ro"])
        await backend.lifecycle.create_container(plain, sb)  # ro alone is the readonly flag
        await backend.lifecycle.remove_container(plain)
    finally:
        with contextlib.suppress(Exception):
            await backend.lifecycle.stop_sandbox(sb)
        await backend.lifecycle.remove_sandbox(sb)


def test_the_options_reach_the_oci_mount(tmp_path: Path) -> None:
    mount = m.Mount(source="/run/share", destination="/x", options=["noexec", "nosuid"])
    assert m.Mount.from_dict(mount.to_dict()) == mount
    assert m.Mount.from_dict({"source": "/s", "destination": "/x"}).options == []  # an older shim's
    spec = m.ContainerSpec(args=["true"], mounts=[mount])
    (oci_mount,) = [
        x for x in oci.build_config(spec, str(tmp_path), {}, "/x")["mounts"] if x["destination"] == "/x"
    ]
    assert oci_mount["options"] == ["rbind", "rprivate", "rw", "noexec", "nosuid"]
