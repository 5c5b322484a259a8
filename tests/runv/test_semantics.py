"""runv specifics critest checks: PID namespace sharing, caps, seccomp, mounts through the VM, metrics.

What every backend guarantees (output complete at the exit, OOMKilled, ExecSync
timeouts, restarts) is in tests/contract.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest

from backends.contract import errors as contract_errors
from backends.runv.agent import oci
from backends.runv.backend import RunvBackend
from cri_api import api_pb2 as pb
from shim.cri import errors
from tests.as_shim import AsShim
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm

IMAGE = "test/busybox:1"


@pytest.mark.parametrize(("mode", "own_ns"), [(pb.POD, False), (pb.NODE, False), (pb.CONTAINER, True)])
async def test_pid_namespace_modes(
    runv: tuple[RunvBackend, Events], mode: pb.NamespaceMode, own_ns: bool
) -> None:
    backend, events = runv
    sb = sandbox_record("pid")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sh", "-c", "sleep 300 & sleep 300"])
    ct.config.linux.security_context.namespace_options.pid = mode
    await backend.lifecycle.create_container(ct, sb)
    sink = MemorySink()
    await events.start(backend.lifecycle, ct, sb, sink)
    res = await backend.exec.exec_sync(ct, ["cat", "/proc/1/cmdline"])
    # PID 1 is the container's own init, or the VM's agent when the pod's namespace is shared.
    assert (b"sleep" in res.stdout) == own_ns, res.stdout
    ps = (await backend.exec.exec_sync(ct, ["ps", "-o", "args"])).stdout
    # POD: the pod's namespace, whose PID 1 is a reaper; the agent is seen only in NODE mode.
    assert (b"backends.runv.agent" in ps) == (mode == pb.NODE), ps
    info = await backend.lifecycle.stop_container(ct, timeout=1)
    assert info.exit_code in (137, 143)
    # The background sleep died with the container: its output closed, nothing outlives it.
    await asyncio.wait_for(sink.closed.wait(), 5)
    await backend.lifecycle.remove_sandbox(sb)


async def test_pid_namespace_target(runv: tuple[RunvBackend, Events]) -> None:
    """TARGET (an ephemeral container's `kubectl debug --target`): the target container's namespace."""
    backend, events = runv
    sb = sandbox_record("target")
    await backend.lifecycle.run_sandbox(sb)
    main = container_record(sb, IMAGE, ["sleep", "7777"], name="main")
    main.config.linux.security_context.namespace_options.pid = pb.CONTAINER
    await backend.lifecycle.create_container(main, sb)
    await events.start(backend.lifecycle, main, sb, MemorySink())
    dbg = container_record(sb, IMAGE, ["sleep", "300"], name="dbg")
    options = dbg.config.linux.security_context.namespace_options
    options.pid, options.target_id = pb.TARGET, main.id
    await backend.lifecycle.create_container(dbg, sb)
    await events.start(backend.lifecycle, dbg, sb, MemorySink())
    assert b"7777" in (await backend.exec.exec_sync(dbg, ["cat", "/proc/1/cmdline"])).stdout
    ps = (await backend.exec.exec_sync(dbg, ["ps", "-o", "args"])).stdout
    assert b"sleep 7777" in ps and b"sleep 300" in ps, ps
    lost = container_record(sb, IMAGE, ["sleep", "300"], name="lost")
    options = lost.config.linux.security_context.namespace_options
    options.pid, options.target_id = pb.TARGET, "f" * 64
    with pytest.raises(contract_errors.InvalidArgumentError, match=r"target container 'f+' .* not running"):
        await backend.lifecycle.create_container(lost, sb)
    await backend.lifecycle.remove_sandbox(sb)


async def test_a_containers_oom_score_adj_is_the_kubelets(runv: tuple[RunvBackend, Events]) -> None:
    """The kubelet ranks containers for the OOM killer by QoS class (Burstable: 2..999, BestEffort 1000);
    a lowering the agent may not make (no CAP_SYS_RESOURCE on the stub's host) starts at 0, not fails."""
    backend, events = runv
    sb = sandbox_record("oom")
    await backend.lifecycle.run_sandbox(sb)
    got = {}
    for name, value in (("burstable", 999), ("guaranteed", -997)):
        ct = container_record(sb, IMAGE, ["sleep", "300"], name=name)
        ct.config.linux.security_context.namespace_options.pid = pb.CONTAINER  # as the kubelet asks
        ct.config.linux.resources.oom_score_adj = value
        await backend.lifecycle.create_container(ct, sb)
        await events.start(backend.lifecycle, ct, sb, MemorySink())
        got[name] = int((await backend.exec.exec_sync(ct, ["cat", "/proc/1/oom_score_adj"])).stdout)
    assert got["burstable"] == 999
    assert got["guaranteed"] in (-997, 0)
    await backend.lifecycle.remove_sandbox(sb)


def test_oom_score_adj_without_cap_sys_resource_is_never_negative() -> None:
    assert oci.oom_score_adj(-997, {"CAP_SYS_RESOURCE"}) == -997
    assert oci.oom_score_adj(-997, set()) == 0
    assert oci.oom_score_adj(999, set()) == 999
    assert oci.oom_score_adj(5000, set()) == 1000


async def test_drop_all_capabilities(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    sb = sandbox_record("caps")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "300"])
    ct.config.linux.security_context.capabilities.drop_capabilities.append("ALL")
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    res = await backend.exec.exec_sync(ct, ["cat", "/proc/self/status"])
    assert b"CapBnd:\t0000000000000000" in res.stdout
    await backend.lifecycle.remove_sandbox(sb)


async def test_seccomp_profiles(runv: tuple[RunvBackend, Events], tmp_path: Path) -> None:
    backend, events = runv
    sb = sandbox_record("seccomp")
    await backend.lifecycle.run_sandbox(sb)
    profile = tmp_path / "block-chmod.json"
    profile.write_text(
        json.dumps(
            {
                "defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["chmod", "fchmodat"], "action": "SCMP_ACT_ERRNO"}],
            }
        )
    )
    local = container_record(sb, IMAGE, ["sleep", "300"], name="local")
    local.config.linux.security_context.seccomp.profile_type = pb.SecurityProfile.Localhost
    local.config.linux.security_context.seccomp.localhost_ref = str(profile)
    default = container_record(sb, IMAGE, ["sleep", "300"], name="default")
    default.config.linux.security_context.seccomp.profile_type = pb.SecurityProfile.RuntimeDefault
    unconfined = container_record(sb, IMAGE, ["sleep", "300"], name="none")
    for ct in (local, default, unconfined):
        await backend.lifecycle.create_container(ct, sb)
        await events.start(backend.lifecycle, ct, sb, MemorySink())
    assert (await backend.exec.exec_sync(local, ["busybox", "chmod", "400", "/tmp"])).exit_code != 0
    assert (await backend.exec.exec_sync(unconfined, ["busybox", "chmod", "700", "/tmp"])).exit_code == 0
    for ct, mode in ((default, b"2"), (unconfined, b"0")):
        status = (await backend.exec.exec_sync(ct, ["cat", "/proc/self/status"])).stdout
        assert b"Seccomp:\t" + mode in status
    await backend.lifecycle.remove_sandbox(sb)


def _make_shared(path: Path, mounted: list[Path]) -> None:
    """Make ``path`` a shared mount (a kubelet host's / is rshared; this machine's is private)."""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    mounted.append(path)
    subprocess.run(["mount", "--make-shared", str(path)], check=True)


async def test_host_mounts_reach_the_vm(runv: tuple[RunvBackend, Events], tmp_path: Path) -> None:
    """Volumes are live shares: mounts made on the host after the VM booted show in containers."""
    backend, events = runv
    share = tmp_path / "share"
    (share / "sub").mkdir(parents=True)
    (share / "early").mkdir()
    sb = sandbox_record("prop")
    await backend.lifecycle.run_sandbox(sb)
    mounted: list[Path] = []
    try:
        # After the VM booted: a shared mount (a kubelet host's / is rshared; this machine's is
        # private) with a submount, before the container is created.
        _make_shared(share, mounted)
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(share / "early")], check=True)
        mounted.append(share / "early")
        (share / "early" / "e").write_text("x")
        ct = container_record(sb, IMAGE, ["sleep", "300"])
        ct.config.mounts.add(
            host_path=str(share), container_path="/mnt/slave", propagation=pb.PROPAGATION_HOST_TO_CONTAINER
        )
        ct.config.mounts.add(host_path=str(share), container_path="/mnt/private")
        await backend.lifecycle.create_container(ct, sb)
        await events.start(backend.lifecycle, ct, sb, MemorySink())
        for path in ("/mnt/slave/early", "/mnt/private/early"):
            assert (await backend.exec.exec_sync(ct, ["ls", path])).stdout == b"e\n"
        # After the container started: only the HOST_TO_CONTAINER mount sees it.
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(share / "sub")], check=True)
        mounted.append(share / "sub")
        (share / "sub" / "flag").write_text("x")
        slave = await backend.exec.exec_sync(ct, ["ls", "/mnt/slave/sub"])
        private = await backend.exec.exec_sync(ct, ["ls", "/mnt/private/sub"])
        assert (slave.stdout, private.stdout) == (b"flag\n", b"")
        # The shares live in the VM only: the host can unmount and delete what it shared.
        with open("/proc/self/mountinfo") as fh:
            assert "/shares/" not in fh.read()
        subprocess.run(["umount", str(share / "early")], check=True)
        mounted.remove(share / "early")
        (share / "early").rmdir()
        await backend.lifecycle.stop_container(ct, timeout=1)
        await backend.lifecycle.remove_container(ct)
        with open("/proc/self/mountinfo") as fh:
            assert not [line for line in fh if "/shares/ct-" in line or "/shares/mnt-" in line]
        # Detaching the shares left the host's own mounts alone.
        assert (share / "sub").is_mount()
    finally:
        for mnt in reversed(mounted):
            subprocess.run(["umount", str(mnt)], check=True)
        await backend.lifecycle.remove_sandbox(sb)


