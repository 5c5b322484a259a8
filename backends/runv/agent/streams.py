# ruff: noqa: ASYNC230
# The agent owns its VM: small local file reads are not worth a thread hop here.
"""Byte streams in the guest: container output and attach, exec (``runc exec``), port-forward."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import termios
from collections.abc import AsyncIterator

from backends.linux import procfs
from backends.runv.agent import proc
from backends.runv.agent.guest import (
    Container,
    Guest,
    Subscriber,
    as_exit_code,
    runc_log,
    spawn,
    write_all,
)
from backends.runv.agent.messages import (
    AttachRequest,
    Empty,
    ExecKillRequest,
    ExecReply,
    ExecRequest,
    OutputRequest,
    PortForwardRequest,
    ResizeRequest,
)
from backends.runv.agent.protocol import STAMP, AgentError, Ch, ConnectionLost, Stream


async def output(g: Guest, req: OutputRequest) -> Empty:
    """Subscribe a stream to the container's output: first what the host is missing (see
    ``Container.replay``), then as it comes; frames stamped when the host asks."""
    c = g.get(req.id)
    st = g.stream(req.stream)
    after = {int(Ch.STDOUT): req.after_stdout, int(Ch.STDERR): req.after_stderr} if req.resume else None
    sub = Subscriber(st, req.stamped)
    for at, ch, data in c.replay(after):
        await st.write(ch, STAMP.pack(at) + data if req.stamped else data)
        c.delivered = max(c.delivered, at)
    if c.open_outputs <= 0 and c.readers:
        await st.close(Ch.STDOUT)
    else:
        c.subscribers.append(sub)
    return Empty()


async def attach(g: Guest, req: AttachRequest) -> Empty:
    """Output as ``output`` (from now on); what arrives on STDIN goes to the container's stdin."""
    c = g.get(req.id)
    st = g.stream(req.stream)
    c.subscribers.append(Subscriber(st))
    target = c.tty_master if c.tty else c.stdin_w
    if target is not None and req.stdin:
        spawn(_pump_stdin(c, st, target))
    return Empty()


async def _stdin(st: Stream) -> AsyncIterator[bytes]:
    """What the host sends on the stream's STDIN channel, until it closes that channel."""
    while True:
        ch, data = await st.read()
        if ch != Ch.STDIN:
            continue
        if not data:
            return
        yield data


async def _pump_stdin(c: Container, st: Stream, fd: int) -> None:
    async for data in _stdin(st):
        with contextlib.suppress(OSError):
            await write_all(fd, data)
    if c.stdin_once and not c.tty and c.stdin_w is not None:
        os.close(c.stdin_w)
        c.stdin_w = None


