"""Mount.mount_options in runv's stub VMs: the guest binds the share with their flags, so noexec
stops a binary copied into the host directory, which still runs from a plain mount."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from backends.contract import Capability
from backends.contract.errors import FailedPreconditionError
from backends.runv.agent import messages as m
from backends.runv.agent import oci
from backends.runv.backend import RunvBackend
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

IMAGE = "test/busybox:1"
BUSYBOX_BIN = shutil.which("busybox") or "/bin/busybox"


@needs_vm
@pytest.mark.skipif(not Path(BUSYBOX_BIN).exists(), reason="no static busybox on this host")
async def test_noexec_stops_a_binary_of_the_mount(runv: tuple[RunvBackend, Events], tmp_path: Path) -> None:
    backend, events = runv
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


def test_the_options_reach_the_oci_mount(tmp_path: Path) -> None:
    mount = m.Mount(source="/run/share", destination="/x", options=["noexec", "nosuid"])
    assert m.Mount.from_dict(mount.to_dict()) == mount
    assert m.Mount.from_dict({"source": "/s", "destination": "/x"}).options == []  # an older shim's
    spec = m.ContainerSpec(args=["true"], mounts=[mount])
    (oci_mount,) = [
        x for x in oci.build_config(spec, str(tmp_path), {}, "/x")["mounts"] if x["destination"] == "/x"
    ]
    assert oci_mount["options"] == ["rbind", "rprivate", "rw", "noexec", "nosuid"]
