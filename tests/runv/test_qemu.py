"""runv's qemu driver: its command line and checks (no QEMU needed), then real VMs under QEMU.

The end-to-end tests boot real virtual machines (under TCG here: tens of seconds each); they
need ``qemu-system-x86_64`` and the guest image (``scripts/runv-guest``), are skipped with a
message without them, and fail in CI (CI=true), which installs both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backends.contract import Capability
from backends.linux import procfs
from backends.linux.cgroups import Cgroup, hierarchies
from backends.runv import config as runv_config
from backends.runv import guest_image
from backends.runv.backend import VM_CRASH_REASON, RunvBackend
from backends.runv.drivers import qemu as qemu_driver
from backends.runv.drivers.qemu import QemuHypervisor, console_summary
from backends.runv.drivers.qemu_initrd import agent_files
from backends.runv.hypervisor import MIB, VM, Fault, PodLimits, VMSpec
from cri_api import api_pb2 as pb
from shim.cri import errors
from tests.runv.helpers import (
    BUSYBOX,
    Events,
    FakePort,
    MemorySink,
    container_record,
    sandbox_record,
    vm_support,
)

GUEST_DIR = os.environ.get("CRI_SHIM_GUEST_DIR", guest_image.DEFAULT_OUT)
IMAGE = "test/busybox:1"


def qemu_support() -> str:
    """Why real VMs cannot boot here, or ""."""
    why = vm_support()
    if why:
        return why
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed (scripts/runv-guest installs it)"
    for name in ("vmlinuz", "initrd.img"):
        if not os.path.exists(os.path.join(GUEST_DIR, name)):
            return f"no guest image in {GUEST_DIR} (build it: scripts/runv-guest --out {GUEST_DIR})"
    return ""


needs_qemu = pytest.mark.skipif(bool(qemu_support()), reason=qemu_support() or "ok")


def _vm(tmp_path: Path, vcpus: int = 2, memory: int = 256 * MIB) -> VM:
    sd = str(tmp_path / "vm1")
    return VM("vm1", "qemu", 0, vcpus, memory, sd, os.path.join(sd, "agent.sock"))


# ---------------------------------------------------------------------------- no QEMU needed
def test_command_line_describes_the_vm(tmp_path: Path) -> None:
    hv = QemuHypervisor({"run_dir": str(tmp_path), "guest_memory_mib": 64, "kernel_args": ["loglevel=3"]})
    vm = _vm(tmp_path)
    argv = hv.argv(vm, "/g/vmlinuz", "/g/initrd", "tcg", "rvtap0")
    line = " ".join(argv)
    assert argv[0] == "qemu-system-x86_64"
    assert "-machine pc -accel accel=tcg,tb-size=64" in line and "-cpu max" in line
    assert "-smp 2" in line and "-m 320M" in line  # the pod's 256 MiB + the guest's 64
    assert "-no-reboot" in argv and "-nodefaults" in argv
    assert f"socket,id=agent,path={vm.channel},server=on,wait=off" in argv
    assert "virtserialport,bus=vser.0,chardev=agent,name=runv.agent" in argv
    # Confined (the default): QEMU's seccomp sandbox, and the shares through the 9p proxy.
    assert f"proxy,id=shares,socket={vm.state_dir}/9p.sock" in argv
    assert "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny" in argv
    open_argv = QemuHypervisor({"run_dir": str(tmp_path), "confine": False}).argv(vm, "/k", "/i", "tcg", "")
    assert (
        f"local,id=shares,path={vm.state_dir}/shares,security_model=passthrough,multidevs=remap" in open_argv
    )
    assert "-sandbox" not in open_argv
    assert "tap,id=net0,ifname=rvtap0,script=no,downscript=no" in argv
    append = argv[argv.index("-append") + 1].split()
    assert "console=ttyS0" in append and "runv.shares=/run/runv/shares" in append and "loglevel=3" in append
    assert "runv.fail_boot=1" not in append
    failing = hv.argv(vm, "/g/vmlinuz", "/g/initrd", "kvm", "", fail_boot=True)
    assert "runv.fail_boot=1" in failing[failing.index("-append") + 1].split()
    assert "host" in failing and "-netdev" not in failing  # KVM: the host's CPU; no tap, no NIC


def test_the_guest_ram_is_never_below_what_its_kernel_boots_in(tmp_path: Path) -> None:
    """The kernel unpacks the initramfs while its archive is in memory: a pod of 32 MiB (160 MiB
    of RAM with the guest's 96 and the handler's 32) failed to boot with the 36.5 MiB image."""
    guest = tmp_path / "guest"
    guest.mkdir()
    with open(guest / "initrd.img", "wb") as fh:
        fh.truncate(36_533_328)  # the default image's size here (sparse)
    hv = QemuHypervisor({"run_dir": str(tmp_path), "guest_dir": str(guest)})
    assert hv.boot_memory == 192 * MIB
    small = _vm(tmp_path, 1, 64 * MIB)
    assert hv.ram_bytes(small) == 192 * MIB and "-m 192M" in " ".join(hv.argv(small, "/k", "/i", "tcg", ""))
    big = _vm(tmp_path, 1, 512 * MIB)
    assert hv.ram_bytes(big) == 512 * MIB + hv.guest_memory
    assert QemuHypervisor({"run_dir": str(tmp_path), "guest_dir": str(tmp_path / "none")}).boot_memory == 0


def test_names_fit_the_kernel_limits() -> None:
    tap = QemuHypervisor.tap_name("w" + "f" * 15)
    assert len(tap) <= 15 and tap.startswith("rv")
    mac = QemuHypervisor.mac("vm1")
    assert mac.startswith("52:54:") and len(mac.split(":")) == 6
    assert QemuHypervisor.tap_name("a") != QemuHypervisor.tap_name("b")


def test_config_keys_are_checked() -> None:
    runv_config.check(
        "q", {"driver": "qemu", "qemu": {"accel": "tcg", "boot_timeout": 90, "kernel_args": ["x"]}}
    )
    with pytest.raises(errors.InvalidArgumentError, match=r"\[handlers.q.qemu\] unknown key 'acel'"):
        runv_config.check("q", {"qemu": {"acel": "tcg"}})
    with pytest.raises(errors.InvalidArgumentError, match="accel must be auto, kvm or tcg"):
        QemuHypervisor({"accel": "xen"})


def test_backend_picks_the_driver(tmp_path: Path) -> None:
    base: dict[str, Any] = {"root": str(tmp_path / "root"), "run_dir": str(tmp_path / "run")}
    backend = RunvBackend("q", {**base, "driver": "qemu", "qemu": {"guest_dir": str(tmp_path)}})
    assert backend.hv.name == "qemu"
    # A VM cannot share the host's network; it has its own kernel for recursive read-only mounts.
    assert not backend.capabilities & Capability.HOST_NETWORK
    assert backend.capabilities & Capability.RECURSIVE_READ_ONLY_MOUNTS
    assert RunvBackend("s", base).hv.name == "stub"
    with pytest.raises(errors.InvalidArgumentError, match="driver must be 'stub' or 'qemu'"):
        RunvBackend("x", {**base, "driver": "xen"})


async def test_refusals_before_anything_is_made(tmp_path: Path) -> None:
    hv = QemuHypervisor({"run_dir": str(tmp_path / "run"), "guest_dir": str(tmp_path / "none")})
    with pytest.raises(errors.FailedPreconditionError, match="scripts/runv-guest"):
        await hv.create(VMSpec("vm1", 1, 128 * MIB))
    with pytest.raises(errors.InvalidArgumentError, match="host's network"):
        await hv.create(VMSpec("vm1", 1, 128 * MIB, host_network=True))
    with pytest.raises(errors.InvalidArgumentError, match="too small"):
        await hv.create(VMSpec("vm1", 0, 128 * MIB))
    assert hv.capacity()[0] == 0 and not os.path.exists(tmp_path / "run" / "vm1")
    vm = _vm(tmp_path)
    with pytest.raises(errors.FailedPreconditionError, match="cannot add vCPUs"):
        await hv.set_vcpus(vm, 3)
    with pytest.raises(errors.FailedPreconditionError, match="cannot add memory"):
        await hv.set_memory(vm, 512 * MIB)
    await hv.set_vcpus(vm, 1)  # within what it booted with: nothing to do
    # UpdatePodSandboxResources: the guest keeps its vCPUs and RAM (no hot-plug, no balloon).
    with pytest.raises(errors.FailedPreconditionError, match="cannot give a running VM the 3"):
        await hv.set_pod_limits(vm, PodLimits(3, vm.memory_bytes))
    with pytest.raises(errors.FailedPreconditionError, match="cannot add memory"):
        await hv.set_pod_limits(vm, PodLimits(vm.vcpus, vm.memory_bytes * 2))
    with pytest.raises(errors.FailedPreconditionError, match="cannot take memory back"):
        await hv.set_pod_limits(vm, PodLimits(vm.vcpus, vm.memory_bytes // 2))
    with pytest.raises(errors.UnimplementedError, match="BIDIRECTIONAL"):
        await hv.attach_share(vm, "t", str(tmp_path), readonly=False, bidirectional=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroupfs")
async def test_pod_limits_bound_qemus_cgroup_but_not_its_memory(tmp_path: Path) -> None:
    """Fewer vCPUs, CPU shares and a cpuset go to QEMU's cgroup; its memory limit stays what it
    booted with (the guest's RAM, the guest's own and QEMU's: the guest keeps its RAM)."""
    parent = f"cri-shim-qemu-test-{os.getpid()}"
    hv = QemuHypervisor({"run_dir": str(tmp_path / "run"), "cgroup_parent": parent})
    vm = _vm(tmp_path)
    cg = Cgroup(f"{parent}/{vm.id}")
    cg.create()
    try:
        before = _limits(cg)
        await hv.set_pod_limits(vm, PodLimits(1, vm.memory_bytes, cpu_shares=512, cpuset_cpus="0"))
        after = _limits(cg)
        assert after["quota"] == 100_000 and after["shares"] == 512 and after["cpus"] == "0"
        assert after["memory"] == before["memory"]
        assert (vm.vcpus, vm.memory_bytes) == (2, 256 * MIB)  # the guest keeps what it booted with
    finally:
        cg.remove()
        Cgroup(parent).remove()


def _limits(cg: Cgroup) -> dict[str, object]:
    """Quota (µs a period), shares, cpuset and memory limit of ``cg``, v1 or v2."""

    def read(d: str, name: str) -> str:
        with open(os.path.join(d, name)) as fh:
            return fh.read().strip()

    mounts = hierarchies()
    if cg.v2:
        (d,) = cg.dirs()
        quota = read(d, "cpu.max").split()[0]
        weight = int(read(d, "cpu.weight"))
        return {
            "quota": -1 if quota == "max" else int(quota),
            "shares": 2 + ((weight - 1) * 262142) // 9999,
            "cpus": read(d, "cpuset.cpus"),
            "memory": read(d, "memory.max"),
        }
    at = {c: os.path.join(mounts.v1[c], cg.rel) for c in ("cpu", "memory", "cpuset")}
    return {
        "quota": int(read(at["cpu"], "cpu.cfs_quota_us")),
        "shares": int(read(at["cpu"], "cpu.shares")),
        "cpus": read(at["cpuset"], "cpuset.cpus") if os.path.isdir(at["cpuset"]) else "",
        "memory": read(at["memory"], "memory.limit_in_bytes"),
    }


def test_console_summary_says_why() -> None:
    console = "\n".join(
        [
            "[    1.0] booting",
            "runv-init: cannot mount the shares",
            "[    4.4] Kernel panic - not syncing: x",
            "trace",
        ]
    )
    summary = console_summary(console)
    assert "runv-init: cannot mount the shares" in summary and "Kernel panic" in summary
    assert "trace" not in summary
    assert console_summary("a\nb\nc") == "a | b | c"


def test_agent_is_appended_with_its_bytecode(tmp_path: Path) -> None:
    files = agent_files()
    assert "opt/runv/backends/runv/agent/server.py" in files
    assert "opt/runv/backends/linux/cgroups.py" in files
    assert files["opt/runv/backends/runv/__init__.py"] == b""  # not the host-side package
    if sys.version_info[:2] == (3, 11):
        assert any(n.endswith(".cpython-311.pyc") for n in files)
    out = tmp_path / "agent.cpio"
    guest_image.write_cpio_files(str(out), {"a/b.txt": b"hello", "c.txt": b""})
    if BUSYBOX is not None:
        with out.open("rb") as fh:
            listing = subprocess.run([BUSYBOX, "cpio", "-t"], stdin=fh, capture_output=True, check=True)
        assert listing.stdout.decode().split() == ["a", "a/b.txt", "c.txt"]
        extract = tmp_path / "x"
        extract.mkdir()
        with out.open("rb") as fh:
            subprocess.run(
                [BUSYBOX, "cpio", "-i", "-d"], stdin=fh, cwd=extract, check=True, capture_output=True
            )
        assert (extract / "a" / "b.txt").read_bytes() == b"hello"


def test_an_image_of_another_recipe_is_rebuilt(tmp_path: Path) -> None:
    import json

    assert not guest_image.current(str(tmp_path))  # nothing there
    for name in ("vmlinuz", "initrd.img"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": "older"}))
    assert not guest_image.current(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": guest_image.recipe()}))
    assert guest_image.current(str(tmp_path))


def test_modules_come_with_their_dependencies(tmp_path: Path) -> None:
    mods = tmp_path / "kernel"
    mods.mkdir()
    (mods / "base.ko").write_bytes(b"\x7fELF\0depends=\0name=base\0")
    (mods / "mid.ko").write_bytes(b"\x7fELF\0depends=base\0name=mid\0")
    (mods / "top-x.ko").write_bytes(b"\x7fELF\0depends=mid,builtin_one\0name=top_x\0")
    assert guest_image.module_order(str(tmp_path), ["top_x"]) == [
        "kernel/base.ko",
        "kernel/mid.ko",
        "kernel/top-x.ko",
    ]
    with pytest.raises(SystemExit, match="no module nope"):
        guest_image.module_order(str(tmp_path), ["nope"])


# ---------------------------------------------------------------------------- a stand-in QEMU
# A script in QEMU's place: it writes what the guest would print on the console (or not), and
# sleeps like a running VM. The driver's life cycle runs for real around it: tap, cgroup, mount
# namespace, the wait for the agent, destroy, leftovers and adoption after a restart.
FAKE_QEMU = r"""#!/bin/sh
console= pidfile=
prev=
for a in "$@"; do
    case "$prev" in
        -chardev) case "$a" in file,id=console,path=*) console=${a#file,id=console,path=};; esac;;
        -pidfile) pidfile=$a;;
    esac
    prev=$a
done
# The pid file and the console are written after the exec, as QEMU does: while a process
# execs, its command line can read empty, and a reader would take it for another process.
export FAKE_PIDFILE=$pidfile FAKE_CONSOLE=$console
exec python3 -c "$FAKE_VM" "$@"  # a VM process whose command line is QEMU's
"""
FAKE_VM = """
import os, sys, time
with open(os.environ["FAKE_PIDFILE"], "w") as f:
    f.write(f"{os.getpid()}\\n")
mode = os.environ["FAKE_QEMU_MODE"]
if mode == "kvm-blank":  # a /dev/kvm whose guests never run: not a byte on the console
    mode = "blank" if any("accel=kvm" in a for a in sys.argv) else "ready"
with open(os.environ["FAKE_CONSOLE"], "a") as c:
    if mode != "blank":
        c.write("[    0.1] booting\\n")
    if mode == "ready":
        c.write("runv-agent: ready on /dev/vport0p1\\n")
    elif mode == "panic":
        c.write("runv-init: cannot mount the shares\\n[ 4.4] Kernel panic - not syncing\\n")
if mode == "panic":
    sys.exit(1)
time.sleep(600)
"""


def _fake_qemu(tmp_path: Path, mode: str, **extra: Any) -> QemuHypervisor:
    script = tmp_path / "fake-qemu"
    script.write_text(FAKE_QEMU)
    script.chmod(0o755)
    guest = tmp_path / "guest"
    guest.mkdir(exist_ok=True)
    (guest / "vmlinuz").write_bytes(b"k")
    (guest / "initrd.img").write_bytes(b"i")
    os.environ["FAKE_QEMU_MODE"] = mode
    os.environ["FAKE_VM"] = FAKE_VM
    run_dir = f"/tmp/rvq-{os.getpid()}-{mode}"
    return QemuHypervisor(
        {
            "run_dir": run_dir,
            "guest_dir": str(guest),
            "qemu": str(script),
            "accel": "tcg",
            "cgroup_parent": f"cri-shim-qemu-test-{os.getpid()}",
            **extra,
        }
    )


@pytest.mark.skipif(bool(vm_support()), reason=vm_support() or "ok")
async def test_life_cycle_around_a_stand_in(tmp_path: Path) -> None:
    hv = _fake_qemu(tmp_path, "ready")
    vm: VM | None = None
    try:
        vm = await hv.create(VMSpec("lc1", 2, 128 * MIB))
        assert hv.alive(vm) and os.path.exists(os.path.join(vm.state_dir, "console.log"))
        assert QemuHypervisor.tap_name("lc1") in _taps()
        assert hv.capacity()[:3] == (2, hv.total_vcpus, 128 * MIB + hv.guest_memory)
        with open(f"/proc/{vm.pid}/cmdline", "rb") as fh:
            assert b"virtserialport" in fh.read()  # the stand-in got the real command line
        # Another driver (a restarted shim) finds it by its pid file and takes it over.
        again = _fake_qemu(tmp_path, "ready")
        (found,) = again.leftovers(set())
        assert (found.id, found.pid, found.started_at) == (vm.id, vm.pid, vm.started_at)
        assert await again.adopt(vm) and again.capacity()[0] == 2
        assert again.leftovers({"lc1"}) == []
        await again.destroy(vm)
        assert not hv.alive(vm) and not os.path.exists(vm.state_dir)
        assert QemuHypervisor.tap_name("lc1") not in _taps() and again.capacity()[0] == 0
        await again.destroy(vm)  # idempotent
        await again.close()
    finally:
        if vm is not None:
            await hv.destroy(vm)
        hv.tidy()
        await hv.close()


@pytest.mark.skipif(bool(vm_support()), reason=vm_support() or "ok")
async def test_a_guest_that_dies_or_never_answers_leaves_nothing(tmp_path: Path) -> None:
    for mode, error, said in (
        ("panic", errors.UnavailableError, "runv-init: cannot mount the shares | [ 4.4] Kernel panic"),
        ("silent", errors.DeadlineExceededError, "did not come up within 1s (tcg)"),
    ):
        hv = _fake_qemu(tmp_path, mode, boot_timeout=1)
        try:
            with pytest.raises(error) as info:
                await hv.create(VMSpec("lc2", 1, 128 * MIB))
            assert said in str(info.value)
            assert hv.capacity()[0] == 0 and QemuHypervisor.tap_name("lc2") not in _taps()
            assert [e for e in os.listdir(hv.run_dir) if not e.startswith("initrd-")] == []
            assert not Cgroup(f"{hv.cgroup_parent}/lc2").pids()
        finally:
            hv.tidy()
            await hv.close()


@pytest.mark.skipif(bool(vm_support()), reason=vm_support() or "ok")
async def test_a_kvm_whose_guest_prints_nothing_is_left_for_tcg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qemu_driver, "kvm_openable", lambda: True)
    hv = _fake_qemu(tmp_path, "kvm-blank", accel="auto", boot_timeout=1)
    vms: list[VM] = []
    try:
        vms.append(await hv.create(VMSpec("lc3", 1, 128 * MIB)))
        vms.append(await hv.create(VMSpec("lc4", 1, 128 * MIB)))  # straight to TCG
        assert hv.accel == "tcg"
        for vm in vms:
            with open(f"/proc/{vm.pid}/cmdline", "rb") as fh:
                assert b"accel=tcg" in fh.read()
    finally:
        for vm in vms:
            await hv.destroy(vm)
        hv.tidy()
        await hv.close()


@pytest.mark.skipif(bool(vm_support()), reason=vm_support() or "ok")
async def test_a_guest_that_printed_and_hangs_under_kvm_is_not_blamed_on_kvm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qemu_driver, "kvm_openable", lambda: True)
    hv = _fake_qemu(tmp_path, "silent", accel="auto", boot_timeout=1)
    try:
        with pytest.raises(errors.DeadlineExceededError, match=r"within 1s \(kvm\)"):
            await hv.create(VMSpec("lc5", 1, 128 * MIB))
        assert hv.accel == "kvm"
    finally:
        hv.tidy()
        await hv.close()


# ---------------------------------------------------------------------------- real VMs
def _qemu_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        **cfg,
        "driver": "qemu",
        "agent_timeout": 60.0,
        "qemu": {
            "guest_dir": GUEST_DIR,
            "cgroup_parent": cfg["stub"]["cgroup_parent"],
            "capacity_vcpus": 4,
            "capacity_memory": 2 << 30,
        },
    }


