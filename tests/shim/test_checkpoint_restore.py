"""CreateContainer whose image is a container checkpoint, through the gRPC edge on the fake: the
kubelet's archive named as the image (a path), or an image made from it (the CRI-O annotation);
what the checkpoint gives the new container, its counter going on at StartContainer, and bad
archives refused before anything is made. And CheckpointContainer's timeout: DEADLINE_EXCEEDED
with the container running and no archive written."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from backends.fake import PROGRAM_ANNOTATION
from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests import counter
from tests.criutil import container_config, sandbox_config, until
from tests.shim.services_kit import Kit, Pod, container_status, open_kit, run_pod, start
from tests.shim.test_checkpoint_service import (
    BAD_ARCHIVES,
    archive_members,
    everything,
    read_file,
    write_archive,
    write_file,
)

CHECKPOINT_ANNOTATION = "io.kubernetes.cri-o.annotations.checkpoint.name"


def log_of(path: Path) -> list[int]:
    return counter.numbers(path.read_bytes()) if path.exists() else []


async def counting(kit: Kit, pod: Pod, name: str = "counter") -> str:
    """A counter, started, with an environment, a working directory and labels of its own."""
    cfg = container_config(
        name=name,
        command=["/counter", "--every", "0.1s"],
        log_path=f"{name}.log",
        labels={"app": "counter", "tier": "old"},
        annotations={PROGRAM_ANNOTATION: counter.program()},
        envs=[pb.KeyValue(key="GREETING", value=b"from-the-checkpoint")],
        working_dir="/tmp",
    )
    req = pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=cfg, sandbox_config=pod.config)
    cid = str((await kit.ok("CreateContainer", req)).container_id)
    await start(kit, cid)
    return cid


async def checkpointed_counter(kit: Kit, tmp_path: Path) -> tuple[str, str]:
    """A counter that has written 5 numbers, checkpointed at ``tmp_path/out/counter.tar``."""
    pod = await run_pod(kit)
    cid = await counting(kit, pod)
    await write_file(kit, cid, "/tmp/state", "written-before")
    await until(lambda: len(log_of(Path(kit.log_dir) / "counter.log")) >= 5)
    (tmp_path / "out").mkdir(exist_ok=True)
    location = str(tmp_path / "out" / "counter.tar")
    await kit.ok("CheckpointContainer", pb.CheckpointContainerRequest(container_id=cid, location=location))
    return cid, location


async def new_pod(kit: Kit, name: str = "again") -> tuple[Pod, Path]:
    logs = Path(kit.root) / f"logs-{name}"
    logs.mkdir(exist_ok=True)
    cfg = sandbox_config(name=name, uid=f"uid-{name}", log_directory=str(logs))
    return Pod((await kit.ok("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg))).pod_sandbox_id, cfg), logs


def from_checkpoint(pod: Pod, image: str, name: str = "restored", **kw: Any) -> pb.CreateContainerRequest:
    cfg = container_config(name=name, image=image, log_path=f"{name}.log", **kw)
    return pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=cfg, sandbox_config=pod.config)


async def shell(kit: Kit, cid: str, script: str) -> str:
    resp = await kit.ok("ExecSync", pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", script], timeout=5))
    assert resp.exit_code == 0, resp.stderr
    return bytes(resp.stdout).decode()


async def test_a_container_created_from_its_archive_continues_the_counter(kit: Kit, tmp_path: Path) -> None:
    old, location = await checkpointed_counter(kit, tmp_path)
    expected = counter.next_after(counter.elapsed_in(location))
    assert expected > 5  # it had counted before the checkpoint
    pod, logs = await new_pod(kit)
    before = await everything(kit)
    # The kubelet's request for a container restored from an archive: the archive as its image,
    # no command of its own.
    req = from_checkpoint(pod, location, labels={"tier": "new"})
    cid = str((await kit.ok("CreateContainer", req)).container_id)
    assert cid != old and len((await everything(kit))[1]) == len(before[1]) + 1
    status = await container_status(kit, cid)
    assert (status.state, status.metadata.name) == (pb.CONTAINER_CREATED, "restored")
    # What it runs is the checkpointed container's image, not the archive.
    assert status.image.image == "docker.io/library/busybox:latest" and status.image_ref.startswith("sha256:")
    assert dict(status.labels) == {"app": "counter", "tier": "new"}  # the request's win
    assert not log_of(logs / "restored.log")  # created, not started: it writes nothing yet
    await start(kit, cid)
    await until(lambda: len(log_of(logs / "restored.log")) >= 3)
    got = log_of(logs / "restored.log")
    assert got[:3] == [expected, expected + 1, expected + 2], (expected, got)
    # The checkpointed config's command, environment and working directory; its own files.
    assert " counter\n" in await shell(kit, cid, "ps")  # busybox's ps: the command's name
    assert await shell(kit, cid, "echo $GREETING; pwd") == "from-the-checkpoint\n/tmp\n"
    assert await read_file(kit, cid, "/tmp/state") == b"written-before\n"
    # The checkpointed one ran on, unharmed: it wrote every number up to where the restored one began.
    await until(lambda: expected in log_of(Path(kit.log_dir) / "counter.log"))
    assert log_of(Path(kit.log_dir) / "counter.log")[: expected - 1] == list(range(1, expected))
    assert (await container_status(kit, old)).state == pb.CONTAINER_RUNNING


async def test_what_the_request_gives_wins_over_the_checkpoint(kit: Kit, tmp_path: Path) -> None:
    _, location = await checkpointed_counter(kit, tmp_path)
    pod, _ = await new_pod(kit)
    req = from_checkpoint(
        pod,
        location,
        command=["/ticker", "--every", "1s"],
        envs=[pb.KeyValue(key="GREETING", value=b"from-the-request")],
        working_dir="/var",
    )
    cid = str((await kit.ok("CreateContainer", req)).container_id)
    await start(kit, cid)
    ps = await shell(kit, cid, "ps")
    assert " ticker\n" in ps and "counter" not in ps
    assert await shell(kit, cid, "echo $GREETING; pwd") == "from-the-request\n/var\n"


async def test_an_image_made_from_the_archive_restores_as_the_archive_does(tmp_path: Path) -> None:
    """`buildah add IMAGE ARCHIVE /` with the annotation (checkpointctl build): the archive's
    members are the image's files, and the image is pulled as any other."""
    async with open_kit(str(tmp_path / "a")) as kit:
        _, location = await checkpointed_counter(kit, tmp_path)
        expected = counter.next_after(counter.elapsed_in(location))
        members = archive_members(location)
        async with open_kit(str(tmp_path / "b")) as other:
            image = "registry.example/counter-checkpoint:1"
            other.fake.runtime.images.add_rule(
                image,
                {
                    "annotations": {CHECKPOINT_ANNOTATION: "counter"},
                    "files": {f"/{name}": data.decode() for name, data in members.items()},
                },
            )
            pulled = await other.ok("PullImage", pb.PullImageRequest(image=pb.ImageSpec(image=image)))
            pod, logs = await new_pod(other)
            # As the kubelet names it: by the ID its pull answered, the spec's name beside it.
            req = from_checkpoint(pod, pulled.image_ref)
            req.config.image.user_specified_image = image
            cid = str((await other.ok("CreateContainer", req)).container_id)
            await start(other, cid)
            await until(lambda: len(log_of(logs / "restored.log")) >= 2)
            assert log_of(logs / "restored.log")[:2] == [expected, expected + 1]
            assert await read_file(other, cid, "/tmp/state") == b"written-before\n"
            # The same image without its annotation is a plain image: no command, nothing restored.
            other.fake.runtime.images.add_rule(image, {"files": {"/manifest.json": "{}"}})
            plain = str(
                (await other.ok("CreateContainer", from_checkpoint(pod, image, "plain"))).container_id
            )
            await start(other, plain)
            assert (await container_status(other, plain)).image.image == image


