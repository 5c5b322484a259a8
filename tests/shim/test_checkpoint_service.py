"""CheckpointContainer, CheckpointPod and RestorePod through the gRPC edge, on the fake runtime:
what each refuses (and that a refusal leaves nothing behind), an archive's contents, and a pod
checkpointed, restored and started again with its files and its program where they were."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from backends.fake import PROGRAM_ANNOTATION
from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests.criutil import container_config, sandbox_config, until
from tests.shim.services_kit import (
    Kit,
    Pod,
    backend_holds,
    container_status,
    create,
    listed_containers,
    listed_pods,
    record_files,
    run_pod,
    start,
)

# A scripted program: one line at once, one a while later, then it runs until stopped.
PROGRAM = {"output": ["early", {"line": "late", "after": 0.4}]}


def app_config(kit: Kit, name: str = "app", log: str = "") -> pb.ContainerConfig:
    return container_config(
        name=name,
        command=["/app"],
        log_path=log or f"{name}.log",
        annotations={PROGRAM_ANNOTATION: json.dumps(PROGRAM)},
    )


async def running_app(kit: Kit, pod: Pod, name: str = "app") -> str:
    req = pb.CreateContainerRequest(
        pod_sandbox_id=pod.id, config=app_config(kit, name), sandbox_config=pod.config
    )
    cid = str((await kit.ok("CreateContainer", req)).container_id)
    await start(kit, cid)
    return cid


async def write_file(kit: Kit, cid: str, path: str, text: str) -> None:
    req = pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", f"echo {text} > {path}"], timeout=5)
    assert (await kit.ok("ExecSync", req)).exit_code == 0


async def read_file(kit: Kit, cid: str, path: str) -> bytes:
    resp = await kit.ok("ExecSync", pb.ExecSyncRequest(container_id=cid, cmd=["cat", path], timeout=5))
    assert resp.exit_code == 0, resp.stderr
    return bytes(resp.stdout)


def restore_request(
    kit: Kit, path: str, names: tuple[str, ...] = ("app",), pod: str = "again"
) -> pb.RestorePodRequest:
    logs = os.path.join(kit.root, "logs-" + pod)
    os.makedirs(logs, exist_ok=True)
    cfg = sandbox_config(name=pod, uid=f"uid-{pod}", log_directory=logs)
    return pb.RestorePodRequest(
        checkpoint_path=path, config=cfg, container_configs=[app_config(kit, n) for n in names]
    )


async def checkpointed_pod(
    kit: Kit, tmp_path: Path, names: tuple[str, ...] = ("app",)
) -> tuple[Pod, list[str], str]:
    pod = await run_pod(kit)
    cids = [await running_app(kit, pod, n) for n in names]
    for cid in cids:
        await write_file(kit, cid, "/state", "kept-" + cid[:6])
    out = tmp_path / "ckpt"
    out.mkdir()
    await kit.ok(
        "CheckpointPod",
        pb.CheckpointPodRequest(pod_sandbox_id=pod.id, output_path=str(out), container_ids=cids),
    )
    return pod, cids, str(out)


def archive_members(path: str) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]


def write_archive(path: str, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


async def everything(kit: Kit) -> tuple[Any, ...]:
    return (
        sorted(await listed_pods(kit)),
        sorted(await listed_containers(kit)),
        record_files(kit),
        backend_holds(kit),
    )


# ---------------------------------------------------------------------- CheckpointContainer


async def test_checkpoint_container_writes_a_self_describing_archive(kit: Kit, tmp_path: Path) -> None:
    pod = await run_pod(kit)
    cid = await running_app(kit, pod)
    await write_file(kit, cid, "/state", "hello")
    (tmp_path / "out").mkdir()
    location = tmp_path / "out" / "c.tar"
    await kit.ok(
        "CheckpointContainer", pb.CheckpointContainerRequest(container_id=cid, location=str(location))
    )
    members = archive_members(str(location))
    manifest = json.loads(members["manifest.json"])
    assert manifest["format"] == "cri-shim-fake-checkpoint/1" and manifest["kind"] == "container"
    (entry,) = manifest["containers"]
    assert (entry["name"], entry["id"], entry["state"]) == ("app", cid, "CONTAINER_RUNNING")
    assert pb.ContainerConfig.FromString(base64.b64decode(entry["config"])).command == ["/app"]
    assert set(manifest["members"]) == {entry["files"]}
    assert b"/state" in members[entry["files"]]
    assert os.listdir(tmp_path / "out") == ["c.tar"]  # no temporary file left beside it
    assert (await container_status(kit, cid)).state == pb.CONTAINER_RUNNING  # it runs on


@pytest.mark.parametrize(
    ("location", "code", "says"),
    [
        ("", Code.INVALID_ARGUMENT, "must not be empty"),
        ("c.tar", Code.INVALID_ARGUMENT, "absolute"),
        ("{tmp}/../c.tar", Code.INVALID_ARGUMENT, "'..'"),
        ("{tmp}//c.tar", Code.INVALID_ARGUMENT, "normal path"),
        ("/proc/self/c.tar", Code.INVALID_ARGUMENT, "under /proc"),
        ("/", Code.INVALID_ARGUMENT, "root directory"),
        ("{tmp}/nowhere/c.tar", Code.INVALID_ARGUMENT, "does not exist"),
        ("{tmp}", Code.INVALID_ARGUMENT, "is a directory"),
    ],
)
async def test_checkpoint_container_refuses_where_it_may_not_write(
    kit: Kit, tmp_path: Path, location: str, code: Code, says: str
) -> None:
    pod = await run_pod(kit)
    cid = await running_app(kit, pod)
    where = tmp_path / "out"
    where.mkdir()
    req = pb.CheckpointContainerRequest(container_id=cid, location=location.format(tmp=where))
    got, detail, _ = await kit.call("CheckpointContainer", req)
    assert (got, says in detail) == (code, True), detail
    assert os.listdir(where) == []


async def test_checkpoint_container_of_one_not_running_or_unknown(kit: Kit, tmp_path: Path) -> None:
    pod = await run_pod(kit)
    created = await create(kit, pod)
    req = pb.CheckpointContainerRequest(container_id=created, location=str(tmp_path / "c.tar"))
    code, detail, _ = await kit.call("CheckpointContainer", req)
    assert code == Code.FAILED_PRECONDITION and "not running" in detail
    req.container_id = "f" * 64
    assert (await kit.call("CheckpointContainer", req))[0] == Code.NOT_FOUND
    assert not (tmp_path / "c.tar").exists()


async def test_a_handler_without_checkpoints_answers_unimplemented_naming_it(
    kit: Kit, tmp_path: Path
) -> None:
    pod = await run_pod(kit)
    cid = await running_app(kit, pod)
    kit.fake.checkpoint = None
    (tmp_path / "d").mkdir()
    for method, req in (
        (
            "CheckpointContainer",
            pb.CheckpointContainerRequest(container_id=cid, location=str(tmp_path / "c.tar")),
        ),
        ("CheckpointPod", pb.CheckpointPodRequest(pod_sandbox_id=pod.id, output_path=str(tmp_path / "d"))),
        ("RestorePod", restore_request(kit, str(tmp_path / "d"))),
    ):
        code, detail, _ = await kit.call(method, req)
        assert (code, "'fake'" in detail, method in detail) == (Code.UNIMPLEMENTED, True, True), detail


# ---------------------------------------------------------------------- CheckpointPod


async def test_checkpoint_pod_refusals_write_nothing(kit: Kit, tmp_path: Path) -> None:
    pod = await run_pod(kit)
    other = await run_pod(kit, "other")
    cid = await running_app(kit, pod)
    stranger = await running_app(kit, other)
    idle = await create(kit, pod, "idle")
    out = tmp_path / "out"
    out.mkdir()
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")

    def req(**kw: Any) -> pb.CheckpointPodRequest:
        base: dict[str, Any] = {"pod_sandbox_id": pod.id, "output_path": str(out), "container_ids": [cid]}
        return pb.CheckpointPodRequest(**{**base, **kw})

    cases = [
        (req(pod_sandbox_id="f" * 64), Code.NOT_FOUND, ""),
        (req(pod_sandbox_id=""), Code.INVALID_ARGUMENT, "pod_sandbox_id"),
        (req(output_path=""), Code.INVALID_ARGUMENT, "output_path must not be empty"),
        (req(output_path="out"), Code.INVALID_ARGUMENT, "absolute"),
        (req(output_path=str(out) + "/../out"), Code.INVALID_ARGUMENT, "'..'"),
        (req(output_path="/sys/fs"), Code.INVALID_ARGUMENT, "under /sys"),
        (req(output_path=str(tmp_path / "missing")), Code.INVALID_ARGUMENT, "not an existing directory"),
        (req(output_path=str(full)), Code.INVALID_ARGUMENT, "not empty"),
        (req(container_ids=[]), Code.INVALID_ARGUMENT, "at least one"),
        (req(container_ids=[cid, cid]), Code.INVALID_ARGUMENT, "twice"),
        (req(container_ids=[cid, stranger]), Code.INVALID_ARGUMENT, "belongs to pod"),
        (req(container_ids=["e" * 64]), Code.NOT_FOUND, ""),
        (req(container_ids=[cid, idle]), Code.FAILED_PRECONDITION, "not running"),
        (req(options={"leave-running": "true"}), Code.INVALID_ARGUMENT, "'leave-running'"),
    ]
    for request, code, says in cases:
        got, detail, _ = await kit.call("CheckpointPod", request)
        assert (got, says in detail) == (code, True), (request, detail)
        assert os.listdir(out) == [] and os.listdir(full) == ["x"]
    assert (await container_status(kit, cid)).state == pb.CONTAINER_RUNNING


async def test_a_failed_pod_checkpoint_leaves_its_directory_empty(
    kit: Kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = await run_pod(kit)
    cid = await running_app(kit, pod)
    out = tmp_path / "out"
    out.mkdir()
    kit.inject((("checkpoint_pod", "UNAVAILABLE: the runtime is down"),))
    req = pb.CheckpointPodRequest(pod_sandbox_id=pod.id, output_path=str(out), container_ids=[cid])
    assert (await kit.call("CheckpointPod", req))[0] == Code.UNAVAILABLE
    assert os.listdir(out) == []

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    # The disk fills while the archive is written: an error, and nothing half-written left.
    monkeypatch.setattr(os, "fsync", full)
    code, detail, _ = await kit.call("CheckpointPod", req)
    monkeypatch.undo()
    assert code != Code.OK and "No space left" in detail and os.listdir(out) == [], detail
    assert (await container_status(kit, cid)).state == pb.CONTAINER_RUNNING


# ---------------------------------------------------------------------- RestorePod


async def test_a_pod_restored_resumes_its_containers(kit: Kit, tmp_path: Path) -> None:
    pod, cids, out = await checkpointed_pod(kit, tmp_path, ("app", "side"))
    assert os.listdir(out) == ["pod.tar"]
    await until(lambda: b"late" in (Path(kit.log_dir) / "app.log").read_bytes())
    before = await everything(kit)
    resp = await kit.ok("RestorePod", restore_request(kit, out, ("side", "app")))
    assert resp.pod_sandbox_id and resp.pod_sandbox_id != pod.id
    assert [c.name for c in resp.restored_containers] == ["side", "app"]
    restored = {c.name: c.container_id for c in resp.restored_containers}
    assert not set(restored.values()) & set(cids) and all(restored.values())
    for name, cid in restored.items():
        status = await container_status(kit, cid)
        assert (status.state, status.metadata.name) == (pb.CONTAINER_CREATED, name)
    status = (
        await kit.ok("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=resp.pod_sandbox_id))
    ).status
    assert (status.metadata.uid, status.state) == ("uid-again", pb.SANDBOX_READY)
    assert archive_members(os.path.join(out, "pod.tar"))  # the checkpoint is left as it was
    assert len((await everything(kit))[0]) == len(before[0]) + 1
    for name, cid in restored.items():
        await start(kit, cid)
        # Its own files are the checkpoint's: not those of a new container.
        old = cids[("app", "side").index(name)]
        assert await read_file(kit, cid, "/state") == b"kept-" + old[:6].encode() + b"\n"
    # The program resumed after its first lines: they are not written again.
    log = Path(kit.root) / "logs-again" / "app.log"
    await until(lambda: log.exists())
    await asyncio.sleep(0.2)
    assert b"early" not in log.read_bytes() and b"late" not in log.read_bytes()


def _tampered(members: dict[str, bytes]) -> dict[str, bytes]:
    name = next(n for n in members if n.startswith("containers/"))
    return {**members, name: members[name].replace(b"=", b"A", 1) + b" "}


def _manifest_edited(members: dict[str, bytes]) -> dict[str, bytes]:
    return {**members, "manifest.json": members["manifest.json"].replace(b'"app"', b'"ppa"')}


def _unlisted(members: dict[str, bytes]) -> dict[str, bytes]:
    return {**members, "containers/extra/files.json": b"{}"}


BAD_ARCHIVES = {
    "truncated": lambda raw, m: raw[: len(raw) // 3],
    "empty": lambda raw, m: b"",
    "not-a-tar": lambda raw, m: b"PK\x03\x04 this is a zip, say",
    "foreign-tar": lambda raw, m: {"etc/passwd": b"root:x:0:0::/root:/bin/sh\n"},
    "tampered-member": lambda raw, m: _tampered(m),
    "manifest-edited": lambda raw, m: _manifest_edited(m),
    "unlisted-member": lambda raw, m: _unlisted(m),
    "no-checksum": lambda raw, m: {k: v for k, v in m.items() if k != "manifest.sha256"},
}


@pytest.mark.parametrize("damage", list(BAD_ARCHIVES))
async def test_a_bad_archive_is_refused_and_leaves_nothing_behind(
    kit: Kit, tmp_path: Path, damage: str
) -> None:
    _, _, out = await checkpointed_pod(kit, tmp_path)
    archive = os.path.join(out, "pod.tar")
    raw = Path(archive).read_bytes()
    made = BAD_ARCHIVES[damage](raw, archive_members(archive))
    if isinstance(made, dict):
        write_archive(archive, made)
    else:
        Path(archive).write_bytes(made)
    before = await everything(kit)
    code, detail, _ = await kit.call("RestorePod", restore_request(kit, out))
    assert code in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION), (code, detail)
    assert "checkpoint" in detail, detail
    assert await everything(kit) == before
    # No name was kept: the same pod can be made.
    await kit.ok("RunPodSandbox", pb.RunPodSandboxRequest(config=restore_request(kit, out).config))


async def test_restore_refusals_before_anything_is_made(kit: Kit, tmp_path: Path) -> None:
    _, _, out = await checkpointed_pod(kit, tmp_path)
    before = await everything(kit)
    wrong_image = restore_request(kit, out)
    wrong_image.container_configs[0].image.image = "registry.example/other:1"
    wrong_command = restore_request(kit, out)
    wrong_command.container_configs[0].command[:] = ["/other"]
    no_config = restore_request(kit, out)
    no_config.ClearField("config")
    cases = [
        (restore_request(kit, ""), Code.INVALID_ARGUMENT, "checkpoint_path must not be empty"),
        (restore_request(kit, "ckpt"), Code.INVALID_ARGUMENT, "absolute"),
        (restore_request(kit, out + "/../ckpt"), Code.INVALID_ARGUMENT, "'..'"),
        (restore_request(kit, str(tmp_path / "none")), Code.INVALID_ARGUMENT, "not an existing directory"),
        (restore_request(kit, str(tmp_path)), Code.INVALID_ARGUMENT, "does not exist"),  # no pod.tar
        (restore_request(kit, out, ()), Code.INVALID_ARGUMENT, "container_configs"),
        (restore_request(kit, out, ("app", "app")), Code.INVALID_ARGUMENT, "twice"),
        (restore_request(kit, out, ("app", "more")), Code.INVALID_ARGUMENT, "the checkpoint holds"),
        (restore_request(kit, out, ("other",)), Code.INVALID_ARGUMENT, "the checkpoint holds"),
        (no_config, Code.INVALID_ARGUMENT, "config"),
        (wrong_image, Code.FAILED_PRECONDITION, "image"),
        (wrong_command, Code.FAILED_PRECONDITION, "command"),
    ]
    unknown = restore_request(kit, out)
    unknown.runtime_handler = "nosuch"
    cases.append((unknown, Code.INVALID_ARGUMENT, "runtime_handler"))
    options = restore_request(kit, out)
    options.options["mode"] = "fast"
    cases.append((options, Code.INVALID_ARGUMENT, "'mode'"))
    for request, code, says in cases:
        got, detail, _ = await kit.call("RestorePod", request)
        assert (got, says in detail) == (code, True), (request.checkpoint_path, detail)
        assert await everything(kit) == before


@pytest.mark.parametrize("step", ["restore_container", "create_container", "run_sandbox"])
async def test_a_restore_failing_midway_removes_what_it_made(kit: Kit, tmp_path: Path, step: str) -> None:
    _, _, out = await checkpointed_pod(kit, tmp_path, ("app", "side"))
    before = await everything(kit)
    # restore_container fails with the pod and its first container made.
    kit.inject(((step, "UNAVAILABLE: the runtime is down"),))
    got, detail, _ = await kit.call("RestorePod", restore_request(kit, out, ("app", "side")))
    assert got == Code.UNAVAILABLE, detail
    assert await everything(kit) == before
    await kit.ok("RestorePod", restore_request(kit, out, ("app", "side")))
