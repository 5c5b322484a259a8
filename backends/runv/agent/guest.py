"""The guest agent's state, shared by the handlers of every concern: containers, execs, the host."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Coroutine
from typing import Any

from backends.linux import cgroups, procfs
from backends.runv.agent import proc
from backends.runv.agent.messages import ContainerState, Message
from backends.runv.agent.protocol import AgentError, Ch, Channel, ConnectionLost, Stream

OUTPUT_BUFFER = 1024 * 1024  # output kept while no host is subscribed (shim restart)


class Container:
    def __init__(self, cid: str, bundle: str, tty: bool) -> None:
        self.id = cid
        self.bundle = bundle
        self.tty = tty
        self.pid = 0
        self.status = "created"
        self.exit_code = 0
        self.started_at = 0
        self.finished_at = 0
        self.reason = ""
        self.stdin_w: int | None = None
        self.stdin_once = False
        self.tty_master: int | None = None
        self.subscribers: list[Stream] = []
        self.backlog: list[tuple[int, bytes]] = []
        self.backlog_size = 0
        self.open_outputs = 0
        self.exited = asyncio.Event()
        self.readers: list[proc.PipeReader] = []
        self.shared_pid = False  # in the VM's PID namespace: its processes outlive its init

    def describe(self) -> ContainerState:
        return ContainerState(
            id=self.id,
            status=self.status,
            pid=self.pid,
            exit_code=self.exit_code,
            started_at=self.started_at,
            finished_at=self.finished_at,
            reason=self.reason,
        )

    def output(self, ch: int, data: bytes) -> None:
        if not data:
            self.open_outputs -= 1
            if self.open_outputs <= 0:
                for st in self.subscribers:
                    spawn(st.close(Ch.STDOUT))
                self.subscribers.clear()
            return
        live = [st for st in self.subscribers if not st.channel.closed.is_set()]
        self.subscribers = live
        if not live:
            self.backlog.append((ch, data))
            self.backlog_size += len(data)
            while self.backlog_size > OUTPUT_BUFFER and self.backlog:
                self.backlog_size -= len(self.backlog.pop(0)[1])
            return
        for st in live:
            spawn(st.write(ch, data))


_background: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any]) -> None:
    """Run in the background; a host that went away meanwhile is not an error."""

    async def guarded() -> None:
        with contextlib.suppress(ConnectionLost):
            await coro

    task = asyncio.get_running_loop().create_task(guarded())
    _background.add(task)
    task.add_done_callback(_background.discard)


def _root_is_initramfs() -> bool:
    try:
        return any(m.point == "/" and m.fstype == "rootfs" for m in procfs.mounts())
    except (OSError, ValueError):
        return False


class Guest:
    """What the agent knows of its VM: containers, running execs, the connected host."""

    def __init__(self, state_dir: str, cgroup_parent: str, runc: str = "runc") -> None:
        self.state_dir = state_dir
        self.cgroup_parent = cgroup_parent.rstrip("/")
        self.runc = runc
        self.reaper = proc.Reaper()
        self.containers: dict[str, Container] = {}
        self.execs: dict[int, tuple[int, int | None]] = {}  # stream id -> (pid, tty master)
        # Execs whose runc has not given their PID yet, and those of them killed meanwhile (a
        # caller's timeout can come first when runc takes seconds, on an emulated CPU).
        self.starting_execs: set[int] = set()
        self.killed_execs: set[int] = set()
        self.host: Channel | None = None
        self.etc_dir = os.path.join(state_dir, "etc")
        self.stopping = asyncio.Event()
        self.pod_init = 0  # PID 1 of the pod's shared PID namespace, once a container needs it
        self.cgroups = cgroups.CgroupReader()  # the same reader as the docker backend's
        self.root_is_initramfs = _root_is_initramfs()  # a real VM's guest runs from its initramfs

    def get(self, cid: str) -> Container:
        c = self.containers.get(cid)
        if c is None:
            raise AgentError("not_found", f"container {cid!r} not found")
        return c

    def stream(self, sid: int) -> Stream:
        """The host's stream ``sid`` (frames for it may have arrived already)."""
        if self.host is None:
            raise AgentError("failed", "no host is connected")
        return self.host.stream(sid)

    def runc_argv(self, *args: str) -> list[str]:
        return [self.runc, "--root", os.path.join(self.state_dir, "runc"), *args]

    async def runc_ok(self, *args: str) -> bytes:
        code, out, err = await proc.run(self.reaper, self.runc_argv(*args))
        if code != 0:
            raise AgentError("failed", f"runc {args[0]}: {err.decode(errors='replace').strip()}")
        return out

    async def run(self, argv: list[str]) -> None:
        code, _, err = await proc.run(self.reaper, argv)
        if code != 0:
            raise AgentError("failed", f"{' '.join(argv)}: {err.decode(errors='replace').strip()}")

    async def send_event(self, name: str, body: Message) -> None:
        if self.host is not None:
            with contextlib.suppress(ConnectionLost):
                await self.host.send_event(name, body.to_dict())


def as_exit_code(code: int) -> int:
    """waitstatus code (negative = signal) to the shell convention the CRI reports."""
    return 128 - code if code < 0 else code


async def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        view = view[n:]


def runc_log(path: str) -> str:
    """The error messages of a runc JSON log."""
    msgs: list[str] = []
    with contextlib.suppress(OSError):
        with open(path) as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if entry.get("level") in ("error", "fatal"):
                        msgs.append(str(entry.get("msg", "")))
    return "; ".join(msgs) or "unknown error"
