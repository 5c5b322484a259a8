"""The fake runtime's parts, each on its own: image store, programs, lifecycle, exec, stats."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from backends.contract import ContainerRecord, ExecResult, SandboxRecord, recorded_stop_signal
from backends.contract.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from backends.fake.exec import FakeExec
from backends.fake.images import FakeImages
from backends.fake.lifecycle import FakeLifecycle
from backends.fake.program import PROGRAM_ANNOTATION, Programs
from backends.fake.stats import FakeStats
from cri_api import api_pb2 as pb
from tests.as_shim import AsShim
from tests.follow import Follower as Events
from tests.follow import MemoryLog


def sandbox(sid: str, network: pb.NamespaceMode = pb.POD) -> SandboxRecord:
    cfg = pb.PodSandboxConfig(hostname="web")
    cfg.linux.security_context.namespace_options.network = network
    return SandboxRecord(id=sid, handler="", backend="fake", config=cfg, created_at=0)


def container(
    cid: str, image: str = "busybox:1", command: list[str] | None = None, program: str | None = None
) -> ContainerRecord:
    cfg = pb.ContainerConfig(image=pb.ImageSpec(image=image), command=command or [])
    if program is not None:
        cfg.annotations[PROGRAM_ANNOTATION] = program
    return ContainerRecord(id=cid, sandbox_id="5" * 64, backend="fake", config=cfg, created_at=0, log_path="")


def parts(options: dict[str, object] | None = None) -> tuple[FakeImages, Programs, FakeLifecycle]:
    options = options or {}
    images = FakeImages(options)
    programs = Programs("fake", options)
    return images, programs, FakeLifecycle(options, images, programs)


# ---------------------------------------------------------------------- images


async def test_image_store_persists_across_instances(tmp_path: Path) -> None:
    opts = {"state_dir": str(tmp_path), "pull_seconds": 0}
    store = FakeImages(opts)
    store.load()
    iid = await store.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    await store.pull_image(pb.ImageSpec(image="docker.io/library/busybox:2"), None, None)
    saved = json.loads((tmp_path / "images.json").read_text())
    assert [d["id"] for d in saved] == [iid]  # two tags of one repository: one image

    again = FakeImages(opts)
    again.load()
    found = await again.image_status(pb.ImageSpec(image="busybox:2"))
    assert found is not None and found.id == iid
    assert sorted(found.repo_tags) == ["docker.io/library/busybox:1", "docker.io/library/busybox:2"]
    assert again.find(iid.removeprefix("sha256:")[:12]) is not None  # unique ID prefix
    await again.remove_image(pb.ImageSpec(image="busybox:1"))
    assert await again.list_images() == []


async def test_image_rules_missing_images_and_pinned_pause(tmp_path: Path) -> None:
    store = FakeImages(
        {
            "state_dir": str(tmp_path),
            "pull_seconds": 0,
            "pause_image": "registry.k8s.io/pause:3.10",
            "images": {"example.com/app": {"id": "sha256:" + "ab" * 32, "size": 123, "username": "app"}},
            "missing_images": ["example.com/private/*"],
        }
    )
    store.load()
    [pause] = await store.list_images()
    assert pause.pinned and pause.repo_tags == ("registry.k8s.io/pause:3.10",)
    auth = pb.AuthConfig(username="u")
    assert (
        await store.pull_image(pb.ImageSpec(image="example.com/app:1"), auth, None) == "sha256:" + "ab" * 32
    )
    app = await store.image_status(pb.ImageSpec(image="example.com/app:1"))
    assert app is not None and (app.size, app.username, app.uid) == (123, "app", None)
    with pytest.raises(NotFoundError):
        await store.pull_image(pb.ImageSpec(image="example.com/private/x:1"), None, None)
    with pytest.raises(InvalidArgumentError):
        await store.pull_image(pb.ImageSpec(image="UPPER/case"), None, None)
    assert [p[0] for p in store.pulls] == ["example.com/app:1", "example.com/private/x:1", "UPPER/case"]
    assert store.pulls[0][1] is auth
    fs = store.fs_info(containers=2)
    assert fs.image_filesystems[0].used_bytes.value == 123 + pause.size
    assert fs.container_filesystems[0].used_bytes.value == 2 * 4096
    # Distinct simulated stores, both existing directories (the kubelet stats them).
    mounts = (fs.image_filesystems[0].fs_id.mountpoint, fs.container_filesystems[0].fs_id.mountpoint)
    assert mounts[0] != mounts[1] and all(os.path.isdir(m) for m in mounts)
    assert not FakeImages({}).fs_info(containers=2).image_filesystems  # no state dir: nothing to report


# ---------------------------------------------------------------------- programs


def test_exec_rules() -> None:
    programs = Programs("fake", {"exec": [{"cmd": ["health", "*"], "stdout": "ok", "exit_code": 0}]})
    programs.add_exec_rule(["slow"], ExecResult(exit_code=3), delay=1.5)
    assert programs.exec_rule(["health", "--deep"]) == (ExecResult(exit_code=0, stdout=b"ok"), 0.0)
    assert programs.exec_rule(["slow"]) == (ExecResult(exit_code=3), 1.5)
    assert programs.exec_rule(["hostname"]) is None  # the shell's
    with pytest.raises(ValueError, match=r"exec\[0\]\.cmd"):
        Programs("fake", {"exec": [{"cmd": []}]})


def test_program_precedence() -> None:
    programs = Programs("fake", {"programs": {"docker.io/library/nginx": {"output": ["table"]}}})
    annotated = container("1" * 64, "nginx:1", ["echo", "cmd"], program='{"output": ["annotation"]}')
    prog = programs.program_for(annotated)
    assert prog is not None and prog.output[0].line == "annotation"
    prog = programs.program_for(container("1" * 64, "nginx:1", ["echo", "cmd"]))
    assert prog is not None and prog.output[0].line == "table"
    assert programs.program_for(container("1" * 64, "busybox", ["echo", "cmd"])) is None  # its command runs
    with pytest.raises(InvalidArgumentError):
        programs.program_for(container("1" * 64, program="{nope"))


# ---------------------------------------------------------------------- lifecycle


async def test_pod_ips_round_robin_never_reuse_a_held_one() -> None:
    _, _, life = parts({"pod_cidr": "10.1.0.0/29"})  # usable offsets 2..6
    ips = [(await life.run_sandbox(sandbox(str(i) * 64))).ip for i in range(5)]
    assert ips == [f"10.1.0.{i}" for i in range(2, 7)]
    with pytest.raises(ResourceExhaustedError):
        await life.run_sandbox(sandbox("9" * 64))
    await life.remove_sandbox(life.sandboxes["1" * 64])
    assert (await life.run_sandbox(sandbox("9" * 64))).ip == "10.1.0.3"
    assert (await life.run_sandbox(sandbox("8" * 64, pb.NODE))).ip == ""


async def test_program_output_and_exit_reach_logs_and_events() -> None:
    images, _, life = parts({"pull_seconds": 0})
    events = Events()
    await life.start(events)
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    c = container("a" * 64, command=["sh", "-c", "echo hi; sleep 0.05; exit 4"])
    with pytest.raises(NotFoundError):
        await life.start_container(c, sandbox("5" * 64))  # never created
    await life.create_container(c, sandbox("5" * 64))
    assert c.image_ref.startswith("sha256:") and c.image_name == "docker.io/library/busybox:1"
    logs = MemoryLog()
    await events.start(life, c, sandbox("5" * 64), logs)
    await asyncio.sleep(0)
    assert logs.data["stdout"] == b"hi\n"
    assert (await events.exit_of(c.id, timeout=1)).exit_code == 4
    assert list(events.exits) == [c.id]
    assert c.id not in life.running
    with pytest.raises(NotFoundError):
        await life.create_container(container("b" * 64, image="absent:1"), sandbox("5" * 64))


async def test_stop_kills_a_program_that_ignores_sigterm() -> None:
    images, _, life = parts({"pull_seconds": 0})
    await life.start(Events())
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    stubborn = container("a" * 64, program='{"ignore_sigterm": true}')
    polite = container("b" * 64)
    for c in (stubborn, polite):
        await life.create_container(c, sandbox("5" * 64))
        await life.start_container(c, sandbox("5" * 64))
    assert (await life.stop_container(stubborn, 0)).exit_code == 137
    assert (await life.stop_container(polite, 10)).exit_code == 143
    assert (await life.stop_container(polite, 10)).reason == "Completed"  # already stopped
    await life.close()


async def test_an_images_stop_signal_is_the_one_its_shell_gets() -> None:
    """An image rule's ``stop_signal`` (its STOPSIGNAL) is recorded at create and delivered at stop,
    unless the container's config names another."""
    images, _, life = parts({"pull_seconds": 0, "images": {"example.com/quits": {"stop_signal": "SIGQUIT"}}})
    await life.start(Events())
    await images.pull_image(pb.ImageSpec(image="example.com/quits:1"), None, None)
    script = "trap 'echo got-quit; exit 0' QUIT; trap 'echo got-usr1; exit 0' USR1; sleep 3600 & wait"
    by_image = container("a" * 64, "example.com/quits:1", ["sh", "-c", script])
    by_config = container("b" * 64, "example.com/quits:1", ["sh", "-c", script])
    by_config.config.stop_signal = pb.SIGNAL_SIGUSR1
    logs = {}
    for c in (by_image, by_config):
        await life.create_container(c, sandbox("5" * 64))
        started = await life.start_container(c, sandbox("5" * 64))
        logs[c.id] = started.process
    assert (recorded_stop_signal(by_image), recorded_stop_signal(by_config)) == (
        pb.SIGNAL_SIGQUIT,
        pb.SIGNAL_SIGUSR1,
    )
    await asyncio.sleep(0.05)  # the shells reach their `wait`
    for c, said in ((by_image, b"got-quit\n"), (by_config, b"got-usr1\n")):
        assert (await life.stop_container(c, 10)).exit_code == 0
        got = b"".join([out.data async for out in logs[c.id].output()])
        assert got == said
    await life.close()