async def exec_(g: Guest, req: ExecRequest) -> ExecReply:
    c = g.get(req.id)
    if c.exited.is_set() or c.status != "running":
        raise AgentError("failed", f"container {c.id} is not running")
    st = g.stream(req.stream)
    tty = req.tty
    pid_file = os.path.join(c.bundle, f"exec-{st.id}.pid")
    # Detached: runc passes our fds straight through (a foreground exec would copy them
    # through its own pipes, hiding the TTY) and the process is reparented to us.
    log = os.path.join(c.bundle, f"exec-{st.id}.log")
    argv = g.runc_argv("--log", log, "--log-format", "json", "exec", "--detach", "--pid-file", pid_file)
    for env in req.env:
        argv += ["--env", env]
    argv += [c.id, *req.args]
    readers: list[proc.PipeReader] = []
    master: int | None = None
    if tty:
        master, slave = os.openpty()
        fds = [slave, slave, slave]
        stdin_target = master
        readers.append(proc.PipeReader(os.dup(master), lambda d: spawn(_forward(st, Ch.STDOUT, d))))
    else:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fds = [in_r, out_w, err_w]
        stdin_target = in_w
        readers.append(proc.PipeReader(out_r, lambda d: spawn(_forward(st, Ch.STDOUT, d))))
        readers.append(proc.PipeReader(err_r, lambda d: spawn(_forward(st, Ch.STDERR, d))))
    g.starting_execs.add(st.id)
    try:
        pid = proc.spawn(argv, fds[0], fds[1], fds[2], setsid=tty)
    except BaseException:
        g.starting_execs.discard(st.id)
        raise
    finally:
        for fd in set(fds):
            os.close(fd)
    try:
        if await g.reaper.wait(pid) != 0:
            raise AgentError("failed", f"runc exec: {runc_log(log)}")
        with open(pid_file) as fh:
            pid = int(fh.read().strip())
    except BaseException:
        for r in readers:
            r.close()
        if master is not None:
            os.close(master)
        if not tty:
            os.close(stdin_target)
        raise
    finally:
        g.starting_execs.discard(st.id)
        for path in (pid_file, log):
            with contextlib.suppress(OSError):
                os.unlink(path)
    g.execs[st.id] = (pid, master)
    if st.id in g.killed_execs:  # its caller gave up while runc was starting it
        g.killed_execs.discard(st.id)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not req.stdin:
        if not tty:
            os.close(stdin_target)
        pump = None
    else:
        pump = asyncio.get_running_loop().create_task(_exec_stdin(st, stdin_target, tty))
    try:
        code = await g.reaper.wait(pid)
        if tty:
            # The slave closes with the process; drain what the master still holds.
            await asyncio.wait([readers[0].done], timeout=1.0)
            readers[0].close()
        else:
            await asyncio.gather(*(r.done for r in readers))
    finally:
        g.execs.pop(st.id, None)
        if pump is not None:
            pump.cancel()
        if master is not None:
            os.close(master)
    with contextlib.suppress(ConnectionLost):
        await st.close(Ch.STDOUT)
    return ExecReply(exit_code=as_exit_code(code))


async def _exec_stdin(st: Stream, fd: int, tty: bool) -> None:
    try:
        async for data in _stdin(st):
            await write_all(fd, data)
    except OSError:
        pass
    finally:
        if not tty:
            with contextlib.suppress(OSError):
                os.close(fd)


async def _forward(st: Stream, ch: int, data: bytes) -> None:
    if data:
        await st.write(ch, data)


async def exec_kill(g: Guest, req: ExecKillRequest) -> Empty:
    if req.stream in g.starting_execs and req.stream not in g.execs:
        # Not started yet: exec_ kills it once runc says its PID; answer after that.
        g.killed_execs.add(req.stream)
        for _ in range(1000):
            if req.stream not in g.starting_execs:
                break
            await asyncio.sleep(0.01)
        g.killed_execs.discard(req.stream)
    entry = g.execs.get(req.stream)
    if entry is None:
        return Empty()
    with contextlib.suppress(ProcessLookupError):
        os.kill(entry[0], signal.SIGKILL)
    # Answer once it is dead: a client checking right after the timeout must not see it.
    for _ in range(1000):  # up to 10 s: seconds on an emulated CPU, milliseconds elsewhere
        if not _running(entry[0]):
            break
        await asyncio.sleep(0.01)
    return Empty()


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (dead, not yet reaped)."""
    st = procfs.stat(pid)
    return st is not None and st.state != "Z"


async def resize(g: Guest, req: ResizeRequest) -> Empty:
    master: int | None = None
    entry = g.execs.get(req.stream)
    if entry is not None:
        master = entry[1]
    elif req.id:
        master = g.get(req.id).tty_master
    if master is not None:
        size = struct.pack("HHHH", req.height, req.width, 0, 0)
        fcntl.ioctl(master, termios.TIOCSWINSZ, size)
    return Empty()


async def port_forward(g: Guest, req: PortForwardRequest) -> Empty:
    st = g.stream(req.stream)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", req.port)
    except OSError as exc:
        raise AgentError("failed", f"connect to port {req.port}: {exc.strerror}") from None

    async def upstream() -> None:
        try:
            async for data in _stdin(st):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            writer.close()

    async def downstream() -> None:
        try:
            while data := await reader.read(65536):
                await st.write(Ch.STDOUT, data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(ConnectionLost):
                await st.close(Ch.STDOUT)

    async def both() -> None:
        await asyncio.gather(upstream(), downstream(), return_exceptions=True)
        writer.close()

    spawn(both())
    return Empty()