async def test_bidirectional_mounts_reach_the_host(runv: tuple[RunvBackend, Events], tmp_path: Path) -> None:
    """BIDIRECTIONAL (a privileged pod's, as a CSI driver's): what the container mounts under
    it shows on the host; a HOST_TO_CONTAINER mount of the same directory keeps its mounts in."""
    backend, events = runv
    share = tmp_path / "share"
    (share / "up").mkdir(parents=True)
    (share / "kept").mkdir()
    sb = sandbox_record("bidi")
    await backend.lifecycle.run_sandbox(sb)
    mounted: list[Path] = []
    try:
        _make_shared(share, mounted)
        ct = container_record(sb, IMAGE, ["sleep", "300"])
        ct.config.linux.security_context.privileged = True
        ct.config.mounts.add(
            host_path=str(share), container_path="/mnt/both", propagation=pb.PROPAGATION_BIDIRECTIONAL
        )
        ct.config.mounts.add(
            host_path=str(share), container_path="/mnt/slave", propagation=pb.PROPAGATION_HOST_TO_CONTAINER
        )
        await backend.lifecycle.create_container(ct, sb)
        await events.start(backend.lifecycle, ct, sb, MemorySink())
        done = await backend.exec.exec_sync(
            ct, ["sh", "-c", "mount --bind /etc /mnt/both/up && mount -t tmpfs t /mnt/slave/kept"]
        )
        assert done.exit_code == 0, done.stderr
        assert (share / "up").is_mount() and (share / "up" / "hostname").exists()
        mounted.append(share / "up")
        assert not (share / "kept").is_mount()
        await backend.lifecycle.stop_container(ct, timeout=1)
        await backend.lifecycle.remove_container(ct)
    finally:
        for mnt in reversed(mounted):
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        await backend.lifecycle.remove_sandbox(sb)


