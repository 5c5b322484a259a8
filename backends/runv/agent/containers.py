# ruff: noqa: ASYNC230, ASYNC240
# The agent owns its VM: small local file writes are not worth a thread hop here.
"""Container lifecycle in the guest: the OCI bundle, ``runc create/start/kill/delete/update``."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from typing import Any

from backends.linux import cgroups, procfs
from backends.runv.agent import oci, proc
from backends.runv.agent.guest import Container, Guest, as_exit_code, criu_errors, runc_log, spawn
from backends.runv.agent.messages import (
    EXIT_EVENT,
    ContainerList,
    ContainerSpec,
    ContainerState,
    Created,
    CreateRequest,
    Empty,
    ListRequest,
    RemoveRequest,
    SignalRequest,
    StartRequest,
    StateRequest,
    UpdateRequest,
    WaitRequest,
)
from backends.runv.agent.protocol import AgentError, Ch

MNT_DETACH = 2
MS_BIND = 4096
MS_REC = 16384
MS_RDONLY = 1

# PID 1 of a pod's shared PID namespace: reaps whatever is orphaned in it, like pause.
# The pod's PID 1, as ``unshare --pid [--user] --fork --kill-child`` would start it (the real
# VM's guest has busybox's unshare, which has no --kill-child): the holder makes the
# namespaces and forks the reaper into them, which dies with the holder.
POD_INIT = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
flags = 0x20000000 | (0x10000000 if sys.argv[1:] == ["user"] else 0)  # CLONE_NEWPID, CLONE_NEWUSER
if libc.unshare(flags) != 0:
    sys.exit("unshare: " + os.strerror(ctypes.get_errno()))
pid = os.fork()
if pid:
    while True:
        try:
            os.waitpid(pid, 0)
            sys.exit(0)
        except InterruptedError:
            pass
libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the holder
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    signal.sigtimedwait({signal.SIGCHLD}, 60)
"""


