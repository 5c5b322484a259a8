"""Fixtures for the runv backend: a busybox rootfs, a backend on private dirs and cgroups."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.linux.cgroups import Cgroup
from backends.runv.backend import RunvBackend
from tests.runv.helpers import BUSYBOX, Events

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def busybox_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("busybox") / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "tmp").mkdir()
    if BUSYBOX is not None:
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        for applet in (
            "sh",
            "echo",
            "cat",
            "sleep",
            "id",
            "hostname",
            "ls",
            "nc",
            "true",
            "kill",
            "ps",
            "head",
        ):
            (root / "bin" / applet).symlink_to("busybox")
    for name in ("passwd", "group"):
        shutil.copy2(REPO / "images" / "busybox" / name, root / "etc" / name)
    return root


@pytest.fixture
def runv_config(tmp_path: Path) -> Iterator[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    run_dir = f"/tmp/rv-{tag}"  # short: agent socket paths must fit in sun_path
    cfg: dict[str, Any] = {
        "root": str(tmp_path / "root"),
        "run_dir": run_dir,
        "agent_timeout": 5.0,
        # A bridge, subnet, chain and IPAM directory of this test only.
        "network": {
            "bridge": f"rvt{tag}",
            "subnet": f"10.93.{random.randrange(256)}.0/24",
            "ipam_dir": str(tmp_path / "ipam"),
            "hostport_chain": f"CRISHIM-T-{tag}",
        },
        "stub": {
            "cgroup_parent": f"cri-shim-runv-test-{tag}",
            "capacity_vcpus": 4,
            "capacity_memory": 1 << 30,
        },
    }
    yield cfg
    net = cfg["network"]
    subprocess.run(["ip", "link", "del", net["bridge"]], capture_output=True, check=False)
    for hook, rule in (
        ("PREROUTING", ["-m", "addrtype", "--dst-type", "LOCAL", "-j", net["hostport_chain"]]),
        ("OUTPUT", ["-m", "addrtype", "--dst-type", "LOCAL", "-j", net["hostport_chain"]]),
        ("POSTROUTING", ["-s", "127.0.0.0/8", "-o", net["bridge"], "-j", "MASQUERADE"]),
    ):
        while (
            subprocess.run(
                ["iptables", "-w", "5", "-t", "nat", "-D", hook, *rule], capture_output=True
            ).returncode
            == 0
        ):
            pass
    subprocess.run(
        ["iptables", "-w", "5", "-t", "nat", "-F", net["hostport_chain"]], capture_output=True, check=False
    )
    subprocess.run(
        ["iptables", "-w", "5", "-t", "nat", "-X", net["hostport_chain"]], capture_output=True, check=False
    )
    with open("/proc/self/mountinfo") as fh:
        mounts = [line for line in fh if run_dir in line or cfg["root"] in line]
    assert not mounts, f"mounts leaked to the host: {mounts}"
    parent = Cgroup(cfg["stub"]["cgroup_parent"])
    leaked = sorted(set(parent.pids()))
    for pid in leaked:  # the test's own VMs: ended here, so that a failure leaves none running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while parent.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.remove()
    shutil.rmtree(run_dir, ignore_errors=True)
    assert not leaked, f"processes left in the test cgroup: {leaked}"


@pytest.fixture
async def runv(
    runv_config: dict[str, Any], busybox_rootfs: Path
) -> AsyncIterator[tuple[RunvBackend, Events]]:
    backend = RunvBackend("runv", runv_config)
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir("test/busybox:1", str(busybox_rootfs), {"Env": ["IMAGE_ENV=1"]})
    try:
        yield backend, events
    finally:
        await events.close()
        for pod in list(backend._shared.pods.values()):
            await backend.hv.destroy(pod.vm)
        await backend.lifecycle.close()
