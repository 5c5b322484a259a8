"""Mount.mount_options on the fake: refused when unknown (naming the option), reported in Status,
and a noexec mount's files do not run (126, Permission denied), as execve refuses them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests.criutil import container_config
from tests.shim.services_kit import RUNS_UNTIL_STOPPED, Kit, run_pod, start


def volume(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    script = d / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    busybox = shutil.which("busybox") or "/bin/sh"
    shutil.copy(busybox, d / "busybox")
    return d


async def container_with(kit: Kit, mounts: list[pb.Mount]) -> tuple[Code, str, str]:
    pod = await run_pod(kit)
    cfg = container_config(command=["sleep", "1000"], log_path="c.log", annotations=RUNS_UNTIL_STOPPED)
    cfg.mounts.extend(mounts)
    req = pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=cfg, sandbox_config=pod.config)
    code, detail, resp = await kit.call("CreateContainer", req)
    return code, detail, resp.container_id if code == Code.OK else ""


async def exec_sync(kit: Kit, cid: str, cmd: list[str]) -> pb.ExecSyncResponse:
    return await kit.ok("ExecSync", pb.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=5))


async def test_noexec_stops_what_the_mount_holds_from_running(kit: Kit, tmp_path: Path) -> None:
    plain, locked = volume(tmp_path, "plain"), volume(tmp_path, "locked")
    code, detail, cid = await container_with(
        kit,
        [
            pb.Mount(container_path="/plain", host_path=str(plain)),
            pb.Mount(
                container_path="/locked", host_path=str(locked), mount_options=["noexec", "nodev", "nosuid"]
            ),
        ],
    )
    assert code == Code.OK, detail
    await start(kit, cid)
    ran = await exec_sync(kit, cid, ["/plain/run.sh"])
    assert (ran.exit_code, ran.stdout) == (0, b"ran\n")
    for cmd in (
        ["/locked/run.sh"],
        ["/locked/busybox", "echo", "hi"],
        ["sh", "-c", "cd /locked && ./run.sh"],
    ):
        refused = await exec_sync(kit, cid, cmd)
        assert refused.exit_code == 126 and b"Permission denied" in refused.stderr, (cmd, refused)
    # Still readable, as a noexec mount is.
    assert (await exec_sync(kit, cid, ["cat", "/locked/run.sh"])).stdout.startswith(b"#!/bin/sh")
    status = (await kit.ok("ContainerStatus", pb.ContainerStatusRequest(container_id=cid))).status
    assert [list(m.mount_options) for m in status.mounts] == [[], ["noexec", "nodev", "nosuid"]]


async def test_ro_as_a_mount_option_makes_the_mount_read_only(kit: Kit, tmp_path: Path) -> None:
    d = volume(tmp_path, "ro")
    code, detail, cid = await container_with(
        kit, [pb.Mount(container_path="/ro", host_path=str(d), mount_options=["ro"])]
    )
    assert code == Code.OK, detail
    await start(kit, cid)
    wrote = await exec_sync(kit, cid, ["sh", "-c", "echo x > /ro/new"])
    assert wrote.exit_code != 0 and b"Read-only" in wrote.stderr
    assert not (d / "new").exists()


@pytest.mark.parametrize("option", ["exec", "rbind", "noatime", "uid=0", ""])
async def test_an_option_no_handler_applies_is_refused_naming_it(
    kit: Kit, tmp_path: Path, option: str
) -> None:
    d = volume(tmp_path, "v")
    mount = pb.Mount(container_path="/v", host_path=str(d), mount_options=["noexec", option])
    code, detail, _ = await container_with(kit, [mount])
    assert code == Code.INVALID_ARGUMENT and f"mount option {option!r}" in detail, detail


async def test_a_handler_without_mount_options_refuses_them(kit: Kit, tmp_path: Path) -> None:
    from backends.contract import Capability

    kit.fake.runtime.capabilities = Capability.HOST_NETWORK
    d = volume(tmp_path, "v")
    code, detail, _ = await container_with(
        kit, [pb.Mount(container_path="/v", host_path=str(d), mount_options=["noexec"])]
    )
    assert code == Code.INVALID_ARGUMENT and "handler 'fake' does not apply mount options" in detail, detail
    status = await kit.ok("Status", pb.StatusRequest(verbose=True))
    assert not status.features.mount_options
    assert json.loads(status.info["config"])["handlers"]["fake"]["mountOptions"] is False


async def test_status_reports_mount_options(kit: Kit) -> None:
    status = await kit.ok("Status", pb.StatusRequest(verbose=True))
    assert status.features.mount_options
    assert json.loads(status.info["config"])["handlers"]["fake"]["mountOptions"] is True
