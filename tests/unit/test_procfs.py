"""The one /proc/PID/stat reader: state, parent and start time, whatever the command's name."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

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
        assert procfs.stat(proc.pid) == st  # the same process: the same start time
    finally:
        proc.kill()
    # Dead and not reaped: a zombie, still there.
    for _ in range(200):
        st = procfs.stat(proc.pid)
        if st is not None and st.state == "Z":
            break
        time.sleep(0.01)
    assert st is not None and st.state == "Z"
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
