"""The stub's VM template: one process that has paid the agent's start, from which VMs are cloned.

Most of a cold stub boot was a fresh interpreter starting and importing the agent
(about 200 ms of a 220 ms RunPodSandbox). This process does that once
(``python -m backends.runv.drivers.template_server``, started by
``drivers/template.py``) and then, for each request, forks a child that becomes
the VM exactly as ``unshare --pid --fork --mount --uts --ipc [--net]
--propagation slave --mount-proc --kill-child`` made it, and runs the agent's
``main`` in the grandchild with no exec and no new interpreter (Kata Containers
calls this VM templating).

Requests and answers are JSON lines on stdin and stdout: a pipe rather than a
listening socket, so there is no socket for a clone to inherit or for a crash to
leave behind, and the shim's going away (the pipe's end) ends the template.

Nothing that one VM could share with another is made before the fork: the
template runs no asyncio loop and no thread and opens no socket; each agent
creates its loop in ``main``, and the random module is reseeded in the clone.

The template is the VM process's parent, so it reaps VM processes as they exit
(SIGCHLD): none is left a zombie beside a template that outlives it. A VM does
not depend on the template: it is in a session of its own, and if the template
dies, the kernel hands its VM processes to init, as it does the unshare path's
when the shim dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import select
import signal
import sys
import traceback
from typing import Any, NoReturn

# Paid once here rather than in every VM: the point of the template.
from backends.runv.agent import proc, server

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_SLAVE = 0x80000
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
CGROUP_JOIN_FAILED = 97  # what the unshare path's shell script exits with

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.unshare.argtypes = [ctypes.c_int]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    src = source.encode() if source else None
    kind = fstype.encode() if fstype else None
    _check(_libc.mount(src, target.encode(), kind, flags, None), f"mount {target}")


def _set_name(name: bytes, argv: list[str]) -> None:
    """What ps shows of a clone, which otherwise looks like the template: its name (comm) and
    ``argv`` in place of its command line, cut to the room the template's command line had
    (changing that room needs CAP_SYS_RESOURCE, which a node's root may lack)."""
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
    except (OSError, IndexError, ValueError):
        return
    room = end - start
    if room > 1:
        text = b"\0".join(a.encode() for a in argv)[: room - 1]
        ctypes.memmove(start, text.ljust(room, b"\0"), room)


def vm_flags(own_net: bool) -> int:
    return CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | (CLONE_NEWNET if own_net else 0)


# ---------------------------------------------------------------- in the clones


def _vm(req: dict[str, Any]) -> NoReturn:
    """The VM process (``vm.pid``): what ``unshare --fork --kill-child`` is, in a fork of the template."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    out = os.open(req["console"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    os.dup2(out, 1)
    os.dup2(out, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    # The template's pipes to the shim and anything else it holds stay with the template.
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            with contextlib.suppress(OSError):
                os.close(int(name))
    try:
        for path in req["procs"]:  # every hierarchy, before anything of the VM runs
            with open(path, "w") as fh:
                fh.write(str(os.getpid()))
    except OSError as exc:
        print(f"runv-template: cannot join the VM's cgroup: {exc}", file=sys.stderr, flush=True)
        os._exit(CGROUP_JOIN_FAILED)
    try:
        unshare(vm_flags(bool(req["net"])))
        # A slave of the host's mounts: what the host mounts under a shared directory
        # later shows in the VM, and nothing the VM mounts leaks out.
        mount(None, "/", None, MS_REC | MS_SLAVE)
    except OSError as exc:
        print(f"runv-template: {exc.strerror}", file=sys.stderr, flush=True)
        os._exit(1)
    # As unshare does while it waits: only SIGKILL ends the VM process.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The agent watches this pipe's end to learn that the VM process died before it
    # could ask to die with it.
    alive_r, alive_w = os.pipe()
    agent = os.fork()
    if agent == 0:
        os.close(alive_w)
        _agent(req["argv"], alive_r)
    os.close(alive_r)
    _set_name(b"runv-vm", ["runv-vm", req["console"]])
    _, status = os.waitpid(agent, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # die of the agent's signal, as unshare does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _agent(argv: list[str], alive_r: int) -> NoReturn:
    """PID 1 of the VM's PID namespace: fresh /proc, then the agent's main, in this interpreter."""
    code = 1
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(1)  # the VM process is gone already: so is the VM
        os.close(alive_r)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        mount("none", "/proc", None, MS_PRIVATE | MS_REC)
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV)
        random.seed()  # no two VMs draw the same numbers
        _set_name(b"runv-agent", ["python", "-m", "backends.runv.agent", *argv])
        sys.argv = ["runv-agent", *argv]
        code = server.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------- the template


def probe() -> str:
    """Whether this process may make a VM's namespaces: "" if so, else why not."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            unshare(vm_flags(True))
            mount(None, "/", None, MS_REC | MS_SLAVE)
        except OSError as exc:
            os.write(w, str(exc).encode())
            os._exit(1)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        why = fh.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return why or f"the probe exited with status {status}"
    return ""


def _reap(_signum: int, _frame: object) -> None:
    """Collect VM processes that have exited (the template is their parent)."""
    for _ in proc.reaped():
        pass


def clone(req: dict[str, Any]) -> dict[str, Any]:
    """Fork a VM: its process's PID. Its own failures (cgroup, namespaces, the agent) go to its console."""
    if not isinstance(req.get("procs"), list) or not isinstance(req.get("argv"), list):
        return {"error": "bad request"}
    pid = os.fork()
    if pid == 0:
        try:
            _vm(req)
        finally:
            os._exit(127)
    return {"pid": pid}


def _answer(obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode() + b"\n"
    while data:
        data = data[os.write(1, data) :]


def serve() -> int:
    """Answer requests until stdin ends (the shim is gone); VMs outlive the template."""
    why = probe()
    _answer({"error": why} if why else {"ready": os.getpid()})
    if why:
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shim ends the template, by closing its input
    signal.signal(signal.SIGCHLD, _reap)
    buf = b""
    while True:
        data = os.read(0, 65536)
        if not data:
            return 0
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
            except ValueError:
                _answer({"error": "bad request"})
                continue
            _answer(clone(req) if isinstance(req, dict) else {"error": "bad request"})


if __name__ == "__main__":
    sys.exit(serve())
