"""runv's qemu driver started from VM templates: QMP save/restore against a stand-in QEMU
monitor, then real VMs under QEMU (TCG here: a template is a boot, ~15 s; a VM from it ~1 s).

The real-VM tests need ``qemu-system-x86_64`` and the guest image, as test_qemu.py's do.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog

from backends.linux.cgroups import Cgroup
from backends.runv import config as runv_config
from backends.runv.agent import snapshot as agent_snapshot
from backends.runv.agent.protocol import AgentError
from backends.runv.backend import RunvBackend
from backends.runv.drivers import qemu_snapshot, qemu_template_virtiofs, qemu_virtiofs
from backends.runv.drivers.qemu import QemuHypervisor
from backends.runv.drivers.qemu_snapshot import GuestMemory, SnapshotError
from backends.runv.drivers.qemu_template import TEMPLATES, Templates
from backends.runv.hypervisor import MIB, VM
from cri_api import api_pb2 as pb
from tests.runv.helpers import Events, MemorySink, container_record, sandbox_record
from tests.runv.test_qemu import GUEST_DIR, IMAGE, _alive, _qemu_config, _taps, needs_qemu
from tests.runv.test_qemu_virtiofs import needs_virtiofs, pci_ids


def _vm(where: str) -> VM:
    return VM("vm1", "qemu", 0, 1, 128 * MIB, where, os.path.join(where, "agent.sock"))


# ---------------------------------------------------------------------------- no QEMU needed
def test_command_line_of_a_template_and_of_a_vm_from_it(tmp_path: Path) -> None:
    hv = QemuHypervisor({"run_dir": str(tmp_path), "guest_memory_mib": 64})
    vm = _vm(str(tmp_path / "vm1"))
    cold = hv.argv(vm, "/k", "/i", "tcg", "")
    assert "-incoming" not in cold and "-object" not in cold and "-machine" in cold
    assert cold[cold.index("-machine") + 1] == "pc"
    assert f"unix:{vm.state_dir}/qmp.sock,server=on,wait=off" in cold  # every VM: a QMP socket
    saved = hv.argv(vm, "/k", "/i", "tcg", "", memory=GuestMemory("/proc/self/fd/3", share=True))
    assert saved[saved.index("-machine") + 1] == "pc,memory-backend=ram"
    assert "memory-backend-file,id=ram,size=192M,mem-path=/proc/self/fd/3,share=on" in saved
    assert "-m" in saved and saved[saved.index("-m") + 1] == "192M"  # as large as the backend
    restored = hv.argv(
        vm, "/k", "/i", "tcg", "", memory=GuestMemory("/proc/self/fd/3", share=False), incoming=True
    )
    assert "memory-backend-file,id=ram,size=192M,mem-path=/proc/self/fd/3,share=off" in restored
    assert restored[restored.index("-incoming") + 1] == "defer"
    assert f"file,id=console,path={vm.state_dir}/console.log,append=on" in restored
    # On virtio-fs: the template's VM has the device in its fixed slot; a VM restored from it
    # has none (it is hot-plugged after), its RAM a shared mapping of its own copy.
    qemu_virtiofs.mark(vm, "virtiofs")
    saved = hv.argv(vm, "/k", "/i", "tcg", "", memory=GuestMemory("/proc/self/fd/3", share=True))
    assert "vhost-user-fs-pci,id=vfs0,chardev=vfs,tag=shares,addr=0x10" in saved
    restored = hv.argv(
        vm, "/k", "/i", "tcg", "", memory=GuestMemory("/proc/self/fd/3", share=True), incoming=True
    )
    assert not [a for a in restored if "vhost-user-fs" in a or "socket,id=vfs" in a], restored
    assert "-fsdev" not in restored and "memory-backend-memfd" not in " ".join(restored)
    assert "memory-backend-file,id=ram,size=192M,mem-path=/proc/self/fd/3,share=on" in restored


def test_template_key_is_checked_and_off_means_none(tmp_path: Path) -> None:
    runv_config.check("q", {"driver": "qemu", "qemu": {"template": False}})
    with pytest.raises(Exception, match="template"):
        runv_config.check("q", {"driver": "qemu", "qemu": {"template": "yes"}})
    assert QemuHypervisor({"run_dir": str(tmp_path)}).templates is not None  # on by default
    assert QemuHypervisor({"run_dir": str(tmp_path), "template": False}).templates is None


def test_a_killed_shims_template_files_go_at_the_next_start(tmp_path: Path) -> None:
    """Its templates' RAM (memfds) died with it; the state files left are removed by the next
    driver's leftovers, which does not take the templates directory for a VM."""
    run_dir = tmp_path / "run"
    (run_dir / TEMPLATES).mkdir(parents=True)
    (run_dir / TEMPLATES / "0123.state").write_bytes(b"QEVM")
    hv = QemuHypervisor({"run_dir": str(run_dir)})
    assert hv.leftovers(set()) == []
    assert not (run_dir / TEMPLATES).exists()