async def test_kubelet_style_file_and_directory_mounts(
    runv: tuple[RunvBackend, Events], tmp_path: Path
) -> None:
    """The kubelet mounts files (/etc/hosts, /dev/termination-log) and directories (emptyDir)."""
    backend, events = runv
    pod_dir = tmp_path / "pod"
    (pod_dir / "volumes" / "data").mkdir(parents=True)
    hosts = pod_dir / "etc-hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.9 kubelet-pod\n")
    term = pod_dir / "termination-log"
    term.touch()
    config = pod_dir / "config"
    config.write_text("key=value\n")
    sb = sandbox_record("kubelet-mounts")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "300"])
    ct.config.mounts.add(host_path=str(hosts), container_path="/etc/hosts")
    ct.config.mounts.add(host_path=str(term), container_path="/dev/termination-log")
    ct.config.mounts.add(host_path=str(pod_dir / "volumes" / "data"), container_path="/data")
    ct.config.mounts.add(host_path=str(config), container_path="/etc/app.conf", readonly=True)
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())

    async def sh(script: str) -> pb.ExecSyncResponse:
        return await backend.exec.exec_sync(ct, ["sh", "-c", script])

    assert b"kubelet-pod" in (await sh("cat /etc/hosts")).stdout
    assert (await sh("echo bye > /dev/termination-log && echo x > /data/marker")).exit_code == 0
    assert term.read_text() == "bye\n"
    assert (pod_dir / "volumes" / "data" / "marker").read_text() == "x\n"
    assert (await sh("cat /etc/app.conf")).stdout == b"key=value\n"
    assert (await sh("echo no > /etc/app.conf")).exit_code != 0
    assert config.read_text() == "key=value\n"
    # A second container of the pod sees what the first wrote (an emptyDir shared by init and app).
    second = container_record(sb, IMAGE, ["cat", "/data/marker"], name="second")
    second.config.mounts.add(host_path=str(pod_dir / "volumes" / "data"), container_path="/data")
    await backend.lifecycle.create_container(second, sb)
    sink = MemorySink()
    await events.start(backend.lifecycle, second, sb, sink)
    await events.wait_for(lambda: second.id in events.exits)
    assert sink.data["stdout"] == b"x\n"
    await backend.lifecycle.remove_container(second)
    await backend.lifecycle.stop_container(ct, timeout=1)
    await backend.lifecycle.remove_container(ct)
    await backend.lifecycle.remove_sandbox(sb)
    # Nothing of the shares is left mounted on the host.
    with open("/proc/self/mountinfo") as fh:
        assert str(pod_dir) not in fh.read()


