"""The /proc readers: a process's stat (state, parent, start time, whatever its name) and mounts."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from backends.linux import procfs


def test_stat_reads_past_a_command_name_that_looks_like_fields(tmp_path: Path) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    # A name with ") Z 1 (" in it: a reader splitting at the first ")" would take "Z" for the state.
    odd = tmp_path / "a) Z 1 (b"
    shutil.copy(sleep, odd)
    proc = subprocess.Popen([str(odd), "30"])
    try:
        st = procfs.stat(proc.pid)
        assert st is not None
        assert st.state in ("R", "S") and st.ppid == os.getpid()
        me = procfs.stat(os.getpid())
        assert me is not None and st.start_time >= me.start_time > 0
        again = procfs.stat(proc.pid)  # the same process: the same parent and start time (its state may move)
        assert again is not None and (again.ppid, again.start_time) == (st.ppid, st.start_time)
        proc.kill()
        # Dead and not reaped: a zombie, still there.
        for _ in range(200):
            st = procfs.stat(proc.pid)
            if st is not None and st.state == "Z":
                break
            time.sleep(0.01)
        assert st is not None and st.state == "Z"
    finally:
        proc.kill()
        proc.wait()
    assert procfs.stat(proc.pid) is None


def test_children_of_a_process_and_of_none() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert proc.pid in procfs.children(os.getpid())
    finally:
        proc.kill()
        proc.wait()
    assert procfs.children(proc.pid) == []


def test_mounts_of_this_process() -> None:
    found = {m.point: m for m in procfs.mounts()}
    assert found["/proc"].fstype == "proc"
    assert "/" in found


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_mounts_unescapes_the_mount_point_and_reads_another_process(tmp_path: Path) -> None:
    odd = tmp_path / "a dir\twith\\odd names"
    odd.mkdir()
    script = 'mount -t tmpfs -o size=1m runv-test "$0" && exec sleep 30'
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(odd)])
    try:
        for _ in range(500):
            theirs = {m.point: m for m in procfs.mounts(proc.pid)}
            if str(odd) in theirs:
                break
            time.sleep(0.01)
        assert theirs[str(odd)].fstype == "tmpfs" and "size=1024k" in theirs[str(odd)].super_options
        assert str(odd) not in {m.point for m in procfs.mounts()}  # its namespace's, not ours
    finally:
        proc.kill()
        proc.wait()