def test_the_agent_refuses_a_bad_identity() -> None:
    short = agent_snapshot.RestoredRequest(entropy="AAAA", time_ns=1)
    with pytest.raises(AgentError, match="at least 32"):
        asyncio.run(agent_snapshot.restored(None, short))  # type: ignore[arg-type]
    with pytest.raises(AgentError, match="not base64"):
        asyncio.run(
            agent_snapshot.restored(None, agent_snapshot.RestoredRequest(entropy="**", time_ns=1))  # type: ignore[arg-type]
        )
    with pytest.raises(AgentError, match="not a MAC address"):
        agent_snapshot._set_mac("eth0", "52:54:zz")
    assert agent_snapshot.RestoredRequest.from_dict({"entropy": "x", "time_ns": 5}).interface == "eth0"
    assert agent_snapshot.RestoredRequest.from_dict({"entropy": "x", "time_ns": 5}).sharefs == "9p"
    nfs = agent_snapshot.RestoredRequest(entropy="A" * 44, time_ns=1, sharefs="nfs")
    with pytest.raises(AgentError, match="'nfs' is not 9p or virtiofs"):
        asyncio.run(agent_snapshot.restored(None, nfs))  # type: ignore[arg-type]
    with pytest.raises(AgentError, match="time_ns: expected int"):
        agent_snapshot.RestoredRequest.from_dict({"entropy": "x", "time_ns": "now"})


class FakeQmp:
    """A QMP monitor on a unix socket, in a thread: it records the commands it is sent, keeps
    the descriptor a ``getfd`` passes, and answers from ``answers`` (command -> list of
    returns, the last one repeated; an ``{"error": ...}`` is an error)."""

    def __init__(
        self,
        path: str,
        answers: dict[str, list[Any]],
        on_migrate: bytes = b"",
        events: dict[str, list[dict[str, Any]]] | None = None,
    ) -> None:
        self.commands: list[str] = []
        self.arguments: list[dict[str, Any]] = []
        self._events = events or {}  # command -> events sent after its answer
        self.fd_data = b""
        self._answers = answers
        self._on_migrate = on_migrate
        self._fd = -1
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._server.accept()
        with conn:
            conn.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n')
            buf = b""
            while True:
                data, anc, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(4))
                for level, kind, raw in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        self._fd = array.array("i", raw[:4])[0]
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    command = msg["execute"]
                    self.arguments.append(msg.get("arguments", {}))
                    if command == "stop":  # an event comes first, as QEMU's STOP does
                        conn.sendall(b'{"event": "STOP", "data": {}}\n')
                    conn.sendall(json.dumps(self._answer(command)).encode() + b"\n")
                    for event in self._events.get(command, []):
                        conn.sendall(json.dumps(event).encode() + b"\n")

    def _answer(self, command: str) -> dict[str, Any]:
        self.commands.append(command)
        if command == "migrate" and self._fd >= 0:
            os.write(self._fd, self._on_migrate)  # what QEMU writes: the stream
            os.close(self._fd)
        if command == "migrate-incoming" and self._fd >= 0:
            self.fd_data = os.read(self._fd, 1 << 20)
            os.close(self._fd)
        queue = self._answers.get(command, [{}])
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, dict) and "error" in answer:
            return {"error": {"class": "GenericError", "desc": answer["error"]}}
        return {"return": answer}

    def close(self) -> None:
        self._server.close()
        self._thread.join(timeout=5)