def _renamed(raw: bytes, members: dict[str, bytes]) -> dict[str, bytes]:
    return {**members, "manifest.json": members["manifest.json"].replace(b'"counter"', b'"cuonter"')}


CREATE_BAD_ARCHIVES = {**BAD_ARCHIVES, "manifest-edited": _renamed}


@pytest.mark.parametrize("damage", list(CREATE_BAD_ARCHIVES))
async def test_a_bad_archive_is_refused_before_anything_is_made(
    kit: Kit, tmp_path: Path, damage: str
) -> None:
    _, location = await checkpointed_counter(kit, tmp_path)
    raw = Path(location).read_bytes()
    made = CREATE_BAD_ARCHIVES[damage](raw, archive_members(location))
    if isinstance(made, dict):
        write_archive(location, made)
    else:
        Path(location).write_bytes(made)
    kept = Path(location).read_bytes()
    pod, _ = await new_pod(kit)
    before = await everything(kit)
    code, detail, _ = await kit.call("CreateContainer", from_checkpoint(pod, location))
    assert (code, "checkpoint" in detail, location in detail) == (Code.INVALID_ARGUMENT, True, True), detail
    assert await everything(kit) == before
    assert Path(location).read_bytes() == kept  # read, never changed
    # Its name was not kept: a plain container of that name can be made.
    await kit.ok("CreateContainer", from_checkpoint(pod, "busybox"))


