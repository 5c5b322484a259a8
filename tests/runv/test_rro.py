"""Recursive read-only mounts in runv: the mount and everything mounted below it are read-only."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from backends.contract import Capability
from backends.runv.backend import RunvBackend
from cri_api import api_pb2 as pb
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm

IMAGE = "test/busybox:1"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A host directory with a tmpfs mounted below it."""
    top = tmp_path / "top"
    (top / "sub").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(top / "sub")]).returncode:
        pytest.skip("cannot mount a tmpfs")
    try:
        yield top
    finally:
        subprocess.run(["umount", "-l", str(top / "sub")], check=False)


async def test_recursive_read_only_covers_submounts(runv: tuple[RunvBackend, Events], tree: Path) -> None:
    backend, events = runv
    assert backend.capabilities & Capability.RECURSIVE_READ_ONLY_MOUNTS
    sb = sandbox_record("rro")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "60"])
    ct.config.mounts.add(host_path=str(tree), container_path="/rro", readonly=True, recursive_read_only=True)
    ct.config.mounts.add(host_path=str(tree), container_path="/ro", readonly=True)
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())

    async def writable(path: str) -> bool:
        res = await backend.exec.exec_sync(ct, ["sh", "-c", f"echo x > {path}"])
        return res.exit_code == 0

    assert not await writable("/rro/f")
    assert not await writable("/rro/sub/f")  # the submount too
    assert not await writable("/ro/f")
    assert await writable("/ro/sub/f")  # plain read-only stops at the mount itself
    assert os.path.exists(tree / "sub" / "f")
    await backend.lifecycle.stop_container(ct, 1)
    await backend.lifecycle.remove_container(ct)
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)


async def test_the_shim_reports_the_feature_per_handler(runv: tuple[RunvBackend, Events]) -> None:
    backend, _ = runv
    from shim.cri.validate import mounts_for

    cfg = pb.ContainerConfig(
        mounts=[pb.Mount(host_path="/tmp", container_path="/x", readonly=False, recursive_read_only=True)]
    )
    from shim.cri.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="must be read-only"):
        mounts_for(cfg, backend.capabilities, "runv")
