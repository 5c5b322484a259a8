# ruff: noqa: ASYNC230, ASYNC240
# The agent owns its VM: small local file writes are not worth a thread hop here.
"""The guest agent: serves the agent protocol inside a VM and runs containers with runc."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import sys
import termios
import time
from typing import Any

from backends.linux import cgroups
from backends.runv.agent import oci, proc
from backends.runv.agent.protocol import AgentError, Ch, Channel, ConnectionLost, Stream

OUTPUT_BUFFER = 1024 * 1024  # output kept while no host is subscribed (shim restart)
MNT_DETACH = 2
MS_BIND = 4096
MS_REC = 16384


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


# PID 1 of a pod's shared PID namespace: reaps whatever is orphaned in it, like pause.
POD_INIT = """
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    signal.sigtimedwait({signal.SIGCHLD}, 60)
"""


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return []


def _oom_killed(cgroup: str) -> bool:
    """Whether the kernel OOM-killed a process of the container's memory cgroup (v1 or v2)."""
    rel = cgroup.strip("/")
    for path in (f"/sys/fs/cgroup/memory/{rel}/memory.oom_control", f"/sys/fs/cgroup/{rel}/memory.events"):
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        except (OSError, ValueError):
            continue
    return False


def _as_exit_code(code: int) -> int:
    """waitstatus code (negative = signal) to the shell convention the CRI reports."""
    return 128 - code if code < 0 else code


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

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "reason": self.reason,
        }

    def output(self, ch: int, data: bytes) -> None:
        if not data:
            self.open_outputs -= 1
            if self.open_outputs <= 0:
                for st in self.subscribers:
                    _spawn(st.close(Ch.STDOUT))
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
            _spawn(st.write(ch, data))


_background: set[asyncio.Task[Any]] = set()


def _spawn(coro: Any) -> None:
    async def guarded() -> None:
        with contextlib.suppress(ConnectionLost):
            await coro

    task = asyncio.get_running_loop().create_task(guarded())
    _background.add(task)
    task.add_done_callback(_background.discard)