async def test_recover_adopts_records_and_their_ips() -> None:
    _, _, life = parts({"pod_cidr": "10.1.0.0/29"})
    sb = sandbox("1" * 64)
    sb.backend_data["ip"] = "10.1.0.2"
    c = container("a" * 64)
    c.status = type(c.status)(started_at=5)
    sbs, cts = await life.recover([sb], [c])
    assert sbs[sb.id].exists and cts[c.id].running and cts[c.id].started_at == 5
    assert c.id in life.running
    assert (await life.run_sandbox(sandbox("2" * 64))).ip == "10.1.0.3"  # .2 is still held


# ---------------------------------------------------------------------- exec and stats


async def test_exec_sync_is_cancellable_and_stats_count_running(tmp_path: Path) -> None:
    images, programs, life = parts({"pull_seconds": 0})
    programs.add_exec_rule(["slow"], ExecResult(exit_code=0), delay=5)
    streams = FakeExec({}, life, programs)
    stats = FakeStats(life, str(tmp_path))
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    sb = sandbox("5" * 64)
    await life.run_sandbox(sb)
    running, created = container("a" * 64, command=["top"]), container("b" * 64)
    for c in (running, created):
        await life.create_container(c, sb)
    await life.start_container(running, sb)
    assert (await streams.exec_sync(running, ["pgrep", "top"])).exit_code == 0
    with pytest.raises(TimeoutError):  # the shim's timeout cancels the call, which ends at once
        async with asyncio.timeout(0.05):
            await streams.exec_sync(running, ["slow"])
    per_sb = await AsShim().sandbox_stats(stats, [sb], [running, created])
    assert per_sb[sb.id].linux.process.process_count.value == 1
    per_c = await AsShim().container_stats(stats, [running, created])
    assert per_c[running.id].memory.working_set_bytes.value > 0
    assert per_c[created.id].memory.working_set_bytes.value == 0
    assert per_c[created.id].writable_layer.fs_id.mountpoint == str(tmp_path)
    await life.close()
