"""The fake's pods and containers: sandboxes with pod IPs, containers running programs, exits, logs.

It keeps no processes: a "running" container is a record and, only when its
program has timed output or an end, or its command runs in the built-in
shell, one task. A container whose command the shell does not know
(``nginx``, ``/pause``) costs no task: that is what lets one process hold
10,000 pods and 30,000 containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from backends.contract import (
    ContainerRecord,
    EventSink,
    ExitInfo,
    Health,
    LogMarks,
    Observed,
    ProcessPipe,
    SandboxNetwork,
    SandboxRecord,
    Started,
    StreamIO,
    decide_stop_signal,
    errors,
    recorded_stop_signal,
    signal_name,
)
from backends.fake import environment, servers, shell
from backends.fake.files import ContainerFiles
from backends.fake.images import FakeImages
from backends.fake.pids import PidNamespaces
from backends.fake.ports import ContainerNetwork, PodPorts
from backends.fake.program import OutputLine, Program, Programs
from cri_api import api_pb2 as pb

_EXEC_PID = 1000  # $$ of an exec's shell


def own_pid_namespace(c: ContainerRecord) -> bool:
    """Whether the container's command is PID 1 of a PID namespace of its own (CRI pid CONTAINER):
    with POD the pause process is, with NODE the host's init, with TARGET the target's command."""
    return bool(c.config.linux.security_context.namespace_options.pid == pb.CONTAINER)


def _kill_init(run: Running, name: str) -> None:
    """An exec's `kill SIG 1`: the signal to the container's main shell, which is PID 1."""
    if run.term is not None and run.sent is not None:
        run.sent.append(name)
        run.term.set()


async def _emit(run: Running, stream: str, data: bytes) -> None:
    """Output of the container's main process: to its log and to attached sessions."""
    run.pipe.put(stream, data)
    for io in list(run.attached):
        await send(io, stream, data)


def _init_output(run: Running, fd: int) -> Callable[[bytes], Awaitable[None]] | None:
    """/proc/1/fd/1 and 2 as an exec or a hook opens them: the main process's log streams."""
    stream = {1: "stdout", 2: "stderr"}.get(fd)
    return functools.partial(_emit, run, stream) if stream is not None else None


@dataclasses.dataclass(slots=True)
class Running:
    """Live state of one started container."""

    program: Program | None  # None: its command, in the built-in shell
    started_mono: float
    task: asyncio.Task[None] | None = None
    term: asyncio.Event | None = None  # its stop signal to its shell
    sent: list[str] | None = None  # signals an exec's `kill SIG 1` queues for its shell (PID 1)
    stdin: asyncio.Queue[bytes] | None = None  # its shell's stdin (config.stdin), fed by attach
    pipe: ProcessPipe = dataclasses.field(default_factory=ProcessPipe)  # its output and exit, for the shim
    attached: list[StreamIO] = dataclasses.field(default_factory=list)
    resumed: bool = False  # restored from a checkpoint (RestorePod): started where it was

    async def exited(self) -> None:
        """Until it has ended. The pipe's exit is the one place that says so: an event of its own
        for each started container cost a fake node ~0.75 KiB a container."""
        await self.pipe.exit.wait()


async def send(io: StreamIO, stream: str, data: bytes) -> None:
    """Write ``data`` of ``stream`` to a session (stderr goes to stdout under a TTY)."""
    if stream == "stderr" and io.stderr and not io.tty:
        await io.write_stderr(data)
    elif io.stdout:
        await io.write_stdout(data)