def _taps() -> set[str]:
    return {n for n in os.listdir("/sys/class/net") if n.startswith("rv")}


def _alive(pid: int) -> bool:
    st = procfs.stat(pid)
    return st is not None and st.state != "Z"


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(600)
async def test_a_pod_is_a_virtual_machine(
    runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path
) -> None:
    """One VM through its life: containers, mounts, logs, exec, port-forward, stats, a shim restart."""
    cfg = _qemu_config(runv_config)
    ro_dir, rw_dir = tmp_path / "ro", tmp_path / "rw"
    ro_dir.mkdir()
    rw_dir.mkdir()
    (ro_dir / "data").write_text("from the host\n")
    # A host mount under the read-only directory keeps its own mode (a non-recursive mount).
    (ro_dir / "tmp").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(ro_dir / "tmp")], check=True)
    first = RunvBackend("runv", cfg)
    ev1 = Events()
    await first.lifecycle.start(ev1)
    first.image_store.import_dir(IMAGE, str(busybox_rootfs))
    sb = sandbox_record("vm")
    second: RunvBackend | None = None
    try:
        net = await first.lifecycle.run_sandbox(sb)
        sb.committed = True
        vm = first._shared.pods[sb.id].vm
        assert vm.driver == "qemu" and _alive(vm.pid) and net.ip
        console = first.hv.console(vm)
        assert "runv-agent: ready" in console, console[-2000:]

        ct = container_record(
            sb,
            IMAGE,
            ["sh", "-c", "echo hello from the guest; echo pong | nc -l -p 8080; sleep 600"],
            mounts=[
                pb.Mount(container_path="/ro", host_path=str(ro_dir), readonly=True),
                pb.Mount(container_path="/rw", host_path=str(rw_dir)),
            ],
        )
        await first.lifecycle.create_container(ct, sb)
        sink = MemorySink()
        await ev1.start(first.lifecycle, ct, sb, sink)
        ct.committed = True
        for _ in range(300):
            if b"hello from the guest" in sink.data["stdout"]:
                break
            await asyncio.sleep(0.1)
        assert b"hello from the guest" in sink.data["stdout"]

        # Its own kernel: the guest's release is Debian's, not necessarily the host's.
        res = await first.exec.exec_sync(ct, ["cat", "/proc/sys/kernel/osrelease"])
        assert res.exit_code == 0 and res.stdout.strip() == _guest_release().encode(), res
        res = await first.exec.exec_sync(ct, ["sh", "-c", "cat /ro/data && echo from-vm > /rw/out"])
        assert (res.exit_code, res.stdout) == (0, b"from the host\n"), res
        res = await first.exec.exec_sync(ct, ["sh", "-c", "echo x > /ro/new"])
        assert res.exit_code != 0 and b"Read-only" in res.stderr, res
        res = await first.exec.exec_sync(ct, ["sh", "-c", "echo y > /ro/tmp/y"])
        assert res.exit_code == 0 and (ro_dir / "tmp" / "y").read_text() == "y\n", res
        assert (rw_dir / "out").read_text() == "from-vm\n" and not (ro_dir / "new").exists()

        port = FakePort(b"ping\n")
        for _ in range(100):  # nc may not listen yet
            try:
                await first.exec.port_forward(sb, 8080, port)
            except errors.CriError:
                await asyncio.sleep(0.2)
                continue
            if port.got:
                break
            port = FakePort(b"ping\n")
        assert bytes(port.got) == b"pong\n"

        usage = await first.stats.container_stats([ct])
        assert (usage[ct.id].sample.memory_usage or 0) > 0
        cpu, memory = first.hv.usage(vm)
        assert cpu > 0 and memory > 0  # the QEMU process, as the host sees it

        # The shim goes away; the VM stays and a new one takes it over through its sockets.
        await ev1.close()
        await first.lifecycle.close()
        assert _alive(vm.pid)
        second = RunvBackend("runv", cfg)
        ev2 = Events()
        await second.lifecycle.start(ev2)
        sb_obs, ct_obs = await second.lifecycle.recover([sb], [ct])
        assert sb_obs[sb.id].running and ct_obs[ct.id].running
        res = await second.exec.exec_sync(ct, ["echo", "back"])
        assert res.stdout == b"back\n"

        await second.lifecycle.stop_container(ct, 2)
        await second.lifecycle.remove_container(ct)
        await second.lifecycle.stop_sandbox(sb)
        await second.lifecycle.remove_sandbox(sb)
        await ev2.close()
        assert not _alive(vm.pid)
        assert not os.path.exists(vm.state_dir)
        assert QemuHypervisor.tap_name(vm.id) not in _taps()
    finally:
        for b in (first, second):
            if b is not None:
                if sb.id in b._shared.pods:  # a failure half-way: the VM, its tap and its veth go
                    with contextlib.suppress(Exception):
                        await b.lifecycle.stop_sandbox(sb)
                await b.lifecycle.close()
        subprocess.run(["umount", "-l", str(ro_dir / "tmp")], check=False)


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(300)
async def test_a_vm_that_does_not_boot_leaves_nothing(
    runv_config: dict[str, Any], busybox_rootfs: Path
) -> None:
    backend = RunvBackend("runv", _qemu_config(runv_config))
    events = Events()
    await backend.lifecycle.start(events)
    try:
        backend.inject(Fault.BOOT_FAILURE)
        sb = sandbox_record("noboot")
        with pytest.raises(errors.UnavailableError, match="injected boot failure"):
            await backend.lifecycle.run_sandbox(sb)
        assert backend.hv.capacity()[0] == 0
        assert [e for e in os.listdir(backend.hv.run_dir) if not e.startswith("initrd-")] == []  # type: ignore[attr-defined]
        assert QemuHypervisor.tap_name(sb.id[:16]) not in _taps()
    finally:
        await events.close()
        await backend.lifecycle.close()


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(300)
async def test_a_crashed_vm_exits_its_containers(runv_config: dict[str, Any], busybox_rootfs: Path) -> None:
    backend = RunvBackend("runv", _qemu_config(runv_config))
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs))
    sb = sandbox_record("crash")
    try:
        await backend.lifecycle.run_sandbox(sb)
        ct = container_record(sb, IMAGE, ["sleep", "600"])
        await backend.lifecycle.create_container(ct, sb)
        await events.start(backend.lifecycle, ct, sb, MemorySink())
        vm = backend._shared.pods[sb.id].vm
        backend.inject(Fault.CRASH, sb.id)  # SIGKILL of QEMU
        await events.wait_for(lambda: ct.id in events.exits and sb.id in events.not_ready, timeout=60)
        assert events.exits[ct.id].reason == VM_CRASH_REASON
        assert not _alive(vm.pid)
        await backend.lifecycle.stop_sandbox(sb)
        await backend.lifecycle.remove_container(ct)
        assert not os.path.exists(vm.state_dir) and QemuHypervisor.tap_name(vm.id) not in _taps()
    finally:
        if sb.id in backend._shared.pods:
            with contextlib.suppress(Exception):
                await backend.lifecycle.stop_sandbox(sb)
        await events.close()
        await backend.lifecycle.close()


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(300)
async def test_qemu_is_confined_and_runs_in_its_pods_cgroup(
    runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path
) -> None:
    """QEMU runs as a uid of its own, with no capabilities, under its seccomp filter, in a root
    that holds its own files only, and in a cgroup below the pod's, within the pod's limit."""
    from tests.runv.test_pod_cgroup import PodCgroup

    pod_cgroup = PodCgroup("cgroupfs")
    # On 9p, served by QEMU's proxy helper (virtiofsd's sandbox: test_qemu_virtiofs.py).
    config = _qemu_config(runv_config)
    config["qemu"]["shares"] = "9p"
    backend = RunvBackend("runv", config)
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs))
    rw_dir = tmp_path / "rw"
    rw_dir.mkdir()
    # As the kubelet sizes it: the container's 128 MiB plus a RuntimeClass overhead of 512 MiB,
    # which covers the guest's own memory and QEMU's.
    pod_cgroup.limit(640 * MIB)
    sb = sandbox_record("confined", memory_limit_in_bytes=128 * MIB)
    sb.config.linux.cgroup_parent = pod_cgroup.parent
    sb.config.linux.overhead.memory_limit_in_bytes = 512 * MIB
    try:
        await backend.lifecycle.run_sandbox(sb)
        vm = backend._shared.pods[sb.id].vm
        status = _status(vm.pid)
        uid = status["Uid"].split()
        assert uid[0] != "0" and len(set(uid)) == 1, status["Uid"]
        assert status["Gid"].split()[0] != "0" and status["Groups"].strip() == ""
        assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
        assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == "0000000000000000"
        # Its root: /usr, /dev, /proc, its guest files and its state directory, nothing else.
        root = f"/proc/{vm.pid}/root"
        tops = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc"}
        tops |= {p.split("/")[1] for p in (vm.state_dir, GUEST_DIR)}
        assert set(os.listdir(root)) <= tops, os.listdir(root)
        assert os.listdir(f"{root}/etc") == ["ld.so.cache"]
        assert sorted(os.listdir(f"{root}/dev")) == [
            "net",
            "null",
            "random",
            "urandom",
            "zero",
        ] or os.path.exists(f"{root}/dev/kvm")
        # Its /proc shows QEMU's user its own processes only.
        as_qemu = ["nsenter", f"--mount=/proc/{vm.pid}/ns/mnt", "setpriv", f"--reuid={uid[0]}"]
        as_qemu += [f"--regid={uid[0]}", "--clear-groups", "ls", "/proc"]
        seen_pids = {
            n for n in subprocess.run(as_qemu, capture_output=True, text=True, check=True).stdout.split()
        }
        assert str(vm.pid) in seen_pids and "1" not in seen_pids
        # Of the run directory: its own state and the initramfs it boots, no other VM's.
        seen = os.listdir(os.path.dirname(f"{root}{vm.state_dir}"))
        assert vm.id in seen and all(n == vm.id or n.startswith("initrd-") for n in seen), seen
        # Its cgroup is below the pod's in every hierarchy, within the pod's memory limit.
        assert pod_cgroup.holds(vm.pid) == []
        assert vm.cgroup == f"{pod_cgroup.rel}/{vm.id}"
        assert pod_cgroup.memory_limit(vm.cgroup) == 640 * MIB
        # The shares still work, through the 9p proxy: a container writes a volume as root.
        ct = container_record(
            sb,
            IMAGE,
            ["sh", "-c", "echo from-vm > /rw/out; sleep 600"],
            mounts=[pb.Mount(container_path="/rw", host_path=str(rw_dir))],
        )
        await backend.lifecycle.create_container(ct, sb)
        await events.start(backend.lifecycle, ct, sb, MemorySink())
        for _ in range(300):
            if (rw_dir / "out").exists() and (rw_dir / "out").read_text():
                break
            await asyncio.sleep(0.1)
        assert (rw_dir / "out").read_text() == "from-vm\n" and (rw_dir / "out").stat().st_uid == 0
        # A file of the image deleted: a whiteout made on the writable layer, through the share.
        res = await backend.exec.exec_sync(ct, ["sh", "-c", "rm /bin/true && ! test -e /bin/true"])
        assert res.exit_code == 0, res
        # The 9p proxy: chrooted into the VM's shares, its file capabilities only, not QEMU's user.
        (proxy,) = [p for p in set(Cgroup(vm.cgroup).pids()) if p != vm.pid]
        assert os.readlink(f"/proc/{proxy}/root") == f"{vm.state_dir}/shares"
        assert (
            int(_status(proxy)["CapEff"], 16) & ~0x080000DB == 0
        )  # chown, dac, fowner, fsetid, set[ug]id, mknod
        await backend.lifecycle.stop_container(ct, 1)
        await backend.lifecycle.stop_sandbox(sb)
        await backend.lifecycle.remove_sandbox(sb)
    finally:
        if sb.id in backend._shared.pods:
            with contextlib.suppress(Exception):
                await backend.lifecycle.stop_sandbox(sb)
        await events.close()
        await backend.lifecycle.close()
        assert not pod_cgroup.remove()


