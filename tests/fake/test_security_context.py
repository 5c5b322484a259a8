"""A fake container's security context as its command and execs see it, through the node e2e specs
that check it: runAsUser (`id -u`), readOnlyRootFilesystem (writes fail with EROFS), the nonewprivs
image (allowPrivilegeEscalation), privileged (`ip link add`), the default masked /proc (`mount`),
and the pod's sysctls (`/bin/sysctl`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.contract import ContainerRecord, ExitInfo
from backends.fake.exec import FakeExec
from backends.fake.lifecycle import FakeLifecycle
from cri_api import api_pb2 as pb
from tests.fake.harness import settle
from tests.fake.test_parts import container, parts, sandbox

Configure = Callable[[pb.ContainerConfig], None]

# The kubelet's masked and read-only paths for procMount Default (a privileged container gets none).
_MASKED = [
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
]
_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


async def _run(
    life: FakeLifecycle,
    c: ContainerRecord,
    configure: Configure,
    sysctls: dict[str, str] | None = None,
    ends: bool = True,
) -> tuple[ExitInfo | None, bytes]:
    """Starts ``c`` configured so in a new pod; its exit (None: still running) and its log, once it
    ended, or (``ends`` False) once its command blocks."""
    configure(c.config)
    sb = sandbox("5" * 64)
    sb.config.linux.sysctls.update(sysctls or {})
    await life.run_sandbox(sb)
    await life.create_container(c, sb)
    await life.start_container(c, sb)
    run = life.running[c.id]
    log = bytearray()
    run.pipe.connect(lambda out: log.extend(out.data), lambda: None)
    if ends and run.task is not None:
        await asyncio.wait_for(run.task, 5)
    await settle()
    return run.pipe.exit.info, bytes(log)


async def _parts() -> tuple[FakeLifecycle, FakeExec]:
    images, programs, life = parts({"pull_seconds": 0})
    for image in ("busybox:1", "registry.k8s.io/e2e-test-images/nonewprivs:1.3"):
        await images.pull_image(pb.ImageSpec(image=image), None, None)
    return life, FakeExec({}, life, programs)


def _user(uid: int) -> Configure:
    def configure(cfg: pb.ContainerConfig) -> None:
        cfg.linux.security_context.run_as_user.value = uid

    return configure


@pytest.mark.parametrize("uid", [65534, 0])
async def test_run_as_user_is_the_uid_of_the_command(uid: int) -> None:
    life, _ = await _parts()
    c = container("a" * 64, command=["sh", "-c", f"test $(id -u) -eq {uid} && id && whoami"])
    info, log = await _run(life, c, _user(uid))
    name = "nobody" if uid else "root"
    assert info is not None and info.exit_code == 0
    assert log == f"uid={uid}({name}) gid=0(root) groups=0(root)\n{name}\n".encode()
    await life.close()


async def test_without_run_as_user_the_images_user_runs_it() -> None:
    images, _, life = parts({"pull_seconds": 0, "images": {"docker.io/library/busybox": {"uid": 1000}}})
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    info, log = await _run(life, container("a" * 64, command=["id", "-u"]), lambda cfg: None)
    assert info is not None and (info.exit_code, log) == (0, b"1000\n")
    await life.close()


def _readonly(cfg: pb.ContainerConfig) -> None:
    cfg.linux.security_context.readonly_rootfs = True


async def test_a_read_only_root_refuses_writes_but_to_volumes(tmp_path: Path) -> None:
    life, execs = await _parts()
    touch = container("a" * 64, command=["sh", "-c", "touch checkfile"])
    info, log = await _run(life, touch, _readonly)
    assert info is not None and info.exit_code == 1 and b"Read-only file system" in log
    echo = container("b" * 64, command=["/bin/sh", "-c", "echo test > /file; sleep 240"])
    echo.config.mounts.add(container_path="/data", host_path=str(tmp_path))
    info, log = await _run(life, echo, _readonly, ends=False)
    assert info is None and log == b"/bin/sh: can't create /file: Read-only file system\n"
    result = await execs.exec_sync(echo, ["sh", "-c", "echo x > /data/f && echo y > /tmp/f"])
    assert result.exit_code == 1 and b"can't create /tmp/f: Read-only file system" in result.stderr
    assert (tmp_path / "f").read_text() == "x\n"
    writable = container("c" * 64, command=["sh", "-c", "touch checkfile"])
    info, _ = await _run(life, writable, lambda cfg: None)
    assert info is not None and info.exit_code == 0
    await life.close()


@pytest.mark.parametrize(
    ("no_new_privs", "uid", "log"),
    [(False, 1000, b"Effective uid: 0\n"), (True, 1000, b"Effective uid: 1000\n")],
    ids=["escalates", "no-new-privs"],
)
async def test_the_nonewprivs_images_setuid_program(no_new_privs: bool, uid: int, log: bytes) -> None:
    life, _ = await _parts()

    def configure(cfg: pb.ContainerConfig) -> None:
        _user(uid)(cfg)
        cfg.linux.security_context.no_new_privs = no_new_privs

    c = container("a" * 64, image="registry.k8s.io/e2e-test-images/nonewprivs:1.3")
    info, got = await _run(life, c, configure)
    assert info is not None and (info.exit_code, got) == (0, log)
    await life.close()


async def test_ip_link_add_needs_a_privileged_container() -> None:
    life, execs = await _parts()
    script = ["sh", "-c", "ip link add dummy0 type dummy || true"]
    info, log = await _run(life, container("a" * 64, command=script), lambda cfg: None)
    assert info is not None and info.exit_code == 0 and b"Operation not permitted" in log

    def privileged(cfg: pb.ContainerConfig) -> None:
        cfg.linux.security_context.privileged = True

    c = container("b" * 64, command=["/bin/sleep", "10000"])
    await _run(life, c, privileged, ends=False)
    for cmd in (["ip", "link", "add", "dummy1", "type", "dummy"], ["ip", "link", "del", "dummy1"]):
        result = await execs.exec_sync(c, cmd)
        assert (result.exit_code, result.stderr) == (0, b"")
    await life.close()


@pytest.mark.parametrize(
    ("masked", "readonly", "lines", "read_only"),
    [(_MASKED, _READONLY, 15, 8), ([], [], 1, 0)],  # 9 + 5 under /proc; 3 dirs and 5 read-only
    ids=["default", "unmasked"],
)
async def test_mount_shows_the_masked_proc(
    masked: list[str], readonly: list[str], lines: int, read_only: int
) -> None:
    """The node e2e spec 'DefaultProcMount will mask proc mounts by default' counts the lines of
    `mount | grep /proc` (more than 1) and their "(ro" (some)."""
    life, execs = await _parts()

    def configure(cfg: pb.ContainerConfig) -> None:
        cfg.linux.security_context.masked_paths.extend(masked)
        cfg.linux.security_context.readonly_paths.extend(readonly)

    c = container("a" * 64, command=["/bin/sleep", "10000"])
    await _run(life, c, configure, ends=False)
    result = await execs.exec_sync(c, ["/bin/sh", "-ec", "mount | grep /proc"])
    out = result.stdout.decode()
    assert result.exit_code == 0 and len(out.splitlines()) == lines and out.count("(ro") == read_only
    assert "proc on /proc type proc (rw," in out
    await life.close()


@pytest.mark.parametrize("key", ["kernel.shm_rmid_forced", "kernel/shm_rmid_forced"], ids=["dots", "slashes"])
async def test_bin_sysctl_runs_as_the_command_and_reads_the_pods_sysctls(key: str) -> None:
    life, _ = await _parts()
    c = container("a" * 64, command=["/bin/sysctl", key])
    info, log = await _run(life, c, lambda cfg: None, sysctls={key: "1"})
    assert info is not None and (info.exit_code, log) == (0, b"kernel.shm_rmid_forced = 1\n")
    await life.close()