class FakeLifecycle:
    """The Lifecycle part in memory, and the Resources part (it accepts new limits)."""

    def __init__(
        self,
        options: Mapping[str, Any],
        images: FakeImages,
        programs: Programs,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.clock = clock
        self.images = images
        self.programs = programs
        self.events: EventSink | None = None
        self.runtime_ready = True
        self.network_ready = True
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.containers: set[str] = set()
        self.files: dict[str, ContainerFiles] = {}  # created containers' own files and volumes
        self.ports = PodPorts()  # what the running containers' servers listen on
        self.running: dict[str, Running] = {}
        # Restored containers not started yet: the seconds their program had run (RestorePod).
        self.resumed: dict[str, float] = {}
        self.pids = PidNamespaces()  # the running containers' main processes, for ps and pidof
        self._cgroup_driver = str(options.get("cgroup_driver", "cgroupfs"))
        self._network = ipaddress.ip_network(str(options.get("pod_cidr", "10.88.0.0/16")))
        self._next_ip = 2  # offset in the pod network of the next address to try
        self._ips: set[str] = set()  # addresses held by sandboxes

    # ------------------------------------------------------------------ the backend itself
    async def start(self, events: EventSink) -> None:
        self.events = events
        self.images.load()

    async def close(self) -> None:
        for cid, r in self.running.items():
            if r.task is not None:
                r.task.cancel()
            self.ports.release(cid)
        self.running.clear()

    async def health(self) -> Health:
        ready = self.runtime_ready and self.network_ready
        return Health(
            runtime_ready=self.runtime_ready,
            network_ready=self.network_ready,
            reason="" if ready else "FakeNotReady",
            message="" if ready else "set not ready by a test",
        )

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        resp = pb.RuntimeConfigResponse()
        resp.linux.cgroup_driver = pb.SYSTEMD if self._cgroup_driver == "systemd" else pb.CGROUPFS
        return resp

    async def recover(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[dict[str, Observed], dict[str, Observed]]:
        # The fake "runtime" outlives the shim: whatever was running still runs
        # (with the default program, as timers do not survive a restart).
        seen_sb = {}
        for s in sandboxes:
            self.sandboxes[s.id] = s
            if s.backend_data.get("ip"):
                self._ips.add(str(s.backend_data["ip"]))  # a restarted runtime keeps its pods' IPs
            seen_sb[s.id] = Observed(exists=True)
        seen_ct = {}
        for c in containers:
            self.containers.add(c.id)
            running = c.status.state == pb.CONTAINER_RUNNING
            if running and c.id not in self.running:
                self.running[c.id] = Running(Program(), time.monotonic())
                self.pids.start(c, environment.command_of(c, *self.images.process_for(c.config.image.image)))
                # Its scripted servers still serve; what its command had started is gone with the shell.
                with contextlib.suppress(errors.InvalidArgumentError):
                    self._bind_scripted(c)
            seen_ct[c.id] = Observed(exists=True, running=running, started_at=c.status.started_at)
        return seen_sb, seen_ct

    def set_pod_cidr(self, cidr: str) -> None:
        network = ipaddress.ip_network(cidr, strict=False)
        if network != self._network and network.num_addresses >= 4:
            self._network = network
            self._next_ip = 2

    # ------------------------------------------------------------------ sandboxes
    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        self.sandboxes[sandbox.id] = sandbox
        if sandbox.config.linux.security_context.namespace_options.network == pb.NODE:
            return SandboxNetwork(ip="")
        ip = sandbox.backend_data.get("ip")
        if not ip:
            ip = self._allocate_ip()
            sandbox.backend_data["ip"] = ip
        self._ips.add(ip)
        return SandboxNetwork(ip=ip)

    def _allocate_ip(self) -> str:
        """The next free address of the pod network, round-robin (never one a pod holds)."""
        size = self._network.num_addresses
        for _ in range(max(size - 3, 0)):
            offset = self._next_ip
            self._next_ip = offset + 1 if offset + 2 < size else 2
            ip = str(self._network.network_address + offset)
            if ip not in self._ips:
                return ip
        raise errors.ResourceExhaustedError(f"no free pod IP left in {self._network}")

    async def stop_sandbox(self, sandbox: SandboxRecord) -> None:
        pass

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        self.sandboxes.pop(sandbox.id, None)
        self._ips.discard(str(sandbox.backend_data.get("ip", "")))

    # ------------------------------------------------------------------ containers
    def _bind_scripted(self, c: ContainerRecord) -> None:
        """Binds the container's scripted servers' ports; one another server of the pod holds keeps it."""
        for port, server in servers.parse_serve(c).items():
            with contextlib.suppress(OSError):
                self.ports.bind(c.sandbox_id, c.id, "", "", port, functools.partial(servers.serve, server))

    def files_of(self, c: ContainerRecord) -> ContainerFiles:
        files = self.files.get(c.id)
        if files is None:  # recovered after a restart: made again (its own files are lost, its volumes not)
            files = self.files[c.id] = environment.container_files(
                c, self.sandboxes.get(c.sandbox_id), self.images.files_for(c.config.image.image)
            )
        return files

    def shell_io(
        self,
        c: ContainerRecord,
        stdout: environment.Write,
        stderr: environment.Write,
        stdin: Callable[[], Awaitable[bytes]] | None = None,
    ) -> shell.ShellIO:
        sb = self.sandboxes.get(c.sandbox_id)
        ip = str(sb.backend_data.get("ip", "")) if sb else ""
        network = ContainerNetwork(self.ports, c.sandbox_id, c.id, ip)
        run = self.running.get(c.id)
        processes = functools.partial(self.pids.seen_from, c.id)
        image = self.images.find(c.image_ref or c.config.image.image)
        uid = image.uid if image is not None else None
        io = environment.shell_io(c, sb, self.files_of(c), stdout, stderr, stdin, processes, network, uid)
        io.pid = _EXEC_PID  # an exec is not its container's PID 1
        if run is not None and run.sent is not None:
            io.kill_init = functools.partial(_kill_init, run)
        if run is not None:
            io.init_output = functools.partial(_init_output, run)
        return io

    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        image = container.config.image.image
        found = self.images.find(image)
        if found is None:
            raise errors.NotFoundError(f"image {image!r} is not present; pull it first")
        container.image_ref = found.id
        container.image_name = self.images.display_name(container.image_name or image, found)
        decide_stop_signal(container, found.stop_signal)
        self.programs.program_for(container)  # a bad program annotation fails the create, not the start
        servers.parse_serve(container)  # and so does a bad servers one
        self.files[container.id] = environment.container_files(
            container, self.sandboxes.get(sandbox.id), self.images.files_for(image)
        )
        self.containers.add(container.id)

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> Started:
        if container.id not in self.containers:
            raise errors.NotFoundError(f"container {container.id} does not exist in the fake runtime")
        program = self.programs.program_for(container)
        argv = environment.command_of(container, *self.images.process_for(container.config.image.image))
        if program is None and not (argv and shell.knows(argv[0])):
            program = Program()  # a command the shell does not know: it runs, silently, until stopped
        # A restored container's program resumes where its checkpoint left it.
        elapsed = self.resumed.pop(container.id, 0.0)
        run = Running(program, time.monotonic() - elapsed, resumed=bool(elapsed))
        self.running[container.id] = run
        self.pids.start(container, argv)
        self._bind_scripted(container)
        started = self.clock()
        loop = asyncio.get_running_loop()
        if program is None:
            run.term = asyncio.Event()
            if container.config.stdin:
                run.stdin = asyncio.Queue()
            run.task = loop.create_task(self._run_command(container, run, argv))
            return Started(started, run.pipe)
        for o in program.output:
            if o.after <= 0 and not elapsed:  # written before the checkpoint, if restored
                run.pipe.put(o.stream, o.line.encode() + b"\n")
        later = [o for o in program.output if o.after > max(elapsed, 0.0)]
        if later or program.finite or program.repeat_every:
            run.task = loop.create_task(self._play(container.id, run, later))
        return Started(started, run.pipe)

    async def _run_command(self, c: ContainerRecord, run: Running, argv: list[str]) -> None:
        """The container's command in the built-in shell; its output to the log and to attached sessions."""

        async def read_stdin() -> bytes:
            assert run.stdin is not None
            return await run.stdin.get()

        io = self.shell_io(
            c,
            functools.partial(_emit, run, "stdout"),
            functools.partial(_emit, run, "stderr"),
            read_stdin if run.stdin is not None else None,
        )
        io.pid = 1
        io.kill_init = None
        io.init = own_pid_namespace(c)
        run.sent = io.sent if io.init else None
        io.term = run.term
        io.term_signal = signal_name(recorded_stop_signal(c)).removeprefix("SIG")
        io.unknown_runs = True  # `sh -c "...; nginx"`: nginx runs until stopped
        try:
            code = await shell.run(argv, io)
        except Exception as exc:  # a gap in the shell must not leave the container running forever
            self._finish(c.id, ExitInfo(255, self.clock(), "Error", f"fake shell: {exc!r}"))
            return
        self._finish(c.id, ExitInfo(code, self.clock(), "Completed" if code == 0 else "Error"))

    async def reattach(self, container: ContainerRecord, after: LogMarks | None) -> ProcessPipe | None:
        run = self.running.get(container.id)
        if run is None:
            return None
        run.pipe = ProcessPipe()  # the old one went with the shim that followed it
        return run.pipe

    async def _write(self, run: Running, o: OutputLine) -> None:
        """A scripted program's line, to the log and to attached sessions."""
        data = o.line.encode() + b"\n"
        run.pipe.put(o.stream, data)
        for io in run.attached:
            await send(io, o.stream, data)

    async def _play(self, cid: str, run: Running, later: list[OutputLine]) -> None:
        assert run.program is not None
        t0 = run.started_mono
        for o in later:
            await asyncio.sleep(max(0.0, t0 + o.after - time.monotonic()))
            await self._write(run, o)
        period = run.program.repeat_every
        while run.resumed and period and t0 + period <= time.monotonic():
            t0 += period  # resumed from a checkpoint: the periods before it were written then
        while period:
            t0 += period
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            for o in run.program.output:
                await self._write(run, o)
        if run.program.exit_after is None:
            return
        await asyncio.sleep(max(0.0, t0 + run.program.exit_after - time.monotonic()))
        self._finish(cid, ExitInfo(exit_code=run.program.exit_code, finished_at=self.clock()))

    def _finish(self, cid: str, info: ExitInfo) -> None:
        run = self.running.pop(cid, None)
        if run is None:
            return
        self.pids.stop(cid)
        self.ports.release(cid)  # its servers, and those its command had started, go with it
        run.pipe.end()  # everything it wrote is in the pipe already
        run.pipe.exit.set(info)

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        run = self.running.get(container.id)
        if run is None:
            return ExitInfo(exit_code=0, finished_at=self.clock(), reason="Completed")
        if run.program is None:
            return await self._stop_command(container.id, run, timeout)
        if run.program.ignore_sigterm and timeout > 0:
            try:
                await asyncio.wait_for(run.exited(), timeout)
            except TimeoutError:
                pass
            if container.id not in self.running:
                return ExitInfo(exit_code=run.program.exit_code, finished_at=self.clock())
            info = ExitInfo(
                exit_code=137, finished_at=self.clock(), reason="Error", message="killed after timeout"
            )
        elif timeout == 0 and run.program.ignore_sigterm:
            info = ExitInfo(exit_code=137, finished_at=self.clock(), reason="Error")
        else:
            code = run.program.term_exit_code
            info = ExitInfo(
                exit_code=code, finished_at=self.clock(), reason="Completed" if code == 0 else "Error"
            )
        if run.task is not None:
            run.task.cancel()
        self._finish(container.id, info)
        return info

    async def _stop_command(self, cid: str, run: Running, timeout: int) -> ExitInfo:
        """The stop signal to the shell (its trap runs; with no trap, as PID 1 of its own PID
        namespace, it is ignored), KILL after ``timeout`` s of real time: as a runtime stops a
        process. A test that wants a quick stop gives the shell a trap or a short timeout."""
        if timeout > 0 and run.term is not None:
            run.term.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(run.exited()), timeout)
        if cid in self.running:
            if run.task is not None:
                run.task.cancel()
            self._finish(cid, ExitInfo(137, self.clock(), "Error"))
        info = run.pipe.exit.info
        assert info is not None
        return info

    async def remove_container(self, container: ContainerRecord) -> None:
        run = self.running.pop(container.id, None)
        if run is not None:
            if run.task is not None:
                run.task.cancel()
            run.pipe.end()
        self.pids.stop(container.id)
        self.ports.release(container.id)
        self.containers.discard(container.id)
        self.files.pop(container.id, None)
        self.resumed.pop(container.id, None)

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        pass  # accepted: the fake enforces no limits

    async def update_sandbox_resources(
        self, sandbox: SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None:
        pass  # accepted (the shim records them): the fake enforces no limits