def _mount(source: str, target: str, fstype: str, options: str, flags: int = 0) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def _umount(target: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(target.encode(), MNT_DETACH)


def _exit_reason(code: int) -> str:
    return "Completed" if code == 0 else "Error"


async def _pod_pid_ns(g: Guest, spec: ContainerSpec) -> str:
    """The pod's shared PID namespace (as a pause container gives): PID 1 is a reaper.

    Separate from the VM's own, so the pod's containers do not see the agent and runc.
    A pod with a user namespace gets it here too, made with the PID namespace (which it
    must own, or the containers could not mount their /proc) and mapped by the agent.
    """
    if g.pod_init and os.path.exists(f"/proc/{g.pod_init}/ns/pid"):
        return f"/proc/{g.pod_init}/ns/pid"
    userns = bool(spec.uid_mappings)
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        holder = proc.spawn(
            [sys.executable, "-S", "-c", POD_INIT, *(["user"] if userns else [])], devnull, devnull, devnull
        )
    finally:
        os.close(devnull)
    g.reaper.wait(holder)  # reaped whenever it ends (with the VM)
    # Seconds on an emulated CPU (Python starting), milliseconds elsewhere.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = procfs.children(holder)
        if kids:
            if userns:
                _write_id_maps(holder, spec)
            g.pod_init = kids[0]
            return f"/proc/{g.pod_init}/ns/pid"
        if not os.path.exists(f"/proc/{holder}"):
            break
        await asyncio.sleep(0.01)
    raise AgentError("failed", "the pod PID namespace did not come up")


def _target_pid_ns(g: Guest, target_id: str) -> str:
    """The PID namespace of another container of the pod, still running: what `kubectl debug
    --target` asks for an ephemeral container (the CRI's NamespaceMode TARGET)."""
    target = g.containers.get(target_id)
    if target is None or not target.pid or target.exited.is_set():
        raise AgentError("invalid", f"target container {target_id!r} of the PID namespace is not running")
    path = f"/proc/{target.pid}/ns/pid"
    if not os.path.exists(path):
        raise AgentError("invalid", f"target container {target_id!r} of the PID namespace is not running")
    return path


def _write_id_maps(pid: int, spec: ContainerSpec) -> None:
    """Map the user namespace of ``pid`` (written once, from the VM's root namespace)."""
    for name, maps in (("uid_map", spec.uid_mappings), ("gid_map", spec.gid_mappings)):
        text = "".join(f"{m.container_id} {m.host_id} {m.size}\n" for m in maps)
        try:
            with open(f"/proc/{pid}/{name}", "w") as fh:
                fh.write(text)
        except OSError as exc:
            raise AgentError("invalid", f"user namespace {name} {text.strip()!r}: {exc.strerror}") from None


async def create(g: Guest, req: CreateRequest) -> Created:
    cid = req.id
    if cid in g.containers:
        raise AgentError("exists", f"container {cid} exists")
    spec = req.spec
    bundle = os.path.join(g.state_dir, "containers", cid)
    rootfs = os.path.join(bundle, "rootfs")
    os.makedirs(rootfs, exist_ok=True)
    container = Container(cid, bundle, spec.tty)
    container.shared_pid = spec.pid_mode != "container"
    try:
        src = spec.rootfs
        if src.lowers:
            opts = f"lowerdir={':'.join(src.lowers)},upperdir={src.upper},workdir={src.work}"
            _mount("overlay", rootfs, "overlay", opts)
        else:
            _mount(src.path, rootfs, "", "", MS_BIND | MS_REC)
    except OSError as exc:
        shutil.rmtree(bundle, ignore_errors=True)
        raise AgentError("failed", str(exc)) from None
    try:
        spec = _mount_image_volumes(bundle, spec)
        etc = {
            f"/etc/{n}": os.path.join(g.etc_dir, n)
            for n in ("hosts", "hostname", "resolv.conf")
            if os.path.exists(os.path.join(g.etc_dir, n))
        }
        # A user namespace is the pod's: made with the pod's PID namespace, joined by path.
        pid_ns = await _pod_pid_ns(g, spec) if spec.pid_mode == "pod" or spec.uid_mappings else ""
        user_ns = f"/proc/{g.pod_init}/ns/user" if spec.uid_mappings else ""
        if spec.pid_mode != "pod":
            pid_ns = _target_pid_ns(g, spec.pid_target) if spec.pid_mode == "target" else ""
        config = oci.build_config(
            spec, rootfs, etc, f"{g.cgroup_parent}/{cid}", pid_ns_path=pid_ns, user_ns_path=user_ns
        )
        if spec.uid_mappings:
            _premake_mount_points(rootfs, config["mounts"])
        with open(os.path.join(bundle, "config.json"), "w") as fh:
            json.dump(config, fh)
        await _runc_create(g, container, spec)
        try:
            await _recursive_readonly(g, container, spec)
        except BaseException:
            await proc.run(g.reaper, g.runc_argv("delete", "--force", cid))
            for r in container.readers:
                r.close()
            raise
    except Exception as exc:
        _umount_image_volumes(bundle)
        _umount(rootfs)
        shutil.rmtree(bundle, ignore_errors=True)
        if isinstance(exc, AgentError):
            raise
        raise AgentError("failed", str(exc)) from None
    g.containers[cid] = container
    uid, gid, groups = oci.identity(spec, rootfs)
    return Created(pid=container.pid, uid=uid, gid=gid, groups=groups)


def _premake_mount_points(rootfs: str, mounts: list[dict[str, Any]]) -> None:
    """Make every mount point while still root of the VM: in a user namespace the container's root
    cannot create them in a rootfs the VM's root owns (runc would fail on /proc)."""
    for mnt in mounts:
        dest = os.path.normpath(os.path.join(rootfs, str(mnt["destination"]).lstrip("/")))
        if not dest.startswith(rootfs + "/") or os.path.lexists(dest):
            continue
        src = str(mnt.get("source", ""))
        is_file = mnt.get("type") == "bind" and os.path.isfile(src)
        with contextlib.suppress(OSError):
            if is_file:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
            else:
                os.makedirs(dest, exist_ok=True)


def _mount_image_volumes(bundle: str, spec: ContainerSpec) -> ContainerSpec:
    """Stack each image volume's layers read-only under the bundle; the spec with their sources set."""
    if not any(m.image_lowers for m in spec.mounts):
        return spec
    mounts = []
    for i, mnt in enumerate(spec.mounts):
        if not mnt.image_lowers:
            mounts.append(mnt)
            continue
        root = os.path.join(bundle, f"imgvol-{i}")
        os.makedirs(root, exist_ok=True)
        if len(mnt.image_lowers) == 1:  # overlayfs wants two lower layers when it has no upper
            _mount(mnt.image_lowers[0], root, "", "", MS_BIND | MS_REC)
        else:
            _mount("overlay", root, "overlay", f"lowerdir={':'.join(mnt.image_lowers)}", MS_RDONLY)
        source = os.path.join(root, mnt.image_sub_path) if mnt.image_sub_path else root
        real = os.path.realpath(source)
        if not (real == root or real.startswith(root + "/")) or not os.path.exists(real):
            raise AgentError(
                "invalid",
                f"image_sub_path {mnt.image_sub_path!r} does not exist in the image of {mnt.destination}",
            )
        mounts.append(dataclasses.replace(mnt, source=real, readonly=True))
    return dataclasses.replace(spec, mounts=mounts)


def _umount_image_volumes(bundle: str) -> None:
    with contextlib.suppress(OSError):
        for name in os.listdir(bundle):
            if name.startswith("imgvol-"):
                _umount(os.path.join(bundle, name))


def stdio(c: Container, stdin_wanted: bool) -> tuple[int, int, int, list[int]]:
    """The stdin, stdout and stderr of the container's init (a pty, or pipes the agent reads
    into the container's output), and the fds to close once it has them."""
    to_close: list[int] = []
    if c.tty:
        master, slave = os.openpty()
        stdin = stdout = stderr = slave
        to_close.append(slave)
        c.tty_master = master
        c.open_outputs = 1
        c.readers.append(proc.PipeReader(os.dup(master), lambda d: c.output(Ch.STDOUT, d)))
    else:
        out_r, stdout = os.pipe()
        err_r, stderr = os.pipe()
        to_close += [stdout, stderr]
        c.open_outputs = 2
        c.readers.append(proc.PipeReader(out_r, lambda d: c.output(Ch.STDOUT, d)))
        c.readers.append(proc.PipeReader(err_r, lambda d: c.output(Ch.STDERR, d)))
        if stdin_wanted:
            stdin, c.stdin_w = os.pipe()
            to_close.append(stdin)
        else:
            stdin = os.open(os.devnull, os.O_RDONLY)
            to_close.append(stdin)
    return stdin, stdout, stderr, to_close


async def _run_with(
    g: Guest, argv: list[str], stdin: int, stdout: int, stderr: int, to_close: list[int]
) -> int:
    """``argv`` run on that stdio (``to_close`` closed here once it has them): its exit code."""
    try:
        pid = proc.spawn(argv, stdin, stdout, stderr)
    finally:
        for fd in to_close:
            os.close(fd)
    return await g.reaper.wait(pid)


async def _runc_create(g: Guest, c: Container, spec: ContainerSpec) -> None:
    c.stdin_once = spec.stdin_once
    c.stdin_wanted = spec.stdin
    stdin, stdout, stderr, to_close = stdio(c, spec.stdin)
    log = os.path.join(c.bundle, "runc.log")
    pid_file = os.path.join(c.bundle, "pid")
    argv = g.runc_argv("--log", log, "--log-format", "json", "create", "--bundle", c.bundle)
    if g.root_is_initramfs:
        argv.append("--no-pivot")  # pivot_root cannot leave the initramfs: chroot after a move
    argv += ["--pid-file", pid_file, c.id]
    code = await _run_with(g, argv, stdin, stdout, stderr, to_close)
    if code != 0:
        for r in c.readers:
            r.close()
        raise AgentError("failed", f"runc create: {runc_log(log)}")
    with open(pid_file) as fh:
        watch(g, c, int(fh.read().strip()))


async def restore_paused(g: Guest, c: Container, images: str) -> None:
    """The processes of the checkpoint in ``images`` (CRIU's, from ``restore_prepare`` of
    agent/criu.py) restored by runc in the container's bundle, on new stdio (runc hands them in
    place of the dumped pipes), and left paused (their cgroup frozen) until its ``start``: a
    pod's containers are all restored before any runs, so that none takes a PID another's
    checkpoint holds (a pod's containers share a PID namespace)."""
    stdin, stdout, stderr, to_close = stdio(c, c.stdin_wanted)
    log = os.path.join(c.bundle, "runc-restore.log")
    work = images + ".work"
    pid_file = os.path.join(c.bundle, "pid")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pid_file)
    argv = g.runc_argv("--log", log, "--log-format", "json", "restore", "--detach", "--bundle", c.bundle)
    argv += ["--image-path", images, "--work-path", work, "--pid-file", pid_file]
    if g.root_is_initramfs:
        argv.append("--no-pivot")
    argv.append(c.id)
    code = await _run_with(g, argv, stdin, stdout, stderr, to_close)
    try:
        if code != 0:
            raise AgentError("failed", f"runc restore: {runc_log(log)}{criu_errors(work, 'restore.log')}")
        with open(pid_file) as fh:
            watch(g, c, int(fh.read().strip()))
        # CRIU left every process stopped (SIGSTOP's state: ``leave-stopped``, the config file
        # ``restore_prepare`` names), in the dumped container's cgroup (of its old ID): moved into
        # this one's and frozen there, then continued, they run once it is thawed.
        _adopt(g, c)
        await g.runc_ok("pause", c.id)
        # Not `runc kill --all`: it thaws the cgroup it signals.
        for pid in set(cgroups.Cgroup(f"{g.cgroup_parent}/{c.id}").pids()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    except BaseException:
        for r in c.readers:
            r.close()
        c.readers.clear()
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _adopt(g: Guest, c: Container) -> None:
    """The restored processes of ``c`` (its init's cgroup and all below it) moved into the
    cgroup runc made for ``c``; the emptied cgroups removed. The guest's hierarchy is cgroup2."""
    own = cgroups.Cgroup(f"{g.cgroup_parent}/{c.id}")
    with open(f"/proc/{c.pid}/cgroup") as fh:
        found = [line[3:] for line in fh.read().splitlines() if line.startswith("0::")]
    if not found or found[0].strip("/") == own.rel:
        return
    old = cgroups.Cgroup(found[0])
    (target,) = own.dirs()
    for pid in old.pids():
        with contextlib.suppress(ProcessLookupError), open(os.path.join(target, "cgroup.procs"), "w") as fh:
            fh.write(str(pid))
    for d in sorted((d for top in old.dirs() for d, _, _ in os.walk(top)), key=len, reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(d)


def watch(g: Guest, c: Container, pid: int) -> None:
    """``pid`` is the container's init from now on: its exit is the container's."""
    c.pid = pid
    g.reaper.wait(pid).add_done_callback(lambda f: _exited(g, c, f.result(), pid))


async def _recursive_readonly(g: Guest, c: Container, spec: ContainerSpec) -> None:
    """The mounts asked read-only with all below them: set so while the created init waits (rro.py)."""
    dests = [m.destination for m in spec.mounts if m.recursive_readonly]
    if not dests:
        return
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rro.py")
    code, _out, err = await proc.run(g.reaper, [sys.executable, "-S", "-I", helper, str(c.pid), *dests])
    if code != 0:
        raise AgentError("failed", f"recursive read-only mounts: {err.decode(errors='replace').strip()}")


def _exited(g: Guest, c: Container, code: int, pid: int) -> None:
    if pid != c.pid:
        return  # an init the container no longer has (a created one a restore replaced)
    c.status = "exited"
    c.exit_code = as_exit_code(code)
    c.finished_at = time.time_ns()
    if not c.reason and c.exit_code != 0 and cgroups.Cgroup(f"{g.cgroup_parent}/{c.id}").oom_kills():
        c.reason = "OOMKilled"
    c.reason = c.reason or _exit_reason(c.exit_code)
    c.exited.set()
    if c.stdin_w is not None:
        with contextlib.suppress(OSError):
            os.close(c.stdin_w)
        c.stdin_w = None
    if c.shared_pid:
        # Without a PID namespace of its own, the container's other processes survive its
        # init (and hold its output open): end them, as a container runtime shim does.
        spawn(_kill_rest(g, c))
    spawn(g.send_event(EXIT_EVENT, c.describe()))


async def _kill_rest(g: Guest, c: Container) -> None:
    with contextlib.suppress(AgentError):
        await g.runc_ok("kill", "--all", c.id, "KILL")


async def start(g: Guest, req: StartRequest) -> ContainerState:
    c = g.get(req.id)
    if c.status != "created":
        raise AgentError("failed", f"container {c.id} is {c.status}")
    if c.restored:
        await g.runc_ok("resume", c.id)  # its checkpoint's processes, restored paused
        c.restored = False
    else:
        await g.runc_ok("start", c.id)
    c.status = "running" if not c.exited.is_set() else c.status
    c.started_at = time.time_ns()
    return c.describe()


async def signal_(g: Guest, req: SignalRequest) -> Empty:
    c = g.get(req.id)
    if c.pid and not c.exited.is_set():
        with contextlib.suppress(ProcessLookupError):
            os.kill(c.pid, req.signal)
    return Empty()


async def wait(g: Guest, req: WaitRequest) -> ContainerState:
    c = g.get(req.id)
    await c.exited.wait()
    return c.describe()


async def state(g: Guest, req: StateRequest) -> ContainerState:
    return g.get(req.id).describe()


async def list_(g: Guest, req: ListRequest) -> ContainerList:
    return ContainerList(containers=[c.describe() for c in g.containers.values()])


async def remove(g: Guest, req: RemoveRequest) -> Empty:
    c = g.containers.get(req.id)
    if c is None:
        return Empty()
    if not c.exited.is_set() and c.status == "running":
        raise AgentError("failed", f"container {c.id} is running")
    if c.restored:  # restored paused, never started: killed, then thawed so that they die
        await proc.run(g.reaper, g.runc_argv("kill", "--all", c.id, "KILL"))
        await proc.run(g.reaper, g.runc_argv("resume", c.id))
    await proc.run(g.reaper, g.runc_argv("delete", "--force", c.id))
    for r in c.readers:
        r.close()
    if c.tty_master is not None:
        os.close(c.tty_master)
    _umount_image_volumes(c.bundle)
    _umount(os.path.join(c.bundle, "rootfs"))
    shutil.rmtree(c.bundle, ignore_errors=True)
    del g.containers[c.id]
    return Empty()


async def update(g: Guest, req: UpdateRequest) -> Empty:
    c = g.get(req.id)
    res = req.resources
    flags: list[str] = []
    if res.memory:
        flags += ["--memory", str(res.memory)]
    if res.cpu_quota:
        flags += ["--cpu-quota", str(res.cpu_quota), "--cpu-period", str(res.cpu_period or 100000)]
    if res.cpu_shares:
        flags += ["--cpu-share", str(res.cpu_shares)]
    if flags and not c.exited.is_set():
        await g.runc_ok("update", *flags, c.id)
    return Empty()


def kill_all(g: Guest) -> None:
    """SIGKILL every running container's init (the VM powers off next)."""
    for c in list(g.containers.values()):
        if c.status == "running":
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.pid, signal.SIGKILL)
