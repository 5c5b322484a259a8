"""The fake's containers run their commands in the built-in shell over real volumes: what the kubelet's
pods need (an emptyDir marker from an init container, a termination message, a hostPath file, a TERM trap)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from backends.contract import ContainerRecord, SandboxRecord
from backends.contract.errors import InvalidArgumentError
from backends.fake.exec import FakeExec
from backends.fake.files import ContainerFiles, Mount
from backends.fake.images import FakeImages
from backends.fake.lifecycle import FakeLifecycle
from backends.fake.program import Programs
from backends.fake.servers import SERVE_ANNOTATION
from cri_api import api_pb2 as pb
from tests.follow import Follower, MemoryLog


def test_volumes_are_host_directories_and_files_the_rest_is_memory(tmp_path: Path) -> None:
    data, ro = tmp_path / "empty-dir", tmp_path / "config"
    data.mkdir()
    ro.mkdir()
    (ro / "app.conf").write_text("key=value\n")
    term = tmp_path / "termination-log"
    term.write_text("")
    mounts = [
        Mount("/data", str(data)),
        Mount("/etc/app", str(ro), readonly=True),
        Mount("/dev/termination-log", str(term)),
    ]
    init = ContainerFiles({"/etc/hostname": b"web\n"}, mounts)
    app = ContainerFiles({}, mounts)
    init.write("/data/marker", b"init-done\n")
    assert app.read("/data/marker") == b"init-done\n"  # shared through the host directory
    assert (data / "marker").read_text() == "init-done\n"
    assert app.read("/etc/app/app.conf") == b"key=value\n"
    with pytest.raises(PermissionError):
        app.write("/etc/app/app.conf", b"no")
    init.write("/dev/termination-log", b"bye")
    assert term.read_text() == "bye"  # where the kubelet reads it
    init.write("/etc/own", b"x")
    assert init.read("/etc/own") == b"x" and not app.exists("/etc/own")  # a container's own
    assert init.read("/etc/hostname") == b"web\n" and not app.exists("/etc/hostname")
    assert app.is_dir("/data") and app.listdir("/data") == ["marker"]
    # Nothing outside a volume can be reached through it.
    os.symlink("/etc", data / "escape")
    for path in ("/data/../../etc/passwd", "/data/escape/passwd"):
        with pytest.raises((PermissionError, FileNotFoundError)):
            app.read(path)
    assert not app.exists("/data/escape/passwd")


def sandbox() -> SandboxRecord:
    cfg = pb.PodSandboxConfig(hostname="web")
    return SandboxRecord(id="5" * 64, handler="", backend="fake", config=cfg, created_at=0)


def container(
    cid: str, command: list[str], mounts: list[tuple[str, str]] = (), stdin: bool = False
) -> ContainerRecord:  # type: ignore[assignment]
    cfg = pb.ContainerConfig(image=pb.ImageSpec(image="busybox:1"), command=command, stdin=stdin)
    for cpath, hpath in mounts:
        cfg.mounts.add(container_path=cpath, host_path=hpath)
    return ContainerRecord(id=cid, sandbox_id="5" * 64, backend="fake", config=cfg, created_at=0, log_path="")


async def lifecycle() -> tuple[FakeLifecycle, Follower]:
    images, programs = FakeImages({"pull_seconds": 0}), Programs("fake", {})
    life = FakeLifecycle({}, images, programs)
    follower = Follower()
    await life.start(follower)
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    await life.run_sandbox(sandbox())
    return life, follower


async def test_a_kubelet_pod_runs_as_written(tmp_path: Path) -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    data = tmp_path / "data"
    data.mkdir()
    init = container("1" * 64, ["sh", "-c", "echo init-done > /data/marker"], [("/data", str(data))])
    app = container(
        "2" * 64,
        ["sh", "-c", "cat /data/marker; echo hello-from-kubelet; while true; do sleep 1; done"],
        [("/data", str(data))],
    )
    logs = {c.id: MemoryLog() for c in (init, app)}
    await life.create_container(init, sb)
    await follower.start(life, init, sb, logs[init.id])
    assert (await follower.exit_of(init.id, timeout=5)).exit_code == 0
    await life.create_container(app, sb)
    await follower.start(life, app, sb, logs[app.id])
    for _ in range(100):
        if b"hello-from-kubelet" in logs[app.id].data["stdout"]:
            break
        await asyncio.sleep(0.01)
    assert logs[app.id].data["stdout"] == b"init-done\nhello-from-kubelet\n"
    info = await follower.stop(life, app, 5)
    assert (info.exit_code, info.reason) == (143, "Error")  # TERM, no trap: the shell's 128 + 15


async def test_stop_runs_the_term_trap_and_kill_follows_a_timeout() -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    polite = container("1" * 64, ["sh", "-c", "trap 'echo bye; exit 0' TERM; echo hello; sleep 30 & wait"])
    stubborn = container("2" * 64, ["sh", "-c", "trap '' TERM; while true; do sleep 1; done"])
    log = MemoryLog()
    for c in (polite, stubborn):
        await life.create_container(c, sb)
        await follower.start(life, c, sb, log if c is polite else None)
    await asyncio.sleep(0.05)
    assert (await follower.stop(life, polite, 10)).exit_code == 0
    assert log.data["stdout"] == b"hello\nbye\n"
    info = await follower.stop(life, stubborn, 1)  # ignores TERM: killed after the timeout
    assert (info.exit_code, info.reason) == (137, "Error")
    assert not life.running


class Session:
    """An exec session with stdin."""

    stdout = stderr = True
    stdin = True
    tty = False

    def __init__(self, data: list[bytes]) -> None:
        self._in = data
        self.out = bytearray()

    async def read_stdin(self) -> bytes:
        return self._in.pop(0) if self._in else b""

    async def write_stdout(self, data: bytes) -> None:
        self.out += data

    async def write_stderr(self, data: bytes) -> None:
        self.out += data

    async def resizes(self):  # type: ignore[no-untyped-def]
        if False:
            yield


async def test_exec_reads_stdin_and_sees_the_containers_files(tmp_path: Path) -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    c = container("1" * 64, ["sleep", "3600"], [("/data", str(tmp_path))])
    await life.create_container(c, sb)
    await follower.start(life, c, sb)
    streams = FakeExec({}, life, life.programs)
    session = Session([b"ping\n", b"more\n"])
    assert await streams.exec(c, ["head", "-n1"], session) == 0
    assert bytes(session.out) == b"ping\n"
    res = await streams.exec_sync(c, ["sh", "-c", "echo x > /data/f; cat /etc/hostname; pgrep sleep"])
    assert (res.exit_code, res.stdout) == (0, b"web\n2\n")  # in the pod's PID namespace: pause is 1
    assert (tmp_path / "f").read_text() == "x\n"
    await follower.stop(life, c, 0)


class Conn:
    """One forwarded connection: what the client sends, what comes back."""

    def __init__(self, data: list[bytes]) -> None:
        self._in = data
        self.got = bytearray()

    async def read(self) -> bytes:
        return self._in.pop(0) if self._in else b""

    async def write(self, data: bytes) -> None:
        self.got += data


async def test_scripted_servers_answer_port_forward() -> None:
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    web = container("1" * 64, ["sleep", "3600"])
    web.config.annotations[SERVE_ANNOTATION] = '{"8080": {"/healthz": "ok\\n"}, "6379": "+PONG\\r\\n"}'
    await life.create_container(web, sb)
    streams = FakeExec({}, life, life.programs)
    conn = Conn([b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"])
    await streams.port_forward(sb, 8080, conn)  # not running yet: the echo
    assert bytes(conn.got) == b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    await follower.start(life, web, sb)
    conn = Conn([b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nConnection: close\r\n\r\n"])
    await streams.port_forward(sb, 8080, conn)
    first, _, second = bytes(conn.got).partition(b"ok\n")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Length: 3\r\n" in first
    assert second.startswith(b"HTTP/1.1 404 Not Found\r\n") and b"Connection: close" in second
    conn = Conn([])
    await streams.port_forward(sb, 6379, conn)
    assert bytes(conn.got) == b"+PONG\r\n"
    bad = container("2" * 64, ["true"])
    bad.config.annotations[SERVE_ANNOTATION] = '{"http": "x"}'
    with pytest.raises(InvalidArgumentError, match="not a port"):
        await life.create_container(bad, sb)
    await follower.stop(life, web, 0)


async def test_a_program_the_fake_cannot_run_runs_until_stopped() -> None:
    """`sh -c top` in a container runs top: the fake cannot, so it runs silently until stopped
    (an exec of it, though, fails as a real shell's would)."""
    life, follower = await lifecycle()
    sb = life.sandboxes["5" * 64]
    c = container("1" * 64, ["sh", "-c", "echo starting; top"])
    log = MemoryLog()
    await life.create_container(c, sb)
    await follower.start(life, c, sb, log)
    await asyncio.sleep(0.05)
    assert c.id in life.running and log.data["stdout"] == b"starting\n" and not log.data["stderr"]
    res = await FakeExec({}, life, life.programs).exec_sync(c, ["top"])
    assert (res.exit_code, res.stderr) == (127, b"sh: top: not found\n")
    assert (await follower.stop(life, c, 5)).exit_code == 143


async def test_an_images_scripted_files_are_its_containers() -> None:
    rules = {"docker.io/library/busybox": {"files": {"/app/config": "mode=test\n"}}}
    images = FakeImages({"pull_seconds": 0, "images": rules})
    life = FakeLifecycle({}, images, Programs("fake", {}))
    follower = Follower()
    await life.start(follower)
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    await life.run_sandbox(sandbox())
    c = container("1" * 64, ["sleep", "3600"])
    await life.create_container(c, life.sandboxes["5" * 64])
    await follower.start(life, c, life.sandboxes["5" * 64])
    res = await FakeExec({}, life, life.programs).exec_sync(c, ["cat", "/app/config", "/etc/hostname"])
    assert res.stdout == b"mode=test\nweb\n"
    with pytest.raises(ValueError, match="files"):
        FakeImages({"images": {"busybox": {"files": {"relative": "x"}}}})
    await follower.stop(life, c, 0)
