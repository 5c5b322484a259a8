"""Mount.mount_options on a real engine: the engine's binds take none of them, so the backend binds
the host path with their flags first (image_volumes.py); noexec stops a binary copied there."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest

from backends.contract import Capability
from backends.docker import create
from backends.docker.image_volumes import ImageVolumes
from cri_api import api_pb2 as pb
from shim.cri.container_io import CriLogWriter
from tests.docker.dockerkit import ENDPOINT, INSTANCE, PAUSE, Harness, container_record, harnessed

pytestmark = pytest.mark.docker
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")
BUSYBOX_BIN = shutil.which("busybox") or "/bin/busybox"


@pytest.fixture
async def harness(engine: docker.APIClient, tmp_path: Path) -> AsyncIterator[Harness]:
    backend = create(
        "docker",
        {
            "endpoint": ENDPOINT,
            "pause_image": PAUSE,
            "pull_no_progress_timeout": 60,
            "instance": INSTANCE,
            "state_dir": str(tmp_path / "state"),
        },
    )
    async with harnessed(backend, engine) as h:
        yield h


def host_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(BUSYBOX_BIN, d / "busybox")  # a static busybox: it runs in any container
    (d / "data").write_text("readable\n")
    return d


@needs_root
@pytest.mark.skipif(not os.path.exists(BUSYBOX_BIN), reason="no static busybox on this host")
async def test_noexec_stops_a_binary_of_the_mount(harness: Harness, tmp_path: Path) -> None:
    assert harness.backend.capabilities & Capability.MOUNT_OPTIONS
    plain, locked = host_dir(tmp_path, "plain"), host_dir(tmp_path, "locked")
    sb = await harness.run_sandbox()
    ct = container_record(
        sb,
        ["sleep", "1000"],
        mounts=[
            pb.Mount(container_path="/plain", host_path=str(plain)),
            pb.Mount(
                container_path="/locked", host_path=str(locked), mount_options=["noexec", "nodev", "nosuid"]
            ),
            pb.Mount(container_path="/ro", host_path=str(plain), mount_options=["ro"]),
        ],
    )
    ct = await harness.create(ct, sb)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "c.log")))
    run = harness.backend.exec.exec_sync
    ok = await run(ct, ["/plain/busybox", "echo", "hi"])
    assert (ok.exit_code, ok.stdout) == (0, b"hi\n")
    refused = await run(ct, ["/locked/busybox", "echo", "hi"])
    assert refused.exit_code == 126 and b"ermission denied" in refused.stdout + refused.stderr, refused
    assert (await run(ct, ["cat", "/locked/data"])).stdout == b"readable\n"
    mounted = (await run(ct, ["cat", "/proc/self/mountinfo"])).stdout.decode()
    locked_line = next(line for line in mounted.splitlines() if " /locked " in line)
    assert {"noexec", "nodev", "nosuid"} <= set(locked_line.split()[5].split(",")), locked_line
    wrote = await run(ct, ["sh", "-c", "echo x > /ro/new"])
    assert wrote.exit_code != 0 and not (plain / "new").exists()
    # Its flagged binds go with it.
    folder = tmp_path / "state" / "image-volumes" / ct.id
    assert folder.is_dir()
    await harness.backend.lifecycle.stop_container(ct, 0)
    await harness.backend.lifecycle.remove_container(ct)
    assert not folder.exists()


@needs_root
def test_flagged_binds_of_files_and_dirs_and_their_release(tmp_path: Path) -> None:
    vols = ImageVolumes(str(tmp_path / "vols"))
    d = tmp_path / "d"
    d.mkdir()
    f = tmp_path / "f"
    f.write_text("file\n")
    src_dir = vols.flagged("c1", 0, pb.Mount(container_path="/d", host_path=str(d), mount_options=["ro"]))
    src_file = vols.flagged(
        "c1", 1, pb.Mount(container_path="/f", host_path=str(f), mount_options=["noexec"])
    )
    assert Path(src_file).read_text() == "file\n"
    with pytest.raises(OSError):
        (Path(src_dir) / "x").write_text("no")
    vols.release("c1")
    assert not (tmp_path / "vols" / "c1").exists() and f.read_text() == "file\n"