def _guest_release() -> str:
    import json

    with open(os.path.join(GUEST_DIR, "manifest.json")) as fh:
        return str(json.load(fh)["kernel"])


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(300)
async def test_a_pod_of_32_mib_boots(runv_config: dict[str, Any], busybox_rootfs: Path) -> None:
    """Its VM gets the RAM its kernel boots in (boot_memory), not only the pod's and the guest's."""
    backend = RunvBackend("runv", _qemu_config(runv_config))
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs))
    sb = sandbox_record("small", memory_limit_in_bytes=32 * MIB)
    try:
        await backend.lifecycle.run_sandbox(sb)
        vm = backend._shared.pods[sb.id].vm
        assert isinstance(backend.hv, QemuHypervisor)
        assert backend.hv.ram_bytes(vm) >= backend.hv.boot_memory > vm.memory_bytes + backend.hv.guest_memory
        ct = container_record(sb, IMAGE, ["sh", "-c", "echo small; sleep 600"])
        await backend.lifecycle.create_container(ct, sb)
        sink = MemorySink()
        await events.start(backend.lifecycle, ct, sb, sink)
        await events.wait_for(lambda: b"small" in bytes(sink.data["stdout"]), timeout=60)
    finally:
        with contextlib.suppress(Exception):
            await backend.lifecycle.stop_sandbox(sb)
        await events.close()
        await backend.lifecycle.close()