async def test_a_pod_checkpoint_is_no_container_checkpoint(kit: Kit, tmp_path: Path) -> None:
    pod = await run_pod(kit)
    cid = await counting(kit, pod)
    (tmp_path / "pod").mkdir()
    req = pb.CheckpointPodRequest(
        pod_sandbox_id=pod.id, output_path=str(tmp_path / "pod"), container_ids=[cid]
    )
    await kit.ok("CheckpointPod", req)
    again, _ = await new_pod(kit)
    before = await everything(kit)
    code, detail, _ = await kit.call(
        "CreateContainer", from_checkpoint(again, str(tmp_path / "pod" / "pod.tar"))
    )
    assert (code, "is a pod checkpoint, not a container one" in detail) == (Code.INVALID_ARGUMENT, True), (
        detail
    )
    assert await everything(kit) == before


async def test_archive_paths_that_may_not_be_read(kit: Kit, tmp_path: Path) -> None:
    _, location = await checkpointed_counter(kit, tmp_path)
    pod, _ = await new_pod(kit)
    link = tmp_path / "out" / "link.tar"
    link.symlink_to(location)
    cases = [
        (str(tmp_path / "out" / "missing.tar"), "does not exist"),
        (str(tmp_path / "out"), "not a regular file"),
        (str(link), "not a regular file"),
        (location.replace("/out/", "/out/../out/"), "'..'"),
        ("/proc/self/environ", "under /proc"),
        (os.path.join(kit.state_dir, "containers"), "state"),
    ]
    before = await everything(kit)
    for image, says in cases:
        code, detail, _ = await kit.call("CreateContainer", from_checkpoint(pod, image))
        assert (code, says in detail) == (Code.INVALID_ARGUMENT, True), (image, detail)
        assert await everything(kit) == before


async def test_a_handler_without_checkpoints_refuses_an_archive(kit: Kit, tmp_path: Path) -> None:
    _, location = await checkpointed_counter(kit, tmp_path)
    pod, _ = await new_pod(kit)
    kit.fake.checkpoint = None
    before = await everything(kit)
    code, detail, _ = await kit.call("CreateContainer", from_checkpoint(pod, location))
    assert (code, "'fake'" in detail) == (Code.UNIMPLEMENTED, True), detail
    assert await everything(kit) == before


async def test_a_restore_failing_after_the_create_removes_the_container(kit: Kit, tmp_path: Path) -> None:
    _, location = await checkpointed_counter(kit, tmp_path)
    pod, _ = await new_pod(kit)
    before = await everything(kit)
    for step in ("open_container_checkpoint", "create_container", "restore_container"):
        kit.inject(((step, "UNAVAILABLE: the runtime is down"),))
        code, detail, _ = await kit.call("CreateContainer", from_checkpoint(pod, location))
        assert code == Code.UNAVAILABLE, (step, detail)
        assert await everything(kit) == before, step
    await kit.ok("CreateContainer", from_checkpoint(pod, location))


# ---------------------------------------------------------------------- the deadline


async def test_a_checkpoint_past_its_timeout_is_deadline_exceeded_and_writes_nothing(tmp_path: Path) -> None:
    async with open_kit(str(tmp_path / "k"), checkpoint_seconds=3600) as kit:
        pod = await run_pod(kit)
        cid = await counting(kit, pod)
        out = tmp_path / "out"
        out.mkdir()
        location = out / "c.tar"
        location.write_bytes(b"an older checkpoint")
        req = pb.CheckpointContainerRequest(container_id=cid, location=str(location), timeout=1)
        code, detail, _ = await kit.call("CheckpointContainer", req)
        assert (code, "timeout of 1 s" in detail) == (Code.DEADLINE_EXCEEDED, True), detail
        assert os.listdir(out) == ["c.tar"] and location.read_bytes() == b"an older checkpoint"
        assert (await container_status(kit, cid)).state == pb.CONTAINER_RUNNING
        # It still counts, and it can be checkpointed again once the dump is quick.
        seen = len(log_of(Path(kit.log_dir) / "counter.log"))
        await until(lambda: len(log_of(Path(kit.log_dir) / "counter.log")) > seen)
        kit.fake.runtime.checkpoint.seconds = 0  # type: ignore[union-attr]
        await kit.ok("CheckpointContainer", req)
        with tarfile.open(location) as tar:
            assert "manifest.json" in tar.getnames()


async def test_a_negative_timeout_is_refused(kit: Kit, tmp_path: Path) -> None:
    pod = await run_pod(kit)
    cid = await counting(kit, pod)
    req = pb.CheckpointContainerRequest(container_id=cid, location=str(tmp_path / "c.tar"), timeout=-1)
    code, detail, _ = await kit.call("CheckpointContainer", req)
    assert (code, "timeout" in detail) == (Code.INVALID_ARGUMENT, True)
    assert not (tmp_path / "c.tar").exists()
