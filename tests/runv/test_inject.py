"""The stub's share helper (inject.py served by one long-lived process) against a real mount namespace."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.runv.drivers.base import Injector

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)


@pytest.fixture
def vm(tmp_path: Path) -> Iterator[int]:
    """A process in a mount namespace of its own, as a stub VM's is."""
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "60"])
    try:
        for _ in range(100):  # until unshare has exec'd sleep in the new namespace
            if os.readlink(f"/proc/{proc.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
                break
            time.sleep(0.02)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def mounted_in(pid: int, target: str) -> bool:
    with open(f"/proc/{pid}/mountinfo") as fh:
        return any(line.split()[4] == target for line in fh)


async def test_attach_detach_errors_and_a_helper_that_died(tmp_path: Path, vm: int) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    target = tmp_path / "target"
    target.mkdir()
    inj = Injector(sys.executable)
    try:
        assert await inj.call(["attach", str(src), str(vm), str(target)]) == ""
        assert mounted_in(vm, str(target))
        assert not mounted_in(os.getpid(), str(target))  # only in the VM's namespace

        error = await inj.call(["attach", str(tmp_path / "absent"), str(vm), str(target)])
        assert "open_tree" in error and "absent" in error

        # The helper dies between two requests: the next one starts a new helper.
        assert inj._proc is not None
        inj._proc.kill()
        await inj._proc.wait()
        assert await inj.call(["detach", str(vm), str(target)]) == ""
        assert not mounted_in(vm, str(target))
        assert "not a request" in await inj.call(["mount", "everything"])
    finally:
        await inj.close()
    assert inj._proc is None


async def test_concurrent_requests_are_answered_in_turn(tmp_path: Path, vm: int) -> None:
    inj = Injector(sys.executable)
    try:
        targets = []
        for i in range(8):
            (tmp_path / f"s{i}").mkdir()
            (tmp_path / f"t{i}").mkdir()
            targets.append(str(tmp_path / f"t{i}"))
        errors = await asyncio.gather(
            *(inj.call(["attach", str(tmp_path / f"s{i}"), str(vm), targets[i]]) for i in range(8))
        )
        assert errors == [""] * 8
        assert all(mounted_in(vm, t) for t in targets)
    finally:
        await inj.close()
