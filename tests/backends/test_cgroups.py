"""Block I/O per device, read from either cgroup version's files (backends.linux.cgroup_usage)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from backends.contract.usage import Device
from backends.linux.cgroup_usage import _detail
from backends.linux.cgroups import CgroupReader

# Numbers no block device has here, so that the name is "MAJ:MIN".
V1_BYTES = "4000:1 Read 4096\n4000:1 Write 8192\n4000:0 Read 1\n4000:0 Sync 5\nTotal 12288\n"
V1_OPS = "4000:1 Read 3\n4000:1 Write 7\n"
V2_STAT = "4000:1 rbytes=4096 wbytes=8192 rios=3 wios=7 dbytes=0 dios=0\n4000:0 rbytes=1\n"


def test_v1_blkio_files_give_the_devices_in_order(tmp_path: Path) -> None:
    (tmp_path / "blkio.throttle.io_service_bytes_recursive").write_text(V1_BYTES)
    (tmp_path / "blkio.throttle.io_serviced_recursive").write_text(V1_OPS)
    assert _detail({"blkio": str(tmp_path)}, None).devices == (
        Device(4000, 0, read_bytes=1, name="4000:0"),
        Device(4000, 1, 4096, 8192, 3, 7, "4000:1"),
    )


def test_v2_io_stat_gives_the_devices_as_listed(tmp_path: Path) -> None:
    (tmp_path / "io.stat").write_text(V2_STAT)
    assert _detail({}, str(tmp_path)).devices == (
        Device(4000, 1, 4096, 8192, 3, 7, "4000:1"),
        Device(4000, 0, read_bytes=1, name="4000:0"),
    )


def _gone_pid() -> int:
    """A PID no process has (a child already reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("read", ["sample", "detail"])
def test_a_process_that_is_gone_or_another_has_no_figures(read: str) -> None:
    reader = CgroupReader()
    assert getattr(reader, read)(os.getpid()) is not None
    assert getattr(reader, read)(os.getpid(), expect="no-such-container-id") is None
    assert getattr(reader, read)(_gone_pid()) is None
