"""The guest agent's state, shared by the handlers of every concern: containers, execs, the host."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import time
from collections.abc import Coroutine, Mapping
from typing import Any

from backends.linux import cgroups, procfs
from backends.runv.agent import proc
from backends.runv.agent.messages import ContainerState, Message
from backends.runv.agent.protocol import MAX_CHUNK, STAMP, AgentError, Ch, Channel, ConnectionLost, Stream

OUTPUT_BUFFER = 1024 * 1024  # the container's latest output, kept for a host that re-subscribes
PIECE = MAX_CHUNK - STAMP.size  # the most output in one piece: a stamped piece fills one frame


class Subscriber:
    """A stream the container's output goes to; ``stamped``: each frame starts with its STAMP."""

    __slots__ = ("stamped", "stream")

    def __init__(self, stream: Stream, stamped: bool = False) -> None:
        self.stream = stream
        self.stamped = stamped

    def send(self, ch: int, data: bytes, at: int) -> None:
        spawn(self.stream.write(ch, STAMP.pack(at) + data if self.stamped else data))


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
        self.subscribers: list[Subscriber] = []
        # The latest output (up to OUTPUT_BUFFER bytes), each piece stamped with a time unique to
        # it: a host that re-subscribes (a shim restarted) says what its log holds and gets the
        # rest, also what was in flight to a host that went away. ``delivered``: the time of the
        # last piece a host was sent (a host that says nothing gets only what came after it).
        self.history: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.history_size = 0
        self.last_at = 0
        self.delivered = 0
        self.open_outputs = 0
        self.exited = asyncio.Event()
        self.readers: list[proc.PipeReader] = []
        self.shared_pid = False  # in the VM's PID namespace: its processes outlive its init
        self.stdin_wanted = False
        self.restored = False  # its checkpoint's processes restored, paused until its start (agent/criu.py)

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
                for sub in self.subscribers:
                    spawn(sub.stream.close(Ch.STDOUT))
                self.subscribers.clear()
            return
        if len(data) > PIECE:
            # One frame a piece, stamp included: a piece split over frames would lose its order
            # against the next one (each frame takes the channel's lock anew).
            for off in range(0, len(data), PIECE):
                self.output(ch, data[off : off + PIECE])
            return
        at = self.last_at = max(time.time_ns(), self.last_at + 1)
        self.history.append((at, ch, data))
        self.history_size += len(data)
        while self.history_size > OUTPUT_BUFFER and len(self.history) > 1:
            self.history_size -= len(self.history.popleft()[2])
        live = [sub for sub in self.subscribers if not sub.stream.channel.closed.is_set()]
        self.subscribers = live
        if live:
            self.delivered = at
        for sub in live:
            sub.send(ch, data, at)

    def replay(self, after: Mapping[int, int] | None) -> list[tuple[int, int, bytes]]:
        """What a host that re-subscribes is missing: with ``after`` (per channel, the time of
        the last piece its log holds, 0 for none), every later piece, and of the piece at that
        time what follows its last newline (a log record ends at a newline; the rest was still
        pending in the host); without it, what no host was sent."""
        if after is None:
            return [piece for piece in self.history if piece[0] > self.delivered]
        out = []
        for at, ch, data in self.history:
            mark = after.get(ch, 0)
            if at > mark:
                out.append((at, ch, data))
            elif at == mark:
                cut = data.rfind(b"\n")
                if 0 <= cut < len(data) - 1:
                    out.append((at, ch, data[cut + 1 :]))
        return out


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
        """``cgroup_parent``: where runc makes the containers' cgroups; ``self``, the cgroup the
        agent is in at the time (a stub VM's, which moves into a pod's cgroup when a pod takes
        it from the warm pool)."""
        self.state_dir = state_dir
        self._cgroup_parent = cgroup_parent.rstrip("/")
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
        # Containers a checkpoint left paused for the host, each with its timer to resume it.
        self.criu_holds: dict[str, asyncio.TimerHandle] = {}
        self.pod_init = 0  # PID 1 of the pod's shared PID namespace, once a container needs it
        self.cgroups = cgroups.CgroupReader()  # the same reader as the docker backend's
        self.root_is_initramfs = _root_is_initramfs()  # a real VM's guest runs from its initramfs

    @property
    def cgroup_parent(self) -> str:
        if self._cgroup_parent == "self":
            return cgroups.own_path()
        return self._cgroup_parent

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


def criu_errors(work: str, name: str) -> str:
    """The last error lines of CRIU's log ``name`` in its work directory, as a suffix of a
    message ("" when it has none)."""
    try:
        with open(os.path.join(work, name), errors="replace") as fh:
            errs = [line.strip() for line in fh if "Error" in line]
    except OSError:
        return ""
    return (" / criu: " + " / ".join(errs[-3:])) if errs else ""
