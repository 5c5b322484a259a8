"""Checkpoints on runv's qemu driver through the gRPC edge (issue 43): CRIU in the pod's VM.

A counting container (``i=$((i+1)); echo $i``) that wrote a file in its root is checkpointed
(CheckpointPod, or CheckpointContainer), restored as a new pod (RestorePod; or CreateContainer
whose image is the archive, in another pod), started, and goes on counting from where the
checkpoint caught it, its file still there. A failure in the middle of a checkpoint leaves the
pod running and nothing written. Needs QEMU and the guest image built with CRIU (as
tests/runv/test_qemu_criu_probe.py); skipped without them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.runv import checkpoint_archive
from backends.runv.backend import RunvBackend
from backends.runv.checkpoint import VmCheckpoints
from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests.criutil import container_config, sandbox_config, until
from tests.runv.test_qemu_criu_probe import CRIU_GUEST_DIR, _counts_on, needs_criu_guest
from tests.shim.services_kit import Kit, open_kit

IMAGE = "test/busybox:1"
COUNTER = [
    "sh",
    "-c",
    "echo kept > /state; rm /bin/true; i=0; while true; do i=$((i+1)); echo $i; sleep 1; done",
]

pytestmark = [pytest.mark.slow, pytest.mark.qemu, needs_criu_guest, pytest.mark.timeout(900)]


def criu_runv(runv_config: dict[str, Any]) -> RunvBackend:
    """A runv handler as a user's with checkpoints: ``criu = true`` (the --criu image), VMs from
    templates, on virtio-fs (the defaults)."""
    qemu = {
        "criu": True,
        "guest_dir": CRIU_GUEST_DIR,
        "cgroup_parent": runv_config["stub"]["cgroup_parent"],
        "capacity_vcpus": 4,
        "capacity_memory": 2 << 30,
    }
    return RunvBackend("runv", {**runv_config, "driver": "qemu", "agent_timeout": 60.0, "qemu": qemu})


@pytest.fixture
async def node(
    tmp_path: Path, runv_config: dict[str, Any], busybox_rootfs: Path
) -> AsyncIterator[tuple[Kit, RunvBackend]]:
    runv = criu_runv(runv_config)
    runv.image_store.import_dir(IMAGE, str(busybox_rootfs))
    async with open_kit(str(tmp_path / "node"), images=(), handlers={"runv": runv}) as kit:
        await runv.lifecycle.start(kit.servicer.shim)
        try:
            yield kit, runv
        finally:
            for p in (await kit.ok("ListPodSandbox", pb.ListPodSandboxRequest())).items:
                await kit.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=p.id))
                await kit.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=p.id))
            await runv.lifecycle.close()


def pod_config(kit: Kit, name: str) -> pb.PodSandboxConfig:
    logs = os.path.join(kit.root, "logs-" + name)
    os.makedirs(logs, exist_ok=True)
    return sandbox_config(name=name, uid="uid-" + name, log_directory=logs)


def counter_config(name: str = "counter") -> pb.ContainerConfig:
    return container_config(name=name, image=IMAGE, command=COUNTER, log_path=name + ".log")


def counted(log: str) -> list[int]:
    """The numbers of a CRI log (``<time> stdout F <n>``)."""
    try:
        with open(log) as fh:
            return [int(line.split()[-1]) for line in fh if line.split() and line.split()[-1].isdigit()]
    except FileNotFoundError:
        return []


async def counting_pod(
    kit: Kit, name: str, containers: int = 1
) -> tuple[str, pb.PodSandboxConfig, list[str]]:
    cfg = pod_config(kit, name)
    sid = (
        await kit.ok("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg, runtime_handler="runv"))
    ).pod_sandbox_id
    cids = []
    for i in range(containers):
        req = pb.CreateContainerRequest(
            pod_sandbox_id=sid, config=counter_config(f"counter{i}"), sandbox_config=cfg
        )
        cid = (await kit.ok("CreateContainer", req)).container_id
        await kit.ok("StartContainer", pb.StartContainerRequest(container_id=cid))
        cids.append(cid)
    for i in range(containers):
        log = os.path.join(cfg.log_directory, f"counter{i}.log")
        await until(lambda log=log: len(counted(log)) >= 3, 120)
    return sid, cfg, cids


async def state_of(kit: Kit, cid: str) -> int:
    return int((await kit.ok("ContainerStatus", pb.ContainerStatusRequest(container_id=cid))).status.state)


async def exec_out(kit: Kit, cid: str, cmd: list[str]) -> tuple[int, bytes]:
    resp = await kit.ok("ExecSync", pb.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=60))
    return int(resp.exit_code), bytes(resp.stdout)


async def gone(kit: Kit, sid: str) -> None:
    await kit.ok("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sid))
    await kit.ok("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sid))


async def goes_on(kit: Kit, cid: str, log: str, before: list[int]) -> None:
    """The restored ``cid`` counts on from a number the checkpointed one had reached, its root
    as the checkpoint left it (its file written, the file it removed absent)."""
    await until(lambda: len(counted(log)) >= 3, 120)
    after = counted(log)
    print("counted before", before[-5:], "after", after[:5])
    assert _counts_on(before, after), (before, after)
    assert await exec_out(kit, cid, ["cat", "/state"]) == (0, b"kept\n")
    code, _ = await exec_out(kit, cid, ["ls", "/bin/true"])
    assert code != 0  # removed before the checkpoint: a whiteout, carried over


async def test_a_pod_is_checkpointed_and_restored_as_a_new_pod_that_counts_on(
    node: tuple[Kit, RunvBackend], tmp_path: Path
) -> None:
    """Two counters in the pod's PID namespace (the CRI's default, POD): one cut, and restored
    both before either runs (else one's new processes take PIDs the other's checkpoint holds)."""
    kit = node[0]
    names = ("counter0", "counter1")
    sid, cfg, cids = await counting_pod(kit, "first", containers=len(names))
    out = tmp_path / "ckpt"
    out.mkdir()
    req = pb.CheckpointPodRequest(pod_sandbox_id=sid, output_path=str(out), container_ids=cids)
    await kit.ok("CheckpointPod", req)
    assert sorted(os.listdir(out)) == [checkpoint_archive.POD_ARCHIVE]
    logs = [os.path.join(cfg.log_directory, f"{name}.log") for name in names]
    for cid, log in zip(cids, logs, strict=True):
        assert await state_of(kit, cid) == pb.CONTAINER_RUNNING
        n = len(counted(log))
        await until(lambda log=log, n=n: len(counted(log)) > n + 1, 60)  # type: ignore[misc]
    await gone(kit, sid)
    before = [counted(log) for log in logs]

    again = pod_config(kit, "again")
    restore = pb.RestorePodRequest(
        checkpoint_path=str(out),
        config=again,
        container_configs=[counter_config(name) for name in names],
        runtime_handler="runv",
    )
    resp = await kit.ok("RestorePod", restore)
    assert resp.pod_sandbox_id != sid
    restored = {r.name: r.container_id for r in resp.restored_containers}
    assert sorted(restored) == list(names)
    for rid in restored.values():
        assert await state_of(kit, rid) == pb.CONTAINER_CREATED
    # Restored paused: nothing counted while they wait for their start (what a running one
    # wrote meanwhile would reach the log at once, as the agent keeps a container's output).
    await asyncio.sleep(6)
    new_logs = [os.path.join(again.log_directory, f"{name}.log") for name in names]
    for name, log in zip(names, new_logs, strict=True):
        await kit.ok("StartContainer", pb.StartContainerRequest(container_id=restored[name]))
        await asyncio.sleep(0.5)
        assert len(counted(log)) <= 2, counted(log)
    for name, log, had in zip(names, new_logs, before, strict=True):
        await goes_on(kit, restored[name], log, had)


async def test_a_container_checkpoint_is_the_image_of_a_container_that_counts_on(
    node: tuple[Kit, RunvBackend], tmp_path: Path
) -> None:
    kit = node[0]
    sid, cfg, (cid,) = await counting_pod(kit, "one")
    location = tmp_path / "counter.tar"
    await kit.ok(
        "CheckpointContainer", pb.CheckpointContainerRequest(container_id=cid, location=str(location))
    )
    assert location.is_file() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    await gone(kit, sid)
    before = counted(os.path.join(cfg.log_directory, "counter0.log"))

    other = pod_config(kit, "other")
    osid = (
        await kit.ok("RunPodSandbox", pb.RunPodSandboxRequest(config=other, runtime_handler="runv"))
    ).pod_sandbox_id
    restored_cfg = container_config(name="counter", image=str(location), log_path="restored.log")
    req = pb.CreateContainerRequest(pod_sandbox_id=osid, config=restored_cfg, sandbox_config=other)
    rid = (await kit.ok("CreateContainer", req)).container_id
    assert await state_of(kit, rid) == pb.CONTAINER_CREATED
    await kit.ok("StartContainer", pb.StartContainerRequest(container_id=rid))
    await goes_on(kit, rid, os.path.join(other.log_directory, "restored.log"), before)


async def test_a_failure_in_the_middle_of_a_checkpoint_leaves_the_pod_running_and_nothing_written(
    node: tuple[Kit, RunvBackend], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kit, runv = node
    assert isinstance(runv.checkpoint, VmCheckpoints)
    sid, cfg, cids = await counting_pod(kit, "failing", containers=2)

    def broken(upper: str, out_tar: str) -> list[str]:
        raise OSError(28, "No space left on device (injected)")

    # After the guest's dump, while the containers are paused: the host's read of their layers.
    monkeypatch.setattr(checkpoint_archive, "rootfs_diff", broken)
    out = tmp_path / "ckpt"
    out.mkdir()
    req = pb.CheckpointPodRequest(pod_sandbox_id=sid, output_path=str(out), container_ids=cids)
    code, detail, _ = await kit.call("CheckpointPod", req)
    assert code != Code.OK and "injected" in detail, (code, detail)
    assert os.listdir(out) == []
    assert os.listdir(runv.checkpoint.work_dir) == []
    for i, cid in enumerate(cids):
        assert await state_of(kit, cid) == pb.CONTAINER_RUNNING
        log = os.path.join(cfg.log_directory, f"counter{i}.log")
        n = len(counted(log))
        await until(lambda log=log, n=n: len(counted(log)) > n + 1, 60)  # type: ignore[misc]