class Agent:
    def __init__(self, state_dir: str, cgroup_parent: str, runc: str = "runc") -> None:
        self.state_dir = state_dir
        self.cgroup_parent = cgroup_parent.rstrip("/")
        self.runc = runc
        self.reaper = proc.Reaper()
        self.containers: dict[str, Container] = {}
        self.execs: dict[int, tuple[int, int | None]] = {}  # stream id -> (pid, tty master)
        self.host: Channel | None = None
        self.etc_dir = os.path.join(state_dir, "etc")
        self.stopping = asyncio.Event()
        self.pod_init = 0  # PID 1 of the pod's shared PID namespace, once a container needs it
        self.cgroups = cgroups.CgroupReader()  # the same reader as the docker backend's

    # ---- helpers
    async def _pod_pid_ns(self) -> str:
        """The pod's shared PID namespace (as a pause container gives): PID 1 is a reaper.

        Separate from the VM's own, so the pod's containers do not see the agent and runc.
        """
        if self.pod_init and os.path.exists(f"/proc/{self.pod_init}/ns/pid"):
            return f"/proc/{self.pod_init}/ns/pid"
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            holder = proc.spawn(
                ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", POD_INIT],
                devnull,
                devnull,
                devnull,
            )
        finally:
            os.close(devnull)
        self.reaper.wait(holder)  # reaped whenever it ends (with the VM)
        for _ in range(500):
            kids = _children(holder)
            if kids:
                self.pod_init = kids[0]
                return f"/proc/{self.pod_init}/ns/pid"
            await asyncio.sleep(0.01)
        raise AgentError("failed", "the pod PID namespace did not come up")

    def _runc(self, *args: str) -> list[str]:
        return [self.runc, "--root", os.path.join(self.state_dir, "runc"), *args]

    async def _runc_ok(self, *args: str) -> bytes:
        code, out, err = await proc.run(self.reaper, self._runc(*args))
        if code != 0:
            raise AgentError("failed", f"runc {args[0]}: {err.decode(errors='replace').strip()}")
        return out

    def _get(self, args: dict[str, Any]) -> Container:
        c = self.containers.get(str(args.get("id", "")))
        if c is None:
            raise AgentError("not_found", f"container {args.get('id')!r} not found")
        return c

    async def handle(self, op: str, args: dict[str, Any], payload: bytes) -> dict[str, Any]:
        method = getattr(self, f"op_{op}", None)
        if method is None:
            raise AgentError("unimplemented", f"unknown operation {op!r}")
        result: dict[str, Any] = await method(args)
        return result

    async def send_event(self, name: str, body: dict[str, Any]) -> None:
        if self.host is not None:
            with contextlib.suppress(ConnectionLost):
                await self.host.send_event(name, body)

    # ---- VM level
    async def op_hello(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"version": 1, "pid": os.getpid(), "containers": len(self.containers)}

    async def op_setup(self, args: dict[str, Any]) -> dict[str, Any]:
        os.makedirs(self.etc_dir, exist_ok=True)
        hostname = str(args.get("hostname") or socket.gethostname())
        proc.sethostname(hostname)
        with open(os.path.join(self.etc_dir, "hostname"), "w") as fh:
            fh.write(hostname + "\n")
        with open(os.path.join(self.etc_dir, "hosts"), "w") as fh:
            fh.write(
                f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
            )
        dns = args.get("dns") or {}
        lines = [f"nameserver {s}" for s in dns.get("servers") or []]
        if dns.get("searches"):
            lines.append("search " + " ".join(dns["searches"]))
        if dns.get("options"):
            lines.append("options " + " ".join(dns["options"]))
        with open(os.path.join(self.etc_dir, "resolv.conf"), "w") as fh:
            fh.write("".join(line + "\n" for line in lines))
        code, _, err = await proc.run(self.reaper, ["ip", "link", "set", "lo", "up"])
        if code != 0:
            raise AgentError("failed", f"loopback up: {err.decode(errors='replace')}")
        for key, value in (args.get("sysctls") or {}).items():
            path = "/proc/sys/" + str(key).replace(".", "/")
            try:
                with open(path, "w") as fh:
                    fh.write(str(value))
            except OSError as exc:
                raise AgentError("invalid", f"sysctl {key}: {exc.strerror}") from None
        return {}

    async def op_network(self, args: dict[str, Any]) -> dict[str, Any]:
        """Configure a NIC the host hot-plugged: rename, address, up, default route."""
        iface = str(args["interface"])
        name = str(args.get("name") or iface)
        steps = []
        if name != iface:
            steps.append(["ip", "link", "set", "dev", iface, "name", name])
        if args.get("mtu"):
            steps.append(["ip", "link", "set", "dev", name, "mtu", str(int(args["mtu"]))])
        steps += [
            ["ip", "addr", "replace", str(args["address"]), "dev", name],
            ["ip", "link", "set", "dev", name, "up"],
        ]
        if args.get("gateway"):
            steps.append(["ip", "route", "replace", "default", "via", str(args["gateway"]), "dev", name])
        for argv in steps:
            code, _, err = await proc.run(self.reaper, argv)
            if code != 0:
                raise AgentError("failed", f"{' '.join(argv)}: {err.decode(errors='replace').strip()}")
        return {"name": name}

    async def op_shutdown(self, args: dict[str, Any]) -> dict[str, Any]:
        for c in list(self.containers.values()):
            if c.status == "running":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, signal.SIGKILL)
        self.stopping.set()
        return {}

    # ---- containers
    async def op_create(self, args: dict[str, Any]) -> dict[str, Any]:
        cid = str(args["id"])
        if cid in self.containers:
            raise AgentError("exists", f"container {cid} exists")
        spec = dict(args["spec"])
        bundle = os.path.join(self.state_dir, "containers", cid)
        rootfs = os.path.join(bundle, "rootfs")
        os.makedirs(rootfs, exist_ok=True)
        container = Container(cid, bundle, bool(spec.get("tty")))
        container.shared_pid = spec.get("pid_mode", "container") != "container"
        try:
            src = spec["rootfs"]
            if src.get("lowers"):
                opts = f"lowerdir={':'.join(src['lowers'])},upperdir={src['upper']},workdir={src['work']}"
                _mount("overlay", rootfs, "overlay", opts)
            else:
                _mount(src["path"], rootfs, "", "", MS_BIND | MS_REC)
        except OSError as exc:
            shutil.rmtree(bundle, ignore_errors=True)
            raise AgentError("failed", str(exc)) from None
        try:
            etc = {
                f"/etc/{n}": os.path.join(self.etc_dir, n)
                for n in ("hosts", "hostname", "resolv.conf")
                if os.path.exists(os.path.join(self.etc_dir, n))
            }
            if spec.get("pid_mode") == "pod":
                spec["pid_ns_path"] = await self._pod_pid_ns()
            config = oci.build_config(spec, rootfs, etc, f"{self.cgroup_parent}/{cid}")
            with open(os.path.join(bundle, "config.json"), "w") as fh:
                json.dump(config, fh)
            await self._runc_create(container, spec)
        except Exception as exc:
            _umount(rootfs)
            shutil.rmtree(bundle, ignore_errors=True)
            if isinstance(exc, AgentError):
                raise
            raise AgentError("failed", str(exc)) from None
        self.containers[cid] = container
        return {"pid": container.pid}

    async def _runc_create(self, c: Container, spec: dict[str, Any]) -> None:
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
            if spec.get("stdin"):
                stdin, c.stdin_w = os.pipe()
                to_close.append(stdin)
            else:
                stdin = os.open(os.devnull, os.O_RDONLY)
                to_close.append(stdin)
        c.stdin_once = bool(spec.get("stdin_once"))
        log = os.path.join(c.bundle, "runc.log")
        pid_file = os.path.join(c.bundle, "pid")
        argv = self._runc("--log", log, "--log-format", "json", "create", "--bundle", c.bundle)
        argv += ["--pid-file", pid_file, c.id]
        try:
            pid = proc.spawn(argv, stdin, stdout, stderr)
        finally:
            for fd in to_close:
                os.close(fd)
        code = await self.reaper.wait(pid)
        if code != 0:
            for r in c.readers:
                r.close()
            raise AgentError("failed", f"runc create: {_runc_log(log)}")
        with open(pid_file) as fh:
            c.pid = int(fh.read().strip())
        waiter = self.reaper.wait(c.pid)
        waiter.add_done_callback(lambda f: self._exited(c, f.result()))

    def _exited(self, c: Container, code: int) -> None:
        c.status = "exited"
        c.exit_code = _as_exit_code(code)
        c.finished_at = time.time_ns()
        if not c.reason and c.exit_code != 0 and _oom_killed(f"{self.cgroup_parent}/{c.id}"):
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
            _spawn(self._kill_rest(c))
        _spawn(self.send_event("exit", c.describe()))

    async def _kill_rest(self, c: Container) -> None:
        with contextlib.suppress(AgentError):
            await self._runc_ok("kill", "--all", c.id, "KILL")

    async def op_start(self, args: dict[str, Any]) -> dict[str, Any]:
        c = self._get(args)
        if c.status != "created":
            raise AgentError("failed", f"container {c.id} is {c.status}")
        await self._runc_ok("start", c.id)
        c.status = "running" if not c.exited.is_set() else c.status
        c.started_at = time.time_ns()
        return c.describe()

    async def op_signal(self, args: dict[str, Any]) -> dict[str, Any]:
        c = self._get(args)
        if c.pid and not c.exited.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.pid, int(args.get("signal", signal.SIGTERM)))
        return {}

    async def op_wait(self, args: dict[str, Any]) -> dict[str, Any]:
        c = self._get(args)
        await c.exited.wait()
        return c.describe()

    async def op_state(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._get(args).describe()

    async def op_list(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"containers": [c.describe() for c in self.containers.values()]}

    async def op_remove(self, args: dict[str, Any]) -> dict[str, Any]:
        c = self.containers.get(str(args.get("id", "")))
        if c is None:
            return {}
        if not c.exited.is_set() and c.status == "running":
            raise AgentError("failed", f"container {c.id} is running")
        await proc.run(self.reaper, self._runc("delete", "--force", c.id))
        for r in c.readers:
            r.close()
        if c.tty_master is not None:
            os.close(c.tty_master)
        _umount(os.path.join(c.bundle, "rootfs"))
        shutil.rmtree(c.bundle, ignore_errors=True)
        del self.containers[c.id]
        return {}

    async def op_output(self, args: dict[str, Any]) -> dict[str, Any]:
        """Subscribe a stream to the container's output, backlog first."""
        c = self._get(args)
        assert self.host is not None
        st = self.host.stream(int(args["stream"]))
        for ch, data in c.backlog:
            await st.write(ch, data)
        c.backlog.clear()
        c.backlog_size = 0
        if c.open_outputs <= 0 and c.readers:
            await st.close(Ch.STDOUT)
        else:
            c.subscribers.append(st)
        return {}

    async def op_attach(self, args: dict[str, Any]) -> dict[str, Any]:
        """Output as op_output; what arrives on STDIN goes to the container's stdin."""
        c = self._get(args)
        assert self.host is not None
        st = self.host.stream(int(args["stream"]))
        c.subscribers.append(st)
        target = c.tty_master if c.tty else c.stdin_w
        if target is not None and args.get("stdin"):
            _spawn(self._pump_stdin(c, st, target))
        return {}

    async def _pump_stdin(self, c: Container, st: Stream, fd: int) -> None:
        while True:
            ch, data = await st.read()
            if ch != Ch.STDIN:
                continue
            if not data:
                if c.stdin_once and not c.tty and c.stdin_w is not None:
                    os.close(c.stdin_w)
                    c.stdin_w = None
                return
            with contextlib.suppress(OSError):
                await _write_all(fd, data)

    async def op_update(self, args: dict[str, Any]) -> dict[str, Any]:
        c = self._get(args)
        res = args.get("resources") or {}
        flags: list[str] = []
        if res.get("memory"):
            flags += ["--memory", str(int(res["memory"]))]
        if res.get("cpu_quota"):
            flags += [
                "--cpu-quota",
                str(int(res["cpu_quota"])),
                "--cpu-period",
                str(res.get("cpu_period") or 100000),
            ]
        if res.get("cpu_shares"):
            flags += ["--cpu-share", str(int(res["cpu_shares"]))]
        if flags and not c.exited.is_set():
            await self._runc_ok("update", *flags, c.id)
        return {}

    async def op_stats(self, args: dict[str, Any]) -> dict[str, Any]:
        c = self._get(args)
        sample = None
        if not c.exited.is_set() and c.pid:
            sample = self.cgroups.sample(c.pid, expect=c.id)
        if sample is None:
            return {"cpu_ns": 0, "memory_bytes": 0, "working_set_bytes": 0}
        return {
            "cpu_ns": sample.cpu_ns or 0,
            "memory_bytes": sample.memory_usage or 0,
            "working_set_bytes": sample.working_set or 0,
        }

    async def op_metrics(self, args: dict[str, Any]) -> dict[str, Any]:
        """cAdvisor-style counters of the VM's running containers and of its network."""
        out: dict[str, Any] = {}
        for cid in args.get("ids") or []:
            c = self.containers.get(str(cid))
            if c is None or c.exited.is_set() or not c.pid:
                continue
            sample = self.cgroups.sample(c.pid, expect=c.id, full=True)
            if sample is None:
                continue
            detail = self.cgroups.detail(c.pid, expect=c.id)
            out[c.id] = {
                "sample": dataclasses.asdict(sample),
                "detail": None if detail is None else dataclasses.asdict(detail),
            }
        interfaces = [dataclasses.asdict(i) for i in cgroups.net_interfaces(os.getpid())]
        return {"containers": out, "interfaces": interfaces}

    # ---- exec
    async def op_exec(self, args: dict[str, Any]) -> dict[str, Any]:
        c = self._get(args)
        if c.exited.is_set() or c.status != "running":
            raise AgentError("failed", f"container {c.id} is not running")
        assert self.host is not None
        st = self.host.stream(int(args["stream"]))
        tty = bool(args.get("tty"))
        pid_file = os.path.join(c.bundle, f"exec-{st.id}.pid")
        # Detached: runc passes our fds straight through (a foreground exec would copy them
        # through its own pipes, hiding the TTY) and the process is reparented to us.
        log = os.path.join(c.bundle, f"exec-{st.id}.log")
        argv = self._runc("--log", log, "--log-format", "json", "exec", "--detach", "--pid-file", pid_file)
        for env in args.get("env") or []:
            argv += ["--env", str(env)]
        argv += [c.id, *[str(a) for a in args["args"]]]
        readers: list[proc.PipeReader] = []
        master: int | None = None
        if tty:
            master, slave = os.openpty()
            fds = [slave, slave, slave]
            stdin_target = master
            readers.append(proc.PipeReader(os.dup(master), lambda d: _spawn(_forward(st, Ch.STDOUT, d))))
        else:
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            fds = [in_r, out_w, err_w]
            stdin_target = in_w
            readers.append(proc.PipeReader(out_r, lambda d: _spawn(_forward(st, Ch.STDOUT, d))))
            readers.append(proc.PipeReader(err_r, lambda d: _spawn(_forward(st, Ch.STDERR, d))))
        try:
            pid = proc.spawn(argv, fds[0], fds[1], fds[2], setsid=tty)
        finally:
            for fd in set(fds):
                os.close(fd)
        try:
            if await self.reaper.wait(pid) != 0:
                raise AgentError("failed", f"runc exec: {_runc_log(log)}")
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
            for path in (pid_file, log):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self.execs[st.id] = (pid, master)
        if not args.get("stdin"):
            if not tty:
                os.close(stdin_target)
            pump = None
        else:
            pump = asyncio.get_running_loop().create_task(self._exec_stdin(st, stdin_target, tty))
        try:
            code = await self.reaper.wait(pid)
            if tty:
                # The slave closes with the process; drain what the master still holds.
                await asyncio.wait([readers[0].done], timeout=1.0)
                readers[0].close()
            else:
                await asyncio.gather(*(r.done for r in readers))
        finally:
            self.execs.pop(st.id, None)
            if pump is not None:
                pump.cancel()
            if master is not None:
                os.close(master)
        with contextlib.suppress(ConnectionLost):
            await st.close(Ch.STDOUT)
        return {"exit_code": _as_exit_code(code)}

    async def _exec_stdin(self, st: Stream, fd: int, tty: bool) -> None:
        try:
            while True:
                ch, data = await st.read()
                if ch != Ch.STDIN:
                    continue
                if not data:
                    break
                await _write_all(fd, data)
        except OSError:
            pass
        finally:
            if not tty:
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def op_exec_kill(self, args: dict[str, Any]) -> dict[str, Any]:
        entry = self.execs.get(int(args["stream"]))
        if entry is None:
            return {}
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry[0], signal.SIGKILL)
        # Answer once it is reaped: a client checking right after the timeout must not see it.
        for _ in range(200):
            if not os.path.exists(f"/proc/{entry[0]}"):
                break
            await asyncio.sleep(0.01)
        return {}

    async def op_resize(self, args: dict[str, Any]) -> dict[str, Any]:
        master: int | None = None
        entry = self.execs.get(int(args.get("stream", 0)))
        if entry is not None:
            master = entry[1]
        elif args.get("id"):
            master = self._get(args).tty_master
        if master is not None:
            size = struct.pack("HHHH", int(args["height"]), int(args["width"]), 0, 0)
            fcntl.ioctl(master, termios.TIOCSWINSZ, size)
        return {}

    # ---- port forward
    async def op_port_forward(self, args: dict[str, Any]) -> dict[str, Any]:
        assert self.host is not None
        st = self.host.stream(int(args["stream"]))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", int(args["port"]))
        except OSError as exc:
            raise AgentError("failed", f"connect to port {args['port']}: {exc.strerror}") from None

        async def upstream() -> None:
            try:
                while True:
                    ch, data = await st.read()
                    if ch != Ch.STDIN:
                        continue
                    if not data:
                        break
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

        _spawn(both())
        return {}