async def test_a_missing_mount_source_is_invalid(runv: tuple[RunvBackend, Events], tmp_path: Path) -> None:
    backend, _events = runv
    sb = sandbox_record("missing-mount")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "300"])
    ct.config.mounts.add(host_path=str(tmp_path / "nope"), container_path="/x")
    with pytest.raises(errors.InvalidArgumentError, match="nope"):
        await backend.lifecycle.create_container(ct, sb)
    await backend.lifecycle.remove_sandbox(sb)


async def test_metrics_come_from_the_vms_cgroups_and_network(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    sb = sandbox_record("metrics")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(
        sb, IMAGE, ["sh", "-c", "x=0; while [ $x -lt 20000 ]; do x=$((x+1)); done; sleep 300"]
    )
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    ct.status = dataclasses.replace(ct.status, started_at=time.time_ns())
    names = {d.name for d in AsShim.metric_descriptors()}
    assert {"container_cpu_usage_seconds_total", "container_memory_working_set_bytes"} <= names
    [pm] = await AsShim.sandbox_metrics(backend.metrics, [sb], [ct])
    [cm] = pm.container_metrics
    got = {m.name: m for m in cm.metrics}
    assert set(got) <= names
    assert got["container_memory_working_set_bytes"].value.value > 0
    assert got["container_fs_usage_bytes"].label_values[-1]  # the device of the writable layers
    assert got["container_threads"].value.value >= 1
    assert {m.name for m in pm.metrics} >= {"container_network_receive_bytes_total"}
    stats = await AsShim().container_stats(backend.stats, [ct])
    assert stats[ct.id].cpu.usage_core_nano_seconds.value > 0
    assert stats[ct.id].memory.working_set_bytes.value > 0
    await backend.lifecycle.remove_sandbox(sb)


async def test_an_exec_whose_caller_gives_up_is_killed(runv: tuple[RunvBackend, Events]) -> None:
    """A kubelet's exec probe that hits its own deadline cancels the call: the process goes too."""
    backend, events = runv
    sb = sandbox_record("exec-cancel")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "300"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    call = asyncio.ensure_future(backend.exec.exec_sync(ct, ["sleep", "4322"]))
    for _ in range(50):
        if b"4322" in (await backend.exec.exec_sync(ct, ["ps", "-o", "args"])).stdout:
            break
        await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The agent learns of the cancel over the channel and kills the process: soon, not at once.
    for _ in range(40):
        ps = await backend.exec.exec_sync(ct, ["ps", "-o", "args"])
        if b"4322" not in ps.stdout:
            break
        await asyncio.sleep(0.05)
    assert b"4322" not in ps.stdout and b"sleep 300" in ps.stdout, ps.stdout
    await backend.lifecycle.remove_sandbox(sb)