async def test_save_stops_migrates_into_the_file_and_resumes(tmp_path: Path) -> None:
    vm = _vm(str(tmp_path))
    qmp = FakeQmp(
        qemu_snapshot.qmp_path(vm),
        {"query-migrate": [{"status": "active"}, {"status": "completed"}]},
        on_migrate=b"QEVM-stream",
    )
    try:
        size = await qemu_snapshot.save(vm, str(tmp_path / "vm.state"), resume=True, ignore_shared=True)
    finally:
        qmp.close()
    assert (tmp_path / "vm.state").read_bytes() == b"QEVM-stream" and size == 11
    assert qmp.commands == [
        "qmp_capabilities",
        "migrate-set-capabilities",
        "stop",
        "getfd",
        "migrate",
        "query-migrate",
        "query-migrate",
        "cont",
    ]


async def test_a_failed_save_leaves_no_file_and_the_vm_stopped_unless_resumed(tmp_path: Path) -> None:
    for resume in (False, True):
        vm = _vm(str(tmp_path))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(qemu_snapshot.qmp_path(vm))
        qmp = FakeQmp(
            qemu_snapshot.qmp_path(vm),
            {"query-migrate": [{"status": "failed", "error-desc": "9p is mounted"}]},
        )
        try:
            with pytest.raises(SnapshotError, match="migration failed: 9p is mounted"):
                await qemu_snapshot.save(vm, str(tmp_path / "vm.state"), resume=resume)
        finally:
            qmp.close()
        assert not list(tmp_path.glob("vm.state*"))
        assert ("cont" in qmp.commands) == resume


async def test_restore_loads_the_file_and_runs_the_vm(tmp_path: Path) -> None:
    vm = _vm(str(tmp_path))
    (tmp_path / "vm.state").write_bytes(b"QEVM-saved")
    qmp = FakeQmp(
        qemu_snapshot.qmp_path(vm),
        {"query-status": [{"status": "inmigrate"}, {"status": "paused"}, {"status": "running"}]},
    )
    try:
        await qemu_snapshot.restore(vm, str(tmp_path / "vm.state"), ignore_shared=True)
    finally:
        qmp.close()
    assert qmp.fd_data == b"QEVM-saved"
    assert qmp.commands[-5:] == ["migrate-incoming", "query-status", "query-status", "cont", "query-status"]
    with pytest.raises(SnapshotError, match=r"state file .*: No such file"):
        await qemu_snapshot.restore(vm, str(tmp_path / "none.state"))


async def test_qmp_errors_and_a_missing_monitor_are_snapshot_errors(tmp_path: Path) -> None:
    vm = _vm(str(tmp_path))
    with pytest.raises(SnapshotError, match="QMP socket"):
        await qemu_snapshot.save(vm, str(tmp_path / "x.state"), resume=False, timeout=0.1)
    qmp = FakeQmp(qemu_snapshot.qmp_path(vm), {"stop": [{"error": "not now"}]})
    try:
        with pytest.raises(SnapshotError, match="QMP stop: not now"):
            await qemu_snapshot.save(vm, str(tmp_path / "x.state"), resume=False)
    finally:
        qmp.close()