async def _forward(st: Stream, ch: int, data: bytes) -> None:
    if data:
        await st.write(ch, data)


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        view = view[n:]


def _runc_log(path: str) -> str:
    msgs: list[str] = []
    with contextlib.suppress(OSError):
        with open(path) as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if entry.get("level") in ("error", "fatal"):
                        msgs.append(str(entry.get("msg", "")))
    return "; ".join(msgs) or "unknown error"


async def serve(socket_path: str, agent: Agent) -> None:
    agent.reaper.install()
    proc.become_subreaper()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, agent.handle)
        agent.host = channel  # the newest host connection receives events
        channel.start()
        await channel.closed.wait()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server = await asyncio.start_unix_server(on_connect, path=socket_path)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, agent.stopping.set)
    async with server:
        await agent.stopping.wait()
        await asyncio.sleep(0.05)  # let the shutdown answer leave


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runv-agent")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--cgroup-parent", default="/cri-shim-runv/agent")
    parser.add_argument("--runc", default="runc")
    parser.add_argument("--fail-boot", action="store_true", help="fault injection: die before serving")
    ns = parser.parse_args(argv)
    if ns.fail_boot:
        print("runv-agent: injected boot failure", flush=True)
        return 1
    os.makedirs(ns.state, exist_ok=True)
    asyncio.run(serve(ns.socket, Agent(ns.state, ns.cgroup_parent, ns.runc)))
    return 0
