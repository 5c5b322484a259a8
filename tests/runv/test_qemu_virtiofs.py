"""runv's qemu driver on virtio-fs: its command line and choice (no QEMU needed), the share
helper's host-side overlay and read-only shares seen through a shared mount point (namespaces
only), then a real VM under QEMU (gated as in test_qemu.py: skipped without QEMU and the guest
image, a failure in CI)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from backends import reference
from backends.linux import procfs
from backends.linux.cgroups import Cgroup
from backends.runv import config as runv_config_mod
from backends.runv.backend import RunvBackend
from backends.runv.drivers import inject_overlay, qemu_snapshot, qemu_virtiofs
from backends.runv.drivers.base import Injector
from backends.runv.drivers.qemu import QemuHypervisor
from backends.runv.hypervisor import MIB, VM
from backends.runv.images.store import Image
from cri_api import api_pb2 as pb
from shim.cri import errors
from tests.runv.helpers import Events, MemorySink, container_record, sandbox_record, vm_support
from tests.runv.test_qemu import GUEST_DIR, IMAGE, _alive, _qemu_config, _status, _taps, needs_qemu

INJECT_PY = os.path.join(os.path.dirname(qemu_virtiofs.__file__), "inject.py")


def _vm(tmp_path: Path) -> VM:
    sd = str(tmp_path / "vm1")
    os.makedirs(sd, exist_ok=True)
    return VM("vm1", "qemu", 0, 2, 256 * MIB, sd, os.path.join(sd, "agent.sock"))


def _guest(tmp_path: Path, modules: list[str]) -> str:
    guest = tmp_path / "guest"
    guest.mkdir(exist_ok=True)
    (guest / "manifest.json").write_text(json.dumps({"modules": modules}))
    return str(guest)


# ---------------------------------------------------------------------------- no QEMU needed
def test_a_virtiofs_vm_has_shared_ram_and_a_vhost_user_device(tmp_path: Path) -> None:
    hv = QemuHypervisor({"run_dir": str(tmp_path), "guest_memory_mib": 64})
    vm = _vm(tmp_path)
    qemu_virtiofs.mark(vm, "virtiofs")
    argv = hv.argv(vm, "/g/vmlinuz", "/g/initrd", "tcg", "")
    line = " ".join(argv)
    assert "-machine pc,memory-backend=ram" in line and "-m 320M" in line
    assert "memory-backend-memfd,id=ram,size=320M,share=on" in argv
    assert f"socket,id=vfs,path={vm.state_dir}/virtiofs.sock" in argv
    assert "vhost-user-fs-pci,id=vfs0,chardev=vfs,tag=shares,addr=0x10" in argv
    assert "runv.sharefs=virtiofs" in argv[argv.index("-append") + 1].split()
    assert "-fsdev" not in argv and "virtio-9p-pci,fsdev=shares,mount_tag=shares" not in argv
    # The same VM on 9p: QEMU's private RAM, the 9p proxy.
    qemu_virtiofs.mark(vm, "9p")
    argv = hv.argv(vm, "/g/vmlinuz", "/g/initrd", "tcg", "")
    assert (
        "pc" in argv
        and "-object" not in argv
        and "vhost-user-fs-pci,id=vfs0,chardev=vfs,tag=shares,addr=0x10" not in argv
    )
    assert f"proxy,id=shares,socket={vm.state_dir}/9p.sock" in argv
    assert "runv.sharefs=virtiofs" not in argv[argv.index("-append") + 1]


def test_the_shares_setting_and_its_default(tmp_path: Path) -> None:
    runv_config_mod.check("q", {"driver": "qemu", "qemu": {"shares": "9p", "virtiofsd": "/x"}})
    with pytest.raises(errors.InvalidArgumentError, match="shares must be virtiofs or 9p, not 'nfs'"):
        QemuHypervisor({"shares": "nfs"})
    daemon = tmp_path / "virtiofsd"
    daemon.write_text("#!/bin/sh\n")
    daemon.chmod(0o755)
    with_module = _guest(tmp_path, ["kernel/fs/fuse/fuse.ko", "kernel/fs/fuse/virtiofs.ko"])
    assert qemu_virtiofs.choose("", str(daemon), with_module) == "virtiofs"
    assert qemu_virtiofs.choose("9p", str(daemon), with_module) == "9p"
    # Not there or not in the guest: 9p by default, a clear error when asked for.
    assert qemu_virtiofs.choose("", str(tmp_path / "none"), with_module) == "9p"
    old_guest = _guest(tmp_path, ["kernel/fs/9p/9p.ko"])
    assert qemu_virtiofs.choose("", str(daemon), old_guest) == "9p"
    with pytest.raises(errors.InvalidArgumentError, match="has no virtiofs module"):
        qemu_virtiofs.choose("virtiofs", str(daemon), old_guest)


@contextlib.contextmanager
def _namespaces(tmp_path: Path) -> Any:
    """A process in a mount namespace of its own (a VM's QEMU) whose ``shares`` directory is a
    shared mount, and one in a slave copy of that namespace (its virtiofsd): their PIDs."""
    shares = tmp_path / "shares"
    shares.mkdir()
    ready = tmp_path / "ready"
    script = (
        f"mount --bind {shares} {shares} && mount --make-shared {shares} && "
        f"(unshare --mount --propagation slave sh -c 'echo $$ > {ready}.tmp; mv {ready}.tmp {ready}; "
        "exec sleep 300' &) ; exec sleep 300"
    )
    vm = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sh", "-c", script])
    copy = 0
    try:
        for _ in range(500):
            if ready.exists():
                break
            subprocess.run(["sleep", "0.02"], check=True)
        copy = int(ready.read_text())
        yield vm.pid, copy, str(shares)
    finally:
        if copy:
            with contextlib.suppress(ProcessLookupError):
                os.kill(copy, signal.SIGKILL)
        vm.kill()
        vm.wait()


def _in_ns(pid: int, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", *cmd], capture_output=True, text=True)


@pytest.mark.skipif(bool(vm_support()), reason=vm_support() or "ok")
async def test_the_host_side_overlay_and_read_only_shares_reach_a_slave_namespace(tmp_path: Path) -> None:
    """What a virtio-fs VM's shares rely on, without QEMU: the overlay the share helper makes is
    only in the VM's namespace and propagates to virtiofsd's; a read-only share is read-only
    there too (set before it is attached); a detach propagates."""
    lower1, lower2, upper, work = (tmp_path / n for n in ("l1", "l2", "upper", "work"))
    for d in (lower1, lower2, upper, work):
        d.mkdir()
    (lower1 / "top").write_text("top\n")
    (lower2 / "top").write_text("hidden\n")
    (lower2 / "bottom").write_text("bottom\n")
    ro_src = tmp_path / "ro"
    ro_src.mkdir()
    (ro_src / "data").write_text("ro\n")
    injector = Injector("python3")
    try:
        with _namespaces(tmp_path) as (vm_pid, daemon_pid, shares):
            root, ro = os.path.join(shares, "ct"), os.path.join(shares, "ro")
            os.makedirs(root)
            os.makedirs(ro)
            err = await injector.call(
                ["overlay", str(vm_pid), root, str(upper), str(work), str(lower1), str(lower2)]
            )
            assert err == ""
            assert await injector.call(["attach", str(ro_src), str(vm_pid), ro, "ro"]) == ""
            # Never in the host's mount table.
            assert not [m for m in procfs.mounts() if m.point.startswith(shares)]
            for pid in (vm_pid, daemon_pid):
                res = _in_ns(pid, "sh", "-c", f"cat {root}/top {root}/bottom {ro}/data")
                assert res.stdout == "top\nbottom\nro\n", (pid, res)
                res = _in_ns(pid, "sh", "-c", f"echo x > {ro}/new")
                assert res.returncode != 0 and "Read-only" in res.stderr, (pid, res)
            # Written through the slave copy (as virtiofsd writes): a whiteout and a new file
            # in the upper directory on the host.
            res = _in_ns(daemon_pid, "sh", "-c", f"rm {root}/bottom && echo new > {root}/made")
            assert res.returncode == 0, res
            assert (upper / "made").read_text() == "new\n"
            assert stat.S_ISCHR((upper / "bottom").lstat().st_mode) and (lower2 / "bottom").exists()
            # A detach in the VM's namespace takes the copy away too.
            assert await injector.call(["detach", str(vm_pid), root]) == ""
            assert _in_ns(daemon_pid, "ls", root).stdout == ""
            assert not (ro_src / "new").exists()
    finally:
        await injector.close()


@pytest.mark.skipif(bool(vm_support()), reason=vm_support() or "ok")
def test_an_older_kernel_gets_the_overlay_by_a_private_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without overlayfs's lowerdir+ (kernels before 6.8) the helper mounts in a private
    namespace of its own and attaches a detached clone: the same result."""
    lowers = [tmp_path / f"layer{i}" for i in range(3)]
    for i, d in enumerate(lowers):
        d.mkdir()
        (d / f"f{i}").write_text(str(i))
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir()
    work.mkdir()

    def no_plus(*_: Any) -> int:
        raise inject_overlay._NoLowerdirPlus

    monkeypatch.setattr(inject_overlay, "_by_fsmount", no_plus)
    with _namespaces(tmp_path) as (vm_pid, daemon_pid, shares):
        target = os.path.join(shares, "ct")
        os.makedirs(target)
        child = os.fork()
        if child == 0:  # the helper's way: a process of its own that joins the namespace
            code = 1
            try:
                inject_overlay.attach(vm_pid, target, str(upper), str(work), [str(d) for d in lowers])
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert status == 0
        assert not [m for m in procfs.mounts() if m.point.startswith(shares)]
        res = _in_ns(daemon_pid, "sh", "-c", f"cat {target}/f0 {target}/f1 {target}/f2")
        assert res.stdout == "012", res


# ---------------------------------------------------------------------------- real VMs
def _virtiofs_support() -> str:
    return qemu_virtiofs.unusable(qemu_virtiofs.DEFAULT_VIRTIOFSD, GUEST_DIR)


needs_virtiofs = pytest.mark.skipif(bool(_virtiofs_support()), reason=_virtiofs_support() or "ok")


def _two_layer_image(backend: RunvBackend, busybox_rootfs: Path, tmp_path: Path) -> str:
    """An image of two layers: busybox, and on it /extra/file (two lowers of an overlay)."""
    store = backend.image_store
    base = store.resolve(store.import_dir("test/base:1", str(busybox_rootfs)))
    extra = tmp_path / "extra"
    (extra / "extra").mkdir(parents=True)
    (extra / "extra" / "file").write_text("second layer\n")
    top = store.resolve(store.import_dir("test/extra:1", str(extra)))
    assert base is not None and top is not None
    tag = reference.parse(IMAGE).tagged
    store._register(Image("sha256:" + "7" * 64, [tag], [], 0, [*base.diff_ids, *top.diff_ids], {}))
    return IMAGE


async def pci_ids(vm: VM) -> list[str]:
    """The IDs of the PCI devices of ``vm``'s QEMU (QMP)."""
    async with qemu_snapshot.qmp_of(vm, 10) as qmp:
        buses = await qmp.execute("query-pci")
    return [d.get("qdev_id", "") for bus in buses for d in bus["devices"]]


def _mount_lines(*paths: str) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        return [line for line in fh if any(p in line for p in paths)]


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@needs_virtiofs
@pytest.mark.timeout(600)
async def test_a_pod_on_virtiofs(runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path) -> None:
    """A confined VM whose shares are virtio-fs: its container writes its root (an overlay made
    on the host) and a volume, chowns a file on a share, deletes a file of its image, cannot
    write a read-only share, reads an image volume; virtiofsd is sandboxed in the pod's cgroup;
    a shim that dies and restarts adopts the VM; nothing is left after the pod."""
    from tests.runv.test_pod_cgroup import PodCgroup

    pod_cgroup = PodCgroup("cgroupfs")
    cfg = _qemu_config(runv_config)
    cfg["qemu"]["shares"] = "virtiofs"
    first = RunvBackend("runv", cfg)
    ev1 = Events()
    await first.lifecycle.start(ev1)
    image = _two_layer_image(first, busybox_rootfs, tmp_path)
    ro_dir, rw_dir = tmp_path / "ro", tmp_path / "rw"
    ro_dir.mkdir()
    rw_dir.mkdir()
    (ro_dir / "data").write_text("from the host\n")
    pod_cgroup.limit(640 * MIB)
    sb = sandbox_record("vfs", memory_limit_in_bytes=128 * MIB)
    sb.config.linux.cgroup_parent = pod_cgroup.parent
    sb.config.linux.overhead.memory_limit_in_bytes = 512 * MIB
    second: RunvBackend | None = None
    ev2: Events | None = None
    try:
        await first.lifecycle.run_sandbox(sb)
        sb.committed = True
        vm = first._shared.pods[sb.id].vm
        assert qemu_virtiofs.marked(vm)
        assert "vfs0" in await pci_ids(vm)  # on its command line, or hot-plugged (a template's)
        ct = container_record(
            sb,
            image,
            ["sh", "-c", "echo root-write > /written && echo vol > /rw/out && sleep 600"],
            mounts=[
                pb.Mount(container_path="/ro", host_path=str(ro_dir), readonly=True),
                pb.Mount(container_path="/rw", host_path=str(rw_dir)),
                pb.Mount(container_path="/iv", image=pb.ImageSpec(image=image)),
            ],
        )
        await first.lifecycle.create_container(ct, sb)
        await ev1.start(first.lifecycle, ct, sb, MemorySink())
        ct.committed = True
        upper = Path(first._shared.containers_dir) / ct.id / "upper"
        for _ in range(300):
            if (rw_dir / "out").exists() and (upper / "written").exists():
                break
            await asyncio.sleep(0.1)
        # Its root: written on the host's overlay (its upper directory), both layers seen.
        assert (upper / "written").read_text() == "root-write\n"
        assert (rw_dir / "out").read_text() == "vol\n" and (rw_dir / "out").stat().st_uid == 0

        async def sh(script: str) -> Any:
            return await first.exec.exec_sync(ct, ["sh", "-c", script])

        res = await sh("cat /extra/file /ro/data /iv/extra/file && ls /iv/bin/busybox")
        assert res.exit_code == 0 and res.stdout.startswith(b"second layer\nfrom the host\nsecond layer\n"), (
            res
        )
        # A chown on a share (the 9p proxy refuses it): the host sees the new owner.
        res = await sh("chown 1234:2345 /rw/out && echo x > /written2 && chown 42:43 /written2")
        assert res.exit_code == 0, res
        assert ((rw_dir / "out").stat().st_uid, (rw_dir / "out").stat().st_gid) == (1234, 2345)
        assert (upper / "written2").stat().st_uid == 42
        # Nothing of the host outside the shares is reachable: not by a symlink the host put in a
        # share (the guest resolves it in its own tree), nor by climbing out of a share.
        secret = tmp_path / "host-secret"
        secret.write_text("host-only-e3b0c442\n")
        (rw_dir / "escape").symlink_to(secret)
        res = await sh(f"cat /rw/out /rw/escape /rw/../../../..{secret} /rw/../{secret.name}; true")
        assert res.stdout.startswith(b"vol\n") and b"host-only-e3b0c442" not in res.stdout + res.stderr, res
        (rw_dir / "escape").unlink()
        # Read-only on the host side (the guest's bind of it is writable: the refusal is the host's).
        res = await sh("echo x > /ro/new")
        assert res.exit_code != 0 and b"Read-only" in res.stderr and not (ro_dir / "new").exists(), res
        # A file of the image deleted: a whiteout in the upper directory on the host.
        res = await sh("rm /bin/true && ! test -e /bin/true && rm /extra/file && ! test -e /extra/file")
        assert res.exit_code == 0, res
        assert stat.S_ISCHR((upper / "bin" / "true").lstat().st_mode)
        assert stat.S_ISCHR((upper / "extra" / "file").lstat().st_mode)

        # virtiofsd: in the VM's cgroup, below the pod's; the process that serves the guest in
        # its own PID namespace, under its seccomp filter, with file capabilities only, rooted
        # at the VM's shares; its parent (which only waits for it) with no capabilities.
        assert pod_cgroup.holds(vm.pid) == []
        helpers = [p for p in set(Cgroup(vm.cgroup).pids()) if p != vm.pid]
        assert len(helpers) == 2, helpers
        for pid in helpers:
            assert pod_cgroup.holds(pid) == []
        server = next(p for p in helpers if len(_status(p)["NSpid"].split()) == 2)
        waiter = next(p for p in helpers if p != server)
        st = _status(server)
        assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1" and st["CapBnd"] == "0000000000000000"
        # chown, dac_override, fowner, fsetid, setgid, setuid, mknod, setfcap
        assert int(st["CapEff"], 16) & ~0x880000DB == 0 and st["CapPrm"] == st["CapEff"]
        shares = os.stat(os.path.join(vm.state_dir, "shares"))
        root = os.stat(f"/proc/{server}/root")
        assert (root.st_dev, root.st_ino) == (shares.st_dev, shares.st_ino)
        assert _status(waiter)["CapEff"] == _status(waiter)["CapBnd"] == "0000000000000000"
        # QEMU as confined as on 9p.
        qs = _status(vm.pid)
        assert qs["Uid"].split()[0] != "0" and qs["Seccomp"] == "2" and qs["CapEff"] == "0000000000000000"
        # Nothing of the VM's shares in the host's mount table.
        assert _mount_lines(vm.state_dir, first._shared.containers_dir, str(rw_dir)) == []

        # The shim goes away (its share helper killed, its agent connections dropped, nothing
        # detached) and a new one adopts the VM.
        first._shared.hv._injector._proc.kill()  # type: ignore[attr-defined,union-attr]
        await ev1.close()
        await first.lifecycle.close()
        assert _alive(vm.pid) and all(_alive(p) for p in helpers)
        second = RunvBackend("runv", cfg)
        ev2 = Events()
        await second.lifecycle.start(ev2)
        sb_obs, ct_obs = await second.lifecycle.recover([sb], [ct])
        assert sb_obs[sb.id].running and ct_obs[ct.id].running
        res = await second.exec.exec_sync(ct, ["sh", "-c", "cat /written && echo again > /rw/again"])
        assert (res.exit_code, res.stdout) == (0, b"root-write\n"), res
        assert (rw_dir / "again").read_text() == "again\n"

        await second.lifecycle.stop_container(ct, 2)
        await second.lifecycle.remove_container(ct)
        assert not (Path(second._shared.containers_dir) / ct.id).exists()
        await second.lifecycle.stop_sandbox(sb)
        await second.lifecycle.remove_sandbox(sb)
        assert not _alive(vm.pid) and not any(_alive(p) for p in helpers)
        assert not os.path.exists(vm.state_dir) and QemuHypervisor.tap_name(vm.id) not in _taps()
        assert _mount_lines(vm.state_dir, second._shared.containers_dir, str(rw_dir)) == []
        assert sorted(os.listdir(rw_dir)) == ["again", "out"] and sorted(os.listdir(ro_dir)) == ["data"]
    finally:
        for b in (first, second):
            if b is not None:
                if sb.id in b._shared.pods:
                    with contextlib.suppress(Exception):
                        await b.lifecycle.stop_sandbox(sb)
                await b.lifecycle.close()
        for e in (ev1, ev2):
            if e is not None:
                await e.close()
        assert not pod_cgroup.remove()