async def test_the_virtiofs_device_is_unplugged_then_plugged_in_again(tmp_path: Path) -> None:
    """A template on virtio-fs: ``device_del`` waits for the guest's DEVICE_DELETED (another
    device's first) before its socket goes; a restored VM gets both back, in the same slot."""
    vm = _vm(str(tmp_path))
    deleted = [
        {"event": "DEVICE_DELETED", "data": {"device": "other", "path": "/x"}},
        {"event": "DEVICE_DELETED", "data": {"device": "vfs0", "path": "/machine/peripheral/vfs0"}},
    ]
    qmp = FakeQmp(qemu_snapshot.qmp_path(vm), {}, events={"device_del": deleted})
    try:
        await qemu_template_virtiofs.unplug(vm, timeout=5)
    finally:
        qmp.close()
    assert qmp.commands == ["qmp_capabilities", "device_del", "chardev-remove"]
    assert qmp.arguments[1:] == [{"id": "vfs0"}, {"id": "vfs"}]
    # No DEVICE_DELETED (the guest does not eject it): an error, the socket kept.
    os.unlink(qemu_snapshot.qmp_path(vm))
    qmp = FakeQmp(qemu_snapshot.qmp_path(vm), {}, events={"device_del": deleted[:1]})
    try:
        with pytest.raises(SnapshotError, match="no DEVICE_DELETED event"):
            await qemu_template_virtiofs.unplug(vm, timeout=0.5)
    finally:
        qmp.close()
    assert "chardev-remove" not in qmp.commands

    os.unlink(qemu_snapshot.qmp_path(vm))
    qmp = FakeQmp(qemu_snapshot.qmp_path(vm), {})
    try:
        await qemu_template_virtiofs.hotplug(vm, timeout=5)
    finally:
        qmp.close()
    assert qmp.commands == ["qmp_capabilities", "chardev-add", "device_add"]
    sock = qmp.arguments[1]["backend"]["data"]["addr"]["data"]["path"]
    assert sock == os.path.join(vm.state_dir, "virtiofs.sock") and qmp.arguments[1]["id"] == "vfs"
    assert qmp.arguments[2] == {
        "driver": "vhost-user-fs-pci",
        "id": "vfs0",
        "chardev": "vfs",
        "tag": "shares",
        "addr": "0x10",
    }


def test_a_vms_own_ram_is_the_templates_data_copied_in_its_start(tmp_path: Path) -> None:
    """RAM_COPY: the template's data extents copied into the VM's memfd (holes stay holes),
    the template's descriptor closed, then the command exec'd."""
    page = os.sysconf("SC_PAGE_SIZE")
    tpl = os.memfd_create("runv-template-test")
    own = -1
    try:
        os.ftruncate(tpl, 64 * page)
        os.pwrite(tpl, b"a" * page, 0)
        os.pwrite(tpl, b"b" * 10, 40 * page + 5)
        own = qemu_template_virtiofs.fresh_ram(tpl, "vm1")
        assert os.fstat(own).st_size == 64 * page and os.fstat(own).st_blocks == 0
        out = tmp_path / "fds"
        proc = subprocess.run(
            [*qemu_template_virtiofs.ram_copy_argv(), "sh", "-c", f"ls -l /proc/$$/fd/ > {out}"],
            close_fds=False,
            preexec_fn=lambda: (os.dup2(own, 3), os.dup2(tpl, 4)),
            check=False,
        )
        assert proc.returncode == 0
        fds = out.read_text()
        assert " 3 -> /memfd:runv-ram-vm1" in fds and " 4 -> " not in fds, fds  # the template's not left
        data = os.pread(own, 64 * page, 0)
        assert data[:page] == b"a" * page and data[40 * page + 5 : 40 * page + 15] == b"b" * 10
        assert data.count(0) == 64 * page - page - 10
        assert os.fstat(own).st_blocks * 512 <= 2 * page  # the holes were not filled
    finally:
        os.close(tpl)
        if own >= 0:
            os.close(own)


# ---------------------------------------------------------------------------- real VMs
async def _exec(backend: RunvBackend, ct: Any, script: str) -> str:
    res = await backend.exec.exec_sync(ct, ["sh", "-c", script])
    assert res.exit_code == 0, res
    return res.stdout.decode().strip()


def _templates(backend: RunvBackend) -> Templates:
    hv = backend.hv
    assert isinstance(hv, QemuHypervisor) and hv.templates is not None
    return hv.templates


