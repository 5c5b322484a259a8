# ruff: noqa: ASYNC240
# The agent owns its VM: a stat of its own directories is a local, bounded call.
"""Checkpoints of containers by CRIU in the guest (issue 43), through the agent's runc.

- ``checkpoint``: the named running containers are paused together (``runc pause``: their
  cgroups frozen, one consistent cut), then each is dumped by ``runc checkpoint
  --leave-running`` into the guest's own tmpfs and its images copied into ``dir`` (a share of
  the host's). They stay paused when this answers, so that the host can read their writable
  layers from the same cut; ``thaw`` resumes them, and so does a timer of ``hold`` seconds if
  no ``thaw`` comes (a host gone away never leaves a pod frozen). On any failure every one of
  them is resumed before the error is answered.
- ``restore_prepare``: a container just created (``create``: its runc init waiting) is made
  ready to be restored: its init is removed (the restored processes take their own PIDs), the
  checkpoint's changes to its root filesystem are applied to its root (files written, paths
  deleted), CRIU's images copied into the guest, and every bind mount the checkpointed container
  had (recorded beside the images) that the new one lacks bound to an empty placeholder (CRIU
  wants a mount at each); then the processes are restored, paused (``containers.restore_paused``:
  a pod's containers are all restored before any runs, or one's new processes could take PIDs
  another's checkpoint holds), and its ``start`` resumes them instead of starting a new init.

A container with a terminal is refused: CRIU cannot restore a pty the agent holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import tarfile
import time

from backends.runv.agent import containers, proc
from backends.runv.agent.guest import Container, Guest, criu_errors, spawn
from backends.runv.agent.messages import Empty, Message, Request
from backends.runv.agent.protocol import AgentError

CRIU_CONFIG_ANNOTATION = "org.criu.config"  # runc hands CRIU the configuration file it names
MOUNTS = "runv-mounts.json"  # beside CRIU's images: the dumped container's bind mounts
HOLD_MAX = 600.0  # seconds a checkpoint may keep containers paused for the host
CRIU = "/usr/sbin/criu"


@dataclasses.dataclass(frozen=True, slots=True)
class Dumped(Message):
    """What ``checkpoint`` did: seconds paused before the answer, bytes of images per container."""

    seconds: float
    sizes: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointRequest(Request[Dumped]):
    """Pause ``ids`` together, dump each into ``dir``/ID (a directory the host shares)."""

    OP = "checkpoint"
    RESULT = Dumped
    ids: list[str]
    dir: str
    hold: float = 60.0  # seconds they stay paused waiting for ``thaw``


@dataclasses.dataclass(frozen=True, slots=True)
class ThawRequest(Request[Empty]):
    """Resume the containers a ``checkpoint`` left paused."""

    OP = "thaw"
    ids: list[str]
    RESULT = Empty


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared(Message):
    """The mounts of the checkpointed container its restore does not give: empty placeholders."""

    placeholders: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class RestorePrepareRequest(Request[Prepared]):
    """Make the created container ``id`` the restore of the checkpoint in ``images``."""

    OP = "restore_prepare"
    RESULT = Prepared
    id: str
    images: str  # CRIU's images (a directory the host shares)
    diff: str = ""  # a tar of the files of its root the checkpoint had changed ("": none)
    deleted: list[str] = dataclasses.field(default_factory=list)  # paths of its root it had removed


def _usable(c: Container, want: str) -> None:
    if c.tty:
        raise AgentError(
            "invalid", f"container {c.id} has a terminal (tty): CRIU cannot checkpoint or restore it here"
        )
    if c.status != want or (want == "running" and c.exited.is_set()):
        raise AgentError("failed", f"container {c.id} is {c.status}, not {want}")
    if not os.path.exists(CRIU):
        raise AgentError("failed", "this guest image has no CRIU (build it with `scripts/runv-guest --criu`)")


async def _resume(g: Guest, ids: list[str]) -> None:
    for cid in ids:
        handle = g.criu_holds.pop(cid, None)
        if handle is not None:
            handle.cancel()
        c = g.containers.get(cid)
        if c is not None and not c.exited.is_set():
            await proc.run(g.reaper, g.runc_argv("resume", cid))  # "not paused" is fine


def _resume_later(g: Guest, cid: str) -> None:
    """A hold ran out: the host never said ``thaw`` (it went away, or failed)."""
    g.criu_holds.pop(cid, None)
    spawn(_resume(g, [cid]))


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


async def checkpoint(g: Guest, req: CheckpointRequest) -> Dumped:
    if not req.ids:
        raise AgentError("invalid", "ids: no container named")
    if not (0 < req.hold <= HOLD_MAX):
        raise AgentError("invalid", f"hold: {req.hold} is not within (0, {HOLD_MAX:g}] seconds")
    if not os.path.isdir(req.dir):
        raise AgentError("invalid", f"dir: {req.dir} is not a directory")
    cs = [g.get(cid) for cid in req.ids]
    for c in cs:
        _usable(c, "running")
    t = time.monotonic()
    paused: list[str] = []
    sizes: list[int] = []
    try:
        for c in cs:  # every one paused before any is dumped: one cut
            await g.runc_ok("pause", c.id)
            paused.append(c.id)
        for c in cs:
            sizes.append(await _dump(g, c, os.path.join(req.dir, c.id)))
    except BaseException:
        await asyncio.shield(_resume(g, paused))
        raise
    loop = asyncio.get_running_loop()
    for cid in paused:
        g.criu_holds[cid] = loop.call_later(req.hold, _resume_later, g, cid)
    return Dumped(seconds=round(time.monotonic() - t, 3), sizes=sizes)


async def _dump(g: Guest, c: Container, dest: str) -> int:
    """``runc checkpoint`` of the paused ``c`` into the guest's tmpfs, copied to ``dest``."""
    img = os.path.join(g.state_dir, "criu", c.id + ".dump")
    work = img + ".work"
    for d in (img, work):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    try:
        argv = g.runc_argv("checkpoint", "--leave-running", "--image-path", img, "--work-path", work, c.id)
        code, _out, err = await proc.run(g.reaper, argv)
        if code != 0:
            said = err.decode(errors="replace").strip() + criu_errors(work, "dump.log")
            raise AgentError("failed", f"runc checkpoint of {c.id}: {said}")
        _record_mounts(c, img)
        await asyncio.to_thread(shutil.copytree, img, dest, dirs_exist_ok=True)
        return _size(img)
    finally:
        shutil.rmtree(img, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _record_mounts(c: Container, img: str) -> None:
    """The container's bind mounts (CRIU's external mounts: a restore must give each one) into
    the images, each with whether its source is a file (:data:`MOUNTS`)."""
    with open(os.path.join(c.bundle, "config.json")) as fh:
        config = json.load(fh)
    binds = [
        {"destination": m["destination"], "file": os.path.isfile(m.get("source", ""))}
        for m in config.get("mounts", [])
        if m.get("type") == "bind" or "bind" in m.get("options", []) or "rbind" in m.get("options", [])
    ]
    with open(os.path.join(img, MOUNTS), "w") as fh:
        json.dump(binds, fh)


def _placeholders(c: Container, images: str) -> list[str]:
    """The bind mounts the checkpointed container had and its restore does not give (a volume
    its new config lacks): each bound to an empty file or directory of the bundle, as CRIU needs a
    mount there; their destinations. The restore's own mounts are as its config says."""
    try:
        with open(os.path.join(images, MOUNTS)) as fh:
            had = [(str(m["destination"]), bool(m["file"])) for m in json.load(fh)]
    except FileNotFoundError:
        return []
    path = os.path.join(c.bundle, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    given = {os.path.normpath(m["destination"]) for m in config.get("mounts", [])}
    missing = [(d, f) for d, f in had if os.path.normpath(d) not in given]
    for i, (dest, is_file) in enumerate(missing):
        source = os.path.join(c.bundle, "placeholders", str(i))
        os.makedirs(os.path.dirname(source), exist_ok=True)
        if is_file:
            open(source, "a").close()
        else:
            os.makedirs(source, exist_ok=True)
        config["mounts"].append(
            {"destination": dest, "type": "bind", "source": source, "options": ["rbind", "rprivate"]}
        )
    if missing:
        with open(path, "w") as fh:
            json.dump(config, fh)
    return [d for d, _ in missing]


def _leave_stopped(c: Container, conf: str) -> None:
    """CRIU told, through runc's ``org.criu.config`` annotation of the bundle, to leave the
    restored processes stopped: none runs (nor forks, taking a PID another container's
    checkpoint holds) before the container is frozen."""
    with open(conf, "w") as fh:
        fh.write("leave-stopped\n")
    path = os.path.join(c.bundle, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    config.setdefault("annotations", {})[CRIU_CONFIG_ANNOTATION] = conf
    with open(path, "w") as fh:
        json.dump(config, fh)


async def thaw(g: Guest, req: ThawRequest) -> Empty:
    await _resume(g, list(req.ids))
    return Empty()


async def restore_prepare(g: Guest, req: RestorePrepareRequest) -> Prepared:
    c = g.get(req.id)
    _usable(c, "created")
    if c.restored:
        raise AgentError("failed", f"container {c.id} is restored already")
    if not os.path.isfile(os.path.join(req.images, "inventory.img")):
        raise AgentError("invalid", f"images: {req.images} holds no CRIU images (no inventory.img)")
    # The created init goes (its exit is no longer the container's: containers.watch).
    c.pid = 0
    await proc.run(g.reaper, g.runc_argv("delete", "--force", c.id))
    for r in c.readers:
        r.close()
    c.readers.clear()
    c.open_outputs = 0
    if c.stdin_w is not None:
        os.close(c.stdin_w)
        c.stdin_w = None
    rootfs = os.path.join(c.bundle, "rootfs")
    dest = os.path.join(g.state_dir, "criu", c.id + ".restore")
    try:
        await asyncio.to_thread(_apply_changes, rootfs, req.diff, list(req.deleted))
        shutil.rmtree(dest, ignore_errors=True)
        await asyncio.to_thread(shutil.copytree, req.images, dest)
        placeholders = _placeholders(c, dest)
        _leave_stopped(c, dest + ".conf")
    except (OSError, tarfile.TarError, ValueError, KeyError, TypeError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise AgentError("failed", f"container {c.id}: cannot prepare its restore: {exc}") from None
    try:
        await containers.restore_paused(g, c, dest)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest + ".conf")
    c.restored = True
    return Prepared(placeholders=placeholders)


def _inside(root: str, rel: str) -> str:
    """``root``/``rel`` where ``rel`` is a relative path without ``..`` (ValueError otherwise)."""
    norm = os.path.normpath(rel.lstrip("/"))
    if norm in (".", "") or norm.startswith("../") or norm == ".." or os.path.isabs(rel.lstrip("/")):
        raise ValueError(f"path {rel!r} is outside the container's root")
    return os.path.join(root, norm)


def _apply_changes(rootfs: str, diff: str, deleted: list[str]) -> None:
    """The checkpoint's changes on the container's root: ``deleted`` paths removed, then the
    files of the tar ``diff`` written (the root's own overlay makes them its upper layer's)."""
    for rel in deleted:
        path = _inside(rootfs, rel)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if not diff:
        return
    with tarfile.open(diff, "r:") as tar:
        members = []
        for info in tar:
            _inside(rootfs, info.name)
            if info.islnk():
                _inside(rootfs, info.linkname)
            if not (info.isreg() or info.isdir() or info.issym() or info.islnk() or info.isfifo()):
                raise ValueError(f"member {info.name!r}: not a file, directory, link or fifo")
            members.append(info)
        tar.extractall(rootfs, members=members, numeric_owner=True)
