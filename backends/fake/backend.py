"""The fake runtime: complete CRI behaviour in memory, plus a spy.

It keeps no processes: a "running" container is a record and, only when its
program has timed output or an end, one timer task. That is what lets one
process hold 10,000 pods and 30,000 containers.

Spy and injection (from the config file or from Python at run time):
- ``calls``: every backend call with its arguments (bounded deque);
- ``set_latency(method, seconds)``: delay a method;
- ``inject_error(method, error)``: FIFO of errors per method, so a test can
  say "fail twice, then succeed";
- ``pulls``: each image pull with the auth it carried.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fnmatch
import hashlib
import ipaddress
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backends.contract import (
    Capability,
    ContainerRecord,
    EventSink,
    ExecResult,
    ExitInfo,
    Health,
    LogSink,
    Observed,
    PortStream,
    SandboxNetwork,
    SandboxRecord,
    StreamIO,
    container_stats_of,
    errors,
    sandbox_stats_of,
)
from backends.fake.program import (
    PROGRAM_ANNOTATION,
    Program,
    ProgramError,
    ShellContext,
    parse_program,
    program_from_command,
    run_shell,
)
from backends.reference import BadReference, Reference, parse
from cri_api import api_pb2 as pb

CAPABILITIES = (
    Capability.EXEC_SYNC
    | Capability.EXEC
    | Capability.ATTACH
    | Capability.PORT_FORWARD
    | Capability.STATS
    | Capability.UPDATE_RESOURCES
    | Capability.IMAGES
    | Capability.HOST_NETWORK
)

_CODES: dict[str, type[errors.CriError]] = {
    "NOT_FOUND": errors.NotFoundError,
    "ALREADY_EXISTS": errors.AlreadyExistsError,
    "INVALID_ARGUMENT": errors.InvalidArgumentError,
    "FAILED_PRECONDITION": errors.FailedPreconditionError,
    "UNIMPLEMENTED": errors.UnimplementedError,
    "UNAVAILABLE": errors.UnavailableError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceededError,
    "RESOURCE_EXHAUSTED": errors.ResourceExhaustedError,
    "INTERNAL": errors.InternalError,
}


def error_from_spec(spec: str) -> errors.CriError:
    """ "CODE: message" → the condition exception (for the config file)."""
    code, _, message = spec.partition(":")
    cls = _CODES.get(code.strip().upper())
    if cls is None:
        raise ValueError(f"unknown error code {code!r} (known: {', '.join(_CODES)})")
    return cls(message.strip() or f"injected {code.strip()}")


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    method: str
    args: tuple[Any, ...]
    at: int


@dataclasses.dataclass(slots=True)
class FakeImage:
    id: str
    repo_tags: list[str]
    repo_digests: list[str]
    size: int
    uid: int | None
    username: str
    pinned: bool = False

    def to_pb(self) -> pb.Image:
        img = pb.Image(
            id=self.id,
            repo_tags=self.repo_tags,
            repo_digests=self.repo_digests,
            size=self.size,
            username=self.username,
            pinned=self.pinned,
        )
        if self.uid is not None:
            img.uid.value = self.uid
        img.spec.image = self.id
        return img


@dataclasses.dataclass(slots=True)
class Running:
    """Live state of one started container."""

    program: Program
    started_mono: float
    task: asyncio.Task[None] | None = None
    exited: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    attached: list[StreamIO] = dataclasses.field(default_factory=list)


class FakeBackend:
    """Implements backends.contract.Backend in memory."""

    def __init__(
        self, name: str, options: Mapping[str, Any], clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.name = name
        self.capabilities = CAPABILITIES
        self.clock = clock
        self.options = dict(options)
        self.events: EventSink | None = None
        self.calls: collections.deque[Call] = collections.deque(maxlen=int(options.get("max_calls", 10000)))
        self.pulls: list[tuple[str, pb.AuthConfig | None]] = []
        self._latency: dict[str, float] = {}
        self._errors: dict[str, collections.deque[BaseException]] = collections.defaultdict(collections.deque)
        self._programs: dict[str, Program] = {}
        self._exec_rules: list[tuple[list[str], ExecResult, float]] = []
        self._image_rules: dict[str, dict[str, Any]] = {}
        self._missing_images: list[str] = []
        self._running: dict[str, Running] = {}
        self._sandboxes: dict[str, SandboxRecord] = {}
        self._containers: set[str] = set()
        self._images: dict[str, FakeImage] = {}
        self._state_dir = str(options.get("state_dir", ""))
        # A pull takes a little time, as a real one does, so that client deadlines mean something.
        self._pull_seconds = float(options.get("pull_seconds", 0.01))
        self._pause_image = str(options.get("pause_image", ""))
        self._pause_ref = ""
        self._cgroup_driver = str(options.get("cgroup_driver", "cgroupfs"))
        self._network = ipaddress.ip_network(str(options.get("pod_cidr", "10.88.0.0/16")))
        self._next_ip = 2  # offset in the pod network of the next address to try
        self._ips: set[str] = set()  # addresses held by sandboxes
        self.runtime_ready = True
        self.network_ready = True
        self._apply_options(options)

    # ------------------------------------------------------------------ configuration
    def _apply_options(self, o: Mapping[str, Any]) -> None:
        for method, seconds in dict(o.get("latency", {})).items():
            self.set_latency(method, float(seconds))
        for method, specs in dict(o.get("errors", {})).items():
            for spec in specs:
                self.inject_error(method, error_from_spec(str(spec)))
        for image, prog in dict(o.get("programs", {})).items():
            self._programs[image] = parse_program(prog, f"[handlers.{self.name}.programs.{image}]")
        for i, rule in enumerate(o.get("exec", [])):
            cmd = rule.get("cmd")
            if not isinstance(cmd, list) or not cmd:
                raise ValueError(f"[handlers.{self.name}] exec[{i}].cmd must be a non-empty list")
            res = ExecResult(
                exit_code=int(rule.get("exit_code", 0)),
                stdout=str(rule.get("stdout", "")).encode(),
                stderr=str(rule.get("stderr", "")).encode(),
            )
            self._exec_rules.append(([str(c) for c in cmd], res, float(rule.get("delay", 0.0))))
        self._image_rules = {str(k): dict(v) for k, v in dict(o.get("images", {})).items()}
        self._missing_images = [str(p) for p in o.get("missing_images", [])]

    def set_latency(self, method: str, seconds: float) -> None:
        self._latency[method] = seconds

    def inject_error(self, method: str, error: BaseException) -> None:
        self._errors[method].append(error)

    def add_exec_rule(self, cmd: Sequence[str], result: ExecResult, delay: float = 0.0) -> None:
        self._exec_rules.append((list(cmd), result, delay))

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    async def _enter(self, method: str, *args: Any) -> None:
        self.calls.append(Call(method, args, self.clock()))
        delay = self._latency.get(method)
        if delay:
            await asyncio.sleep(delay)
        queue = self._errors.get(method)
        if queue:
            raise queue.popleft()

    # ------------------------------------------------------------------ lifecycle of the backend
    async def start(self, events: EventSink) -> None:
        self.events = events
        if self._state_dir:
            # ImageFsInfo and the writable-layer stats name it: the kubelet stats what they name.
            os.makedirs(self._state_dir, exist_ok=True)
        self._load_images()
        if self._pause_image:
            try:
                ref = parse(self._pause_image)
            except BadReference:
                return
            self._pause_ref = ref.tagged
            img = self._images.get(self._image_id(ref)) or self._add_image(ref)
            img.pinned = True

    async def close(self) -> None:
        for r in self._running.values():
            if r.task is not None:
                r.task.cancel()
        self._running.clear()

    async def health(self) -> Health:
        await self._enter("health")
        return Health(
            runtime_ready=self.runtime_ready,
            network_ready=self.network_ready,
            reason="" if self.runtime_ready and self.network_ready else "FakeNotReady",
            message="" if self.runtime_ready and self.network_ready else "set not ready by a test",
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
        await self._enter("recover", len(sandboxes), len(containers))
        seen_sb = {}
        for s in sandboxes:
            self._sandboxes[s.id] = s
            if s.backend_data.get("ip"):
                self._ips.add(str(s.backend_data["ip"]))  # a restarted runtime keeps its pods' IPs
            seen_sb[s.id] = Observed(exists=True)
        seen_ct = {}
        for c in containers:
            self._containers.add(c.id)
            running = c.status.state == pb.CONTAINER_RUNNING
            if running:
                self._running[c.id] = Running(Program(), time.monotonic())
            seen_ct[c.id] = Observed(exists=True, running=running, started_at=c.status.started_at)
        return seen_sb, seen_ct

    # ------------------------------------------------------------------ sandboxes
    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        await self._enter("run_sandbox", sandbox.id)
        self._sandboxes[sandbox.id] = sandbox
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
        await self._enter("stop_sandbox", sandbox.id)

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        await self._enter("remove_sandbox", sandbox.id)
        self._sandboxes.pop(sandbox.id, None)
        self._ips.discard(str(sandbox.backend_data.get("ip", "")))

    # ------------------------------------------------------------------ containers
    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        await self._enter("create_container", container.id, sandbox.id)
        image = container.config.image.image
        found = self._find_image(image)
        if found is None:
            raise errors.NotFoundError(f"image {image!r} is not present; pull it first")
        container.image_ref = found.id
        container.image_name = self._display_name(image, found)
        self._program_for(container)  # a bad program annotation fails the create, not the start
        self._containers.add(container.id)

    def _program_for(self, c: ContainerRecord) -> Program:
        raw = c.config.annotations.get(PROGRAM_ANNOTATION)
        if raw is not None:
            try:
                return parse_program(raw, f"annotation {PROGRAM_ANNOTATION}")
            except ProgramError as exc:
                raise errors.InvalidArgumentError(str(exc)) from None
        image = c.config.image.image
        prog = self._programs.get(image)
        if prog is None:
            try:
                ref = parse(image)
                prog = self._programs.get(ref.repository) or self._programs.get(ref.tagged)
            except BadReference:
                prog = None
        if prog is not None:
            return prog
        argv = list(c.config.command) + list(c.config.args)
        derived = program_from_command(argv, self._shell_context(c))
        return derived or Program()

    def _shell_context(self, c: ContainerRecord) -> ShellContext:
        sb = self._sandboxes.get(c.sandbox_id)
        hostname = (sb.config.hostname if sb else "") or c.sandbox_id[:12]
        files = {
            "/etc/hostname": hostname + "\n",
            "/etc/hosts": f"127.0.0.1\tlocalhost\n{sb.status.ip if sb else ''}\t{hostname}\n",
        }
        sysctls: dict[str, str] = {}
        if sb is not None:
            dns = sb.config.dns_config
            resolv = "".join(f"nameserver {s}\n" for s in dns.servers)
            if dns.searches:
                resolv += "search " + " ".join(dns.searches) + "\n"
            if dns.options:
                resolv += "options " + " ".join(dns.options) + "\n"
            files["/etc/resolv.conf"] = resolv
            sysctls = dict(sb.config.linux.sysctls)
            for key, value in sysctls.items():
                files["/proc/sys/" + key.replace(".", "/")] = value + "\n"
        argv = list(c.config.command) + list(c.config.args)
        processes = [os.path.basename(argv[0])] if argv and c.id in self._running else []
        return ShellContext(
            env=_env(c.config.envs), hostname=hostname, files=files, sysctls=sysctls, processes=processes
        )

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord, logs: LogSink) -> int:
        await self._enter("start_container", container.id)
        if container.id not in self._containers:
            raise errors.NotFoundError(f"container {container.id} does not exist in the fake runtime")
        program = self._program_for(container)
        run = Running(program, time.monotonic())
        self._running[container.id] = run
        started = self.clock()
        immediate = [o for o in program.output if o.after <= 0]
        for o in immediate:
            logs.write(o.stream, o.line.encode() + b"\n")
        later = [o for o in program.output if o.after > 0]
        if later or program.finite or program.repeat_every:
            run.task = asyncio.get_running_loop().create_task(self._play(container.id, run, later, logs))
        return started

    async def _play(self, cid: str, run: Running, later: list[Any], logs: LogSink) -> None:
        t0 = run.started_mono
        for o in later:
            await asyncio.sleep(max(0.0, t0 + o.after - time.monotonic()))
            logs.write(o.stream, o.line.encode() + b"\n")
            for io in run.attached:
                await _send(io, o.stream, o.line.encode() + b"\n")
        period = run.program.repeat_every
        while period:
            t0 += period
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            for o in run.program.output:
                logs.write(o.stream, o.line.encode() + b"\n")
                for io in run.attached:
                    await _send(io, o.stream, o.line.encode() + b"\n")
        if run.program.exit_after is None:
            return
        await asyncio.sleep(max(0.0, t0 + run.program.exit_after - time.monotonic()))
        self._finish(cid, ExitInfo(exit_code=run.program.exit_code, finished_at=self.clock()))

    def _finish(self, cid: str, info: ExitInfo) -> None:
        run = self._running.pop(cid, None)
        if run is None:
            return
        run.exited.set()
        if self.events is not None:
            self.events.container_exited(cid, info)

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        await self._enter("stop_container", container.id, timeout)
        run = self._running.get(container.id)
        if run is None:
            return ExitInfo(exit_code=0, finished_at=self.clock(), reason="Completed")
        if run.program.ignore_sigterm and timeout > 0:
            try:
                await asyncio.wait_for(run.exited.wait(), timeout)
            except TimeoutError:
                pass
            if container.id not in self._running:
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

    async def remove_container(self, container: ContainerRecord) -> None:
        await self._enter("remove_container", container.id)
        run = self._running.pop(container.id, None)
        if run is not None and run.task is not None:
            run.task.cancel()
        self._containers.discard(container.id)

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str], timeout: float) -> ExecResult:
        await self._enter("exec_sync", container.id, tuple(cmd), timeout)
        result, delay = self._exec(container, cmd)
        if timeout > 0 and delay > timeout:
            await asyncio.sleep(timeout)
            raise errors.DeadlineExceededError(f"command {list(cmd)!r} timed out after {timeout:g}s")
        if delay:
            await asyncio.sleep(delay)
        return result

    def _exec(self, container: ContainerRecord, cmd: Sequence[str]) -> tuple[ExecResult, float]:
        for rule_cmd, res, delay in self._exec_rules:
            if list(cmd) == rule_cmd or (
                rule_cmd[-1] == "*" and list(cmd[: len(rule_cmd) - 1]) == rule_cmd[:-1]
            ):
                return res, delay
        r = run_shell(cmd, self._shell_context(container))
        return ExecResult(exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr), r.sleep

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        await self._enter("update_container_resources", container.id, resources)

    # ------------------------------------------------------------------ stats
    def _container_stats(self, c: ContainerRecord, now: int) -> pb.ContainerStats:
        st = container_stats_of(c)
        run = self._running.get(c.id)
        seconds = (time.monotonic() - run.started_mono) if run is not None else 0.0
        # Plausible growth: 5% of a core, memory that settles logarithmically.
        seed = int(c.id[:4], 16)
        st.cpu.timestamp = now
        st.cpu.usage_core_nano_seconds.value = int(seconds * 0.05e9)
        st.cpu.usage_nano_cores.value = int(0.05e9) if run is not None else 0
        base = (4 + seed % 16) << 20
        ws = int(base + (1 << 20) * math.log1p(seconds)) if run is not None else 0
        st.memory.timestamp = now
        st.memory.working_set_bytes.value = ws
        st.memory.usage_bytes.value = ws + (1 << 20)
        st.memory.rss_bytes.value = ws
        st.memory.page_faults.value = int(seconds * 10)
        st.writable_layer.timestamp = now
        st.writable_layer.fs_id.mountpoint = self._state_dir or "/"
        st.writable_layer.used_bytes.value = 4096 + int(seconds) * 512
        st.writable_layer.inodes_used.value = 3 + int(seconds) // 60
        return st

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, pb.ContainerStats]:
        await self._enter("container_stats", len(containers))
        now = self.clock()
        return {c.id: self._container_stats(c, now) for c in containers}

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, pb.PodSandboxStats]:
        await self._enter("sandbox_stats", len(sandboxes))
        now = self.clock()
        by_sb: dict[str, list[ContainerRecord]] = collections.defaultdict(list)
        for c in containers:
            by_sb[c.sandbox_id].append(c)
        out = {}
        for sb in sandboxes:
            st = sandbox_stats_of(sb)
            lin = st.linux
            cpu = mem = 0
            for c in by_sb.get(sb.id, []):
                cs = self._container_stats(c, now)
                lin.containers.append(cs)
                cpu += cs.cpu.usage_core_nano_seconds.value
                mem += cs.memory.working_set_bytes.value
            lin.cpu.timestamp = now
            lin.cpu.usage_core_nano_seconds.value = cpu
            lin.memory.timestamp = now
            lin.memory.working_set_bytes.value = mem
            lin.process.timestamp = now
            lin.process.process_count.value = sum(1 for c in by_sb.get(sb.id, []) if c.id in self._running)
            lin.network.timestamp = now
            iface = lin.network.default_interface
            iface.name = "eth0"
            iface.rx_bytes.value = cpu // 1000
            iface.tx_bytes.value = cpu // 2000
            out[sb.id] = st
        return out

    # ------------------------------------------------------------------ streaming
    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        await self._enter("exec", container.id, tuple(cmd))
        interactive = list(cmd) in (["sh"], ["/bin/sh"], ["bash"], ["/bin/bash"]) and io.stdin
        if interactive:
            return await self._interactive_shell(container, io)
        result, delay = self._exec(container, cmd)
        shell = run_shell(cmd, self._shell_context(container))
        if result.stdout:
            await _send(io, "stdout", result.stdout)
        if result.stderr:
            await _send(io, "stderr", result.stderr)
        if shell.reads_stdin and io.stdin:
            while data := await io.read_stdin():
                await _send(io, "stdout", data)
        if delay:
            await asyncio.sleep(delay)
        return result.exit_code

    async def _interactive_shell(self, container: ContainerRecord, io: StreamIO) -> int:
        buf = b""
        code = 0
        while True:
            data = await io.read_stdin()
            if not data:
                return code
            if io.tty:
                await _send(io, "stdout", data.replace(b"\r", b"\r\n"))
            buf += data.replace(b"\r", b"\n")
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode(errors="replace").strip()
                if not text:
                    continue
                res, delay = self._exec(container, ["sh", "-c", text])
                if delay:
                    await asyncio.sleep(delay)
                out = res.stdout.replace(b"\n", b"\r\n") if io.tty else res.stdout
                if out:
                    await _send(io, "stdout", out)
                if res.stderr:
                    await _send(io, "stdout" if io.tty else "stderr", res.stderr)
                code = res.exit_code
                if text.split()[0] == "exit":
                    return code

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        await self._enter("attach", container.id)
        run = self._running.get(container.id)
        if run is None:
            raise errors.FailedPreconditionError(f"container {container.id} is not running")
        run.attached.append(io)
        try:
            if io.stdin and container.config.stdin:
                # Attached stdin is echoed back, as `cat` would do as the container's program.
                while data := await io.read_stdin():
                    await _send(io, "stdout", data)
                    if container.config.stdin_once:
                        break
            else:
                await run.exited.wait()
        finally:
            run.attached.remove(io)

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        await self._enter("port_forward", sandbox.id, port)
        responder = self.options.get("port_responses", {}).get(str(port))
        if responder is not None:
            await stream.write(str(responder).encode())
            return
        # Echo, by default: what is sent comes back.
        while data := await stream.read():
            await stream.write(data)

    # ------------------------------------------------------------------ images
    def _image_id(self, ref: Reference) -> str:
        rule = self._rule(ref)
        if "id" in rule:
            return str(rule["id"])
        # All tags of one repository path are one image, on every registry (a
        # mirror such as k8s.gcr.io/pause serves registry.k8s.io/pause), except
        # the pinned sandbox image, which stays apart from other tags of its
        # repository. A rule with an `id` decides otherwise.
        if ref.tagged and ref.tagged == self._pause_ref:
            return "sha256:" + hashlib.sha256(ref.tagged.encode()).hexdigest()
        path = ref.path
        return "sha256:" + hashlib.sha256(path.encode()).hexdigest()

    def _rule(self, ref: Reference) -> dict[str, Any]:
        return self._image_rules.get(ref.tagged) or self._image_rules.get(ref.repository) or {}

    def _add_image(self, ref: Reference) -> FakeImage:
        iid = self._image_id(ref)
        img = self._images.get(iid)
        rule = self._rule(ref)
        if img is None:
            seed = int(iid[7:15], 16)
            img = FakeImage(
                id=iid,
                repo_tags=[],
                repo_digests=[],
                size=int(rule.get("size", (1 + seed % 64) << 20)),
                uid=int(rule["uid"]) if "uid" in rule else (None if "username" in rule else 0),
                username=str(rule.get("username", "")),
            )
            self._images[iid] = img
        if ref.tag and ref.tagged not in img.repo_tags:
            img.repo_tags.append(ref.tagged)
        digest = ref.digest or "sha256:" + hashlib.sha256(iid.encode()).hexdigest()
        dref = f"{ref.repository}@{digest}"
        if dref not in img.repo_digests:
            img.repo_digests.append(dref)
        return img

    @staticmethod
    def _display_name(requested: str, img: FakeImage) -> str:
        """The image as the client named it, normalised, when that name is one of the image's."""
        try:
            name = parse(requested).name
        except BadReference:
            name = ""
        if name in img.repo_tags or name in img.repo_digests:
            return name
        return img.repo_tags[0] if img.repo_tags else requested

    def _find_image(self, name: str) -> FakeImage | None:
        img = self._images.get(name) or self._images.get("sha256:" + name)
        if img is not None:
            return img
        if len(name) >= 12 and all(ch in "0123456789abcdef" for ch in name.removeprefix("sha256:")):
            matches = [
                i
                for i in self._images.values()
                if i.id.removeprefix("sha256:").startswith(name.removeprefix("sha256:"))
            ]
            if len(matches) == 1:
                return matches[0]
        try:
            ref = parse(name)
        except BadReference:
            return None
        for img in self._images.values():
            if (ref.digest and ref.name in img.repo_digests) or (
                not ref.digest and ref.tagged in img.repo_tags
            ):
                return img
        return None

    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        await self._enter("pull_image", image.image)
        self.pulls.append((image.image, auth))
        if self._pull_seconds:
            await asyncio.sleep(self._pull_seconds)
        try:
            ref = parse(image.image)
        except BadReference as exc:
            raise errors.InvalidArgumentError(str(exc)) from None
        if any(fnmatch.fnmatch(ref.name, p) or fnmatch.fnmatch(image.image, p) for p in self._missing_images):
            raise errors.NotFoundError(f"image {image.image!r} not found in the (fake) registry")
        img = self._add_image(ref)
        self._save_images()
        return img.id

    async def list_images(self) -> list[pb.Image]:
        await self._enter("list_images")
        return [i.to_pb() for i in self._images.values()]

    async def image_status(self, image: pb.ImageSpec) -> pb.Image | None:
        await self._enter("image_status", image.image)
        found = self._find_image(image.image)
        return found.to_pb() if found is not None else None

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await self._enter("remove_image", image.image)
        found = self._find_image(image.image)
        if found is not None:
            self._images.pop(found.id, None)
            self._save_images()

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        await self._enter("image_fs_info")
        now = self.clock()
        resp = pb.ImageFsInfoResponse()
        if not self._state_dir:
            return resp  # nothing on disk: no filesystem of its own to report
        # The simulated store lives in the state directory (images.json): an existing
        # directory the kubelet can take the filesystem's capacity from; the usage is simulated.
        fs = resp.image_filesystems.add(timestamp=now)
        fs.fs_id.mountpoint = self._state_dir
        fs.used_bytes.value = sum(i.size for i in self._images.values())
        fs.inodes_used.value = len(self._images) * 100
        cfs = resp.container_filesystems.add(timestamp=now)
        cfs.fs_id.mountpoint = self._state_dir
        cfs.used_bytes.value = 4096 * len(self._containers)
        cfs.inodes_used.value = 3 * len(self._containers)
        return resp

    # The image store is the only state of the fake that must outlive the
    # process: a real runtime keeps its images across a shim restart.
    def _images_path(self) -> str:
        return os.path.join(self._state_dir, "images.json") if self._state_dir else ""

    def _save_images(self) -> None:
        path = self._images_path()
        if not path:
            return
        os.makedirs(self._state_dir, exist_ok=True)
        data = json.dumps([dataclasses.asdict(i) for i in self._images.values()]).encode()
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _load_images(self) -> None:
        path = self._images_path()
        if not path or not os.path.exists(path):
            return
        try:
            with open(path, "rb") as f:
                for d in json.loads(f.read()):
                    img = FakeImage(**d)
                    self._images[img.id] = img
        except (OSError, ValueError, TypeError):
            os.replace(path, path + ".corrupt")


async def _send(io: StreamIO, stream: str, data: bytes) -> None:
    if stream == "stderr" and io.stderr and not io.tty:
        await io.write_stderr(data)
    elif io.stdout:
        await io.write_stdout(data)


def _env(envs: Sequence[pb.KeyValue]) -> dict[str, str]:
    return {kv.key: kv.value.decode(errors="replace") for kv in envs}