async def _stop_all(backend: RunvBackend, events: Any, sbs: list[Any]) -> None:
    """Stop the pods of ``sbs`` still there, then the backend (a test's cleanup)."""
    for sb in sbs:
        if sb.id in backend._shared.pods:
            with contextlib.suppress(Exception):
                await backend.lifecycle.stop_sandbox(sb)
    await events.close()
    await backend.lifecycle.close()


def _nothing_left(backend: RunvBackend, templates: Any, vms: list[Any]) -> None:
    """After a clean stop: no template files or memfds, no run directory, no QEMU, no tap."""
    assert not os.path.exists(templates.dir) and _memfds() == []
    assert not os.path.exists(backend.hv.run_dir) or os.listdir(backend.hv.run_dir) == []  # type: ignore[attr-defined]
    assert all(not _alive(vm.pid) for vm in vms)
    assert not {QemuHypervisor.tap_name(vm.id) for vm in vms} & _taps()


def _memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "runv-template" in target:
                out.append(target)
    return out


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(600)
async def test_pods_from_a_template_are_each_their_own(
    runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path
) -> None:
    """Two pods from one template: each runs a container, has its own MAC, IP, hostname and
    boot ID, and sees its own shares; a corrupt template is a cold boot (a log line, the pod
    runs); after a clean stop no template, memfd or template VM is left."""
    backend = RunvBackend("runv", _qemu_config(runv_config))
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs))
    templates = _templates(backend)
    sbs = [sandbox_record(f"tpl{i}") for i in range(3)]
    seen: list[dict[str, str]] = []
    try:
        for i, sb in enumerate(sbs[:2]):
            net = await backend.lifecycle.run_sandbox(sb)
            vm = backend._shared.pods[sb.id].vm
            share = tmp_path / f"share{i}"
            share.mkdir()
            (share / "who").write_text(f"pod {i}\n")
            ct = container_record(
                sb,
                IMAGE,
                ["sleep", "600"],
                mounts=[pb.Mount(container_path="/data", host_path=str(share), readonly=True)],
            )
            await backend.lifecycle.create_container(ct, sb)
            await events.start(backend.lifecycle, ct, sb, MemorySink())
            seen.append(
                {
                    "ip": net.ip,
                    "mac": await _exec(backend, ct, "cat /sys/class/net/eth0/address"),
                    "addr": await _exec(backend, ct, "busybox ip addr show dev eth0"),
                    "hostname": await _exec(backend, ct, "hostname"),
                    "boot_id": await _exec(backend, ct, "cat /proc/sys/kernel/random/boot_id"),
                    "uuid": await _exec(backend, ct, "cat /proc/sys/kernel/random/uuid"),
                    "share": await _exec(backend, ct, "cat /data/who"),
                }
            )
            assert seen[i]["mac"] == QemuHypervisor.mac(vm.id)
            assert f"{net.ip}/" in seen[i]["addr"] and seen[i]["hostname"] == f"tpl{i}"
            assert seen[i]["share"] == f"pod {i}"
            assert "runv: restored from template" in backend.hv.console(vm)
        assert (templates.made, templates.restored, templates.fallbacks) == (1, 2, 0)
        for field in ("ip", "mac", "hostname", "boot_id", "uuid"):
            assert seen[0][field] != seen[1][field], field

        # A template whose state file is corrupt: the next pod boots cold and runs.
        (state,) = templates.state_files()
        with open(os.path.join(templates.dir, state), "r+b") as fh:
            fh.seek(64)
            fh.write(os.urandom(4096))
        with structlog.testing.capture_logs() as logs:
            await backend.lifecycle.run_sandbox(sbs[2])
        vm = backend._shared.pods[sbs[2].id].vm
        assert any(e["event"] == "runv.qemu.template_fallback" and e["vm"] == vm.id for e in logs), logs
        assert templates.fallbacks == 1 and templates.state_files() == []
        assert "runv: restored" not in backend.hv.console(vm) and _alive(vm.pid)
        ct = container_record(sbs[2], IMAGE, ["sleep", "600"])
        await backend.lifecycle.create_container(ct, sbs[2])
        await events.start(backend.lifecycle, ct, sbs[2], MemorySink())
        assert await _exec(backend, ct, "echo up") == "up"
    finally:
        vms = [backend._shared.pods[sb.id].vm for sb in sbs if sb.id in backend._shared.pods]
        await _stop_all(backend, events, sbs)
    _nothing_left(backend, templates, vms)


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@pytest.mark.timeout(600)
async def test_a_template_is_made_again_when_the_guest_image_changes(
    runv_config: dict[str, Any], tmp_path: Path
) -> None:
    guest = tmp_path / "guest"
    guest.mkdir()
    for name in ("vmlinuz", "initrd.img"):
        shutil.copy2(os.path.join(GUEST_DIR, name), guest / name)
    cfg = _qemu_config(runv_config)
    cfg["qemu"]["guest_dir"] = str(guest)
    hv = QemuHypervisor(cfg["qemu"] | {"run_dir": cfg["run_dir"] + "-q"})
    templates = hv.templates
    assert templates is not None
    from backends.runv.hypervisor import VMSpec

    vms: list[VM] = []
    try:
        vms.append(await hv.create(VMSpec("img1", 1, 128 * MIB)))
        (first,) = templates.state_files()
        vms.append(await hv.create(VMSpec("img2", 1, 128 * MIB)))
        assert templates.state_files() == [first] and (templates.made, templates.restored) == (1, 2)
        # A new kernel (another file in its place): the shape's template is made again.
        st = os.stat(guest / "vmlinuz")
        os.utime(guest / "vmlinuz", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with structlog.testing.capture_logs() as logs:
            vms.append(await hv.create(VMSpec("img3", 1, 128 * MIB)))
        (second,) = templates.state_files()
        assert second != first and (templates.made, templates.restored) == (2, 3)
        assert any(e["event"] == "runv.qemu.template_stale" for e in logs), logs
        assert all(hv.alive(vm) for vm in vms)  # the older template's VMs keep their RAM
        assert len(_memfds()) == 1
    finally:
        for vm in vms:
            await hv.destroy(vm)
        await hv.close()
        hv.tidy()
    assert _memfds() == [] and not os.path.exists(templates.dir)


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read()


def _fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@needs_virtiofs
@pytest.mark.timeout(600)
async def test_a_pod_on_virtiofs_from_a_template_and_the_fallback_when_hotplug_fails(
    runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A confined VM on virtio-fs restored from a template: its virtio-fs device hot-plugged
    (not on QEMU's command line), its RAM its own memfd shared with virtiofsd; its container's
    root is the overlay made on the host and a volume it writes shows on the host. Then a
    hot-plug that fails: the pod boots cold (a log line) and runs as well."""
    cfg = _qemu_config(runv_config)
    cfg["qemu"]["shares"] = "virtiofs"
    backend = RunvBackend("runv", cfg)
    events = Events()
    await backend.lifecycle.start(events)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs))
    templates = _templates(backend)
    sbs = [sandbox_record(f"vft{i}") for i in range(2)]
    vms: list[VM] = []

    async def pod(i: int) -> tuple[VM, Path, Path]:
        rw = tmp_path / f"rw{i}"
        rw.mkdir()
        vm = backend._shared.pods[sbs[i].id].vm
        vms.append(vm)
        ct = container_record(
            sbs[i],
            IMAGE,
            ["sh", "-c", f"echo root{i} > /written && echo vol{i} > /rw/out && sleep 600"],
            mounts=[pb.Mount(container_path="/rw", host_path=str(rw))],
        )
        await backend.lifecycle.create_container(ct, sbs[i])
        await events.start(backend.lifecycle, ct, sbs[i], MemorySink())
        upper = Path(backend._shared.containers_dir) / ct.id / "upper"
        for _ in range(300):
            if (rw / "out").exists() and (upper / "written").exists():
                break
            await asyncio.sleep(0.1)
        # The root is the host's overlay (its upper directory written), over virtio-fs.
        assert (upper / "written").read_text() == f"root{i}\n"
        assert (rw / "out").read_text() == f"vol{i}\n"
        mounts = await _exec(backend, ct, "cat /proc/mounts")
        assert any(line.split()[1:3] == ["/", "virtiofs"] for line in mounts.splitlines()), mounts
        assert any(line.split()[1:3] == ["/rw", "virtiofs"] for line in mounts.splitlines()), mounts
        return vm, upper, rw

    try:
        await backend.lifecycle.run_sandbox(sbs[0])
        assert (templates.made, templates.restored, templates.fallbacks) == (1, 1, 0)
        vm, _upper, _rw = await pod(0)
        assert qemu_virtiofs.marked(vm) and "runv: restored from template" in backend.hv.console(vm)
        cmdline = _cmdline(vm.pid)
        assert b"vhost-user-fs-pci" not in cmdline and b"-incoming" in cmdline
        assert b"mem-path=/proc/self/fd/3,share=on" in cmdline
        assert "vfs0" in await pci_ids(vm)  # plugged in after the restore
        ram = [t for t in _fd_targets(vm.pid) if "memfd:" in t]
        assert ram and all("runv-ram-" in t for t in ram), ram  # its own RAM, not the template's
        assert not [t for t in _fd_targets(os.getpid()) if "runv-ram-" in t]  # QEMU's alone
        # virtiofsd serves it: in its cgroup beside QEMU.
        assert len([p for p in set(Cgroup(vm.cgroup).pids()) if p != vm.pid]) == 2

        # The hot-plug fails (QEMU refuses the device): the pod boots cold and runs.
        device = qemu_template_virtiofs.hotplug_device

        def broken(vm: VM) -> dict[str, Any]:
            return {**device(vm), "chardev": "nosuchchardev"}

        monkeypatch.setattr(qemu_template_virtiofs, "hotplug_device", broken)
        with structlog.testing.capture_logs() as logs:
            await backend.lifecycle.run_sandbox(sbs[1])
        vm1 = backend._shared.pods[sbs[1].id].vm
        fell = [e for e in logs if e["event"] == "runv.qemu.template_fallback" and e.get("vm") == vm1.id]
        assert fell and "nosuchchardev" in fell[0]["error"], logs
        assert (templates.made, templates.restored, templates.fallbacks) == (1, 1, 1)
        assert "runv: restored" not in backend.hv.console(vm1) and b"vhost-user-fs-pci" in _cmdline(vm1.pid)
        await pod(1)
        assert _alive(vm.pid)  # the restored VM is not touched by the other's fallback
    finally:
        await _stop_all(backend, events, sbs)
    _nothing_left(backend, templates, vms)


@pytest.mark.slow
@pytest.mark.qemu
@needs_qemu
@needs_virtiofs
@pytest.mark.timeout(600)
async def test_an_unconfined_vm_on_virtiofs_from_a_template(runv_config: dict[str, Any]) -> None:
    """QEMU not confined (virtiofsd started by qemu_virtiofs.PRELUDE): a VM from the template
    gets its device and mounts it (the agent's ``restored`` fails otherwise)."""
    from backends.runv.hypervisor import VMSpec

    cfg = _qemu_config(runv_config)
    hv = QemuHypervisor(
        cfg["qemu"] | {"run_dir": cfg["run_dir"] + "-u", "confine": False, "shares": "virtiofs"}
    )
    templates = hv.templates
    assert templates is not None
    vm: VM | None = None
    try:
        vm = await hv.create(VMSpec("unconf1", 1, 128 * MIB))
        assert (templates.made, templates.restored, templates.fallbacks) == (1, 1, 0)
        assert "vfs0" in await pci_ids(vm) and b"vhost-user-fs-pci" not in _cmdline(vm.pid)
        assert _status_uid(vm.pid) == 0  # unconfined indeed
        assert len([p for p in set(Cgroup(vm.cgroup).pids()) if p != vm.pid]) == 2  # virtiofsd
    finally:
        if vm is not None:
            await hv.destroy(vm)
        await hv.close()
        hv.tidy()
    assert _memfds() == [] and not os.path.exists(templates.dir)


def _status_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    return -1
