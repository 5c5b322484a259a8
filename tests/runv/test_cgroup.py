"""linux.cgroups.Cgroup, the cgroup of a runv VM: made, sized, joined, read and removed."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

from backends.linux.cgroups import Cgroup, hierarchies

MIB = 1024 * 1024

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Cgroup("").dirs() or not all(os.access(d, os.W_OK) for d in Cgroup("").dirs()),
    reason="needs root and a writable cgroupfs",
)


def _read(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as fh:
        return fh.read().strip()


def test_a_cgroup_is_made_sized_joined_read_and_removed() -> None:
    parent = Cgroup(f"cri-shim-test-{uuid.uuid4().hex[:8]}")
    cg = Cgroup(f"{parent.rel}/vm")
    mounts = hierarchies()
    assert all(os.path.dirname(d) in {os.path.join(mp, parent.rel) for mp in mounts.every} for d in cg.dirs())
    cg.create()
    proc = None
    try:
        cg.set_limits(2, 64 * MIB)
        if cg.v2:
            (d,) = cg.dirs()
            assert _read(d, "cpu.max") == "200000 100000" and _read(d, "memory.max") == str(64 * MIB)
        else:
            assert _read(os.path.join(mounts.v1["cpu"], cg.rel), "cpu.cfs_quota_us") == "200000"
            assert _read(os.path.join(mounts.v1["memory"], cg.rel), "memory.limit_in_bytes") == str(64 * MIB)
        # Joined as the drivers join it: the PID written to every procs file, then exec.
        script = 'for f in $FILES; do echo $$ > "$f"; done; i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; exec sleep 30'
        proc = subprocess.Popen(
            ["sh", "-c", script], env={"FILES": " ".join(cg.procs_files()), "PATH": "/bin:/usr/bin"}
        )
        deadline = time.monotonic() + 5
        while proc.pid not in cg.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.pid in cg.pids() and proc.pid in parent.pids()  # the parent counts its children's
        while min(cg.usage()) == 0 and time.monotonic() < deadline:  # its loop, charged to it
            time.sleep(0.01)
        cpu, memory = cg.usage()
        assert cpu > 0 and memory > 0
        assert cg.oom_kills() == 0
        cg.remove()  # a cgroup with a process in it stays
        assert all(os.path.isdir(d) for d in cg.dirs())
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for _ in range(100):
            cg.remove()
            if not any(os.path.isdir(d) for d in cg.all_dirs()):
                break
            time.sleep(0.02)
        parent.remove()
    assert not any(os.path.isdir(d) for d in (*cg.all_dirs(), *parent.all_dirs()))
    assert cg.usage() == (0, 0) and cg.pids() == [] and cg.oom_kills() == 0  # gone: nothing to read
