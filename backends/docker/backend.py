"""DockerBackend: CRI pods and containers on a Docker Engine.

A sandbox is a pause container; app containers join its network, IPC and
UTS namespaces. The engine container ID of each record is kept in
``record.backend_data["engine_id"]`` and every engine container carries
its CRI ID in a label (see :mod:`.labels`).
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import structlog

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
    SandboxStatus,
    StreamIO,
    TerminalSize,
    container_stats_of,
    sandbox_stats_of,
)
from backends.contract.errors import (
    AlreadyExistsError,
    CriError,
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
)
from backends.linux import cgroups, metrics
from backends.linux.usage import dir_usage
from cri_api import api_pb2 as pb

from . import convert, streams
from . import labels as lbl
from .engine import EngineClient, RawResponse
from .images import Images
from .netns import NetnsSocketFactory

log = structlog.get_logger(__name__)

ENGINE_ID = "engine_id"
PID = "pid"
RESOLV = "resolv_conf"
UPPER_DIR = "upper_dir"

_STOP_PAUSE_TIMEOUT = 10  # s; pause exits at once on SIGTERM
_LOG_DRAIN_WAIT = 2.0  # s to let a follower write the last output before an exit is reported
_EXIT_RECHECK = 1.0  # s between looks at a container that died while the engine did not answer
_RESUME_OVERLAP_NS = 2_000_000_000  # a resumed log read goes back this far (see _pump_logs)
_Marks = dict[str, tuple[int, int]]  # per stream: time of the last record written, records at that time


def engine_time(ns: int) -> str:
    """A time (ns since the epoch) as the engine's ``since`` parameter takes it, exactly.

    A float of seconds keeps only about a quarter of a microsecond: resuming a
    log at such a time repeats or skips lines written within it.
    """
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def parse_time(value: str | None) -> int:
    """Engine RFC 3339 time (nanosecond precision, UTC) -> ns since the epoch; 0 for the zero time."""
    if not value or value.startswith("0001-"):
        return 0
    value = value.rstrip("Z")
    for sign in ("+", "-"):
        idx = value.rfind(sign)
        if idx > 10:
            value = value[:idx]  # the engine reports UTC; a "+00:00" suffix carries nothing
    main, _, frac = value.partition(".")
    secs = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
    return secs * 1_000_000_000 + int((frac + "000000000")[:9] or 0)


def exit_info(state: dict[str, Any]) -> ExitInfo:
    code = int(state.get("ExitCode") or 0)
    if state.get("OOMKilled"):
        reason = "OOMKilled"
    elif code == 0:
        reason = "Completed"
    else:
        reason = "Error"
    finished = parse_time(state.get("FinishedAt")) or time.time_ns()
    # The engine stamps StartedAt after the process runs, so a very short one
    # can seem to finish before it started.
    finished = max(finished, parse_time(state.get("StartedAt")))
    return ExitInfo(
        exit_code=code,
        finished_at=finished,
        reason=reason,
        message=str(state.get("Error") or ""),
    )


def _engine_id(record: SandboxRecord | ContainerRecord) -> str:
    eid = record.backend_data.get(ENGINE_ID)
    if not eid:
        kind = "sandbox" if isinstance(record, SandboxRecord) else "container"
        raise NotFoundError(f"{kind} {record.id} has no engine container")
    return str(eid)


class DockerBackend:
    """The ``docker`` runtime handler."""

    capabilities = (
        Capability.EXEC_SYNC
        | Capability.EXEC
        | Capability.ATTACH
        | Capability.PORT_FORWARD
        | Capability.STATS
        | Capability.METRICS
        | Capability.UPDATE_RESOURCES
        | Capability.IMAGES
        | Capability.HOST_NETWORK
    )

    def __init__(
        self,
        name: str,
        *,
        endpoint: str = "unix:///var/run/docker.sock",
        pause_image: str = "registry.k8s.io/pause:3.10",
        network: str = "bridge",
        runtimes: dict[str, str] | None = None,
        pull_no_progress_timeout: float = 120.0,
        cgroup_parent: str = "",
        call_timeout: float = 60.0,
        instance: str = "",
        cgroup_driver: str = "",
    ) -> None:
        self.name = name
        self.instance = instance or name
        self.network = network
        self.runtimes = dict(runtimes or {})
        self.cgroup_parent = cgroup_parent
        self.engine = EngineClient(endpoint, call_timeout=call_timeout)
        self.images = Images(self.engine, pause_image, pull_no_progress_timeout)
        self.facts = convert.probe_host()
        self._cgroups = cgroups.CgroupReader()
        self._netns = NetnsSocketFactory()
        self._events: EventSink | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._followers: dict[str, asyncio.Task[None]] = {}  # CRI container ID -> its output pump
        self._follows: dict[str, _LogFollow] = {}  # CRI container ID -> its pump's open stream
        self._oom: set[str] = set()  # CRI IDs the engine reported an OOM kill in
        self._stopping: set[str] = set()  # CRI IDs being stopped on request: their exits are not events
        self._watched: dict[str, str] = {}  # CRI ID -> engine ID of running objects, to catch missed exits
        self._sandbox_ids: set[str] = set()  # which watched IDs are sandboxes (for one that vanished)
        self._reporting: set[str] = set()  # CRI IDs whose exit is being looked into
        self._retrying: set[str] = set()  # CRI IDs to look at again once the engine answers
        self._hugetlb_said: set[str] = set()  # reasons hugepage limits were passed over, logged once
        self._cpu_prev: dict[str, tuple[int, int]] = {}  # CRI ID -> (timestamp, cpu ns)
        self._layer_usage: dict[str, tuple[float, int, int]] = {}  # CRI ID -> (when, bytes, inodes)
        self._cgroup_driver = pb.SYSTEMD if cgroup_driver == "systemd" else pb.CGROUPFS
        self._pause_present = (
            False  # checked (pulled if needed) once, then trusted until a create says otherwise
        )
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self, events: EventSink) -> None:
        self._events = events
        with contextlib.suppress(CriError):
            info = await self.engine.call(self.engine.api.info, deadline=10)
            driver = info.get("CgroupDriver")
            if driver in ("systemd", "cgroupfs"):
                self._cgroup_driver = pb.SYSTEMD if driver == "systemd" else pb.CGROUPFS
        self._spawn(self._watch_events())

    async def close(self) -> None:
        self._closed = True
        for f in list(self._followers.values()):
            f.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, *self._followers.values(), return_exceptions=True)
        self._followers.clear()
        self._netns.close()
        await self.engine.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def health(self) -> Health:
        try:
            await self.engine.request("GET", "/_ping", deadline=5)
        except CriError as exc:
            return Health(False, False, reason="DockerDaemonNotReady", message=exc.message)
        return Health(True, True)

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=self._cgroup_driver))

    def _runtime(self, handler: str) -> str | None:
        return self.runtimes.get(handler) or self.runtimes.get("") or None

    # ---------------------------------------------------------------- engine helpers

    async def _inspect(self, engine_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.engine.request("GET", f"/containers/{engine_id}/json")
        return result

    async def _remove(self, engine_id: str) -> None:
        # A stopped container (the usual case: the kubelet stops before it removes)
        # goes without force, which costs the engine a kill attempt (~3 ms);
        # a running one is refused with 409 and then forced.
        with contextlib.suppress(NotFoundError):
            try:
                await self.engine.request("DELETE", f"/containers/{engine_id}", {"v": True})
            except (FailedPreconditionError, AlreadyExistsError):
                await self.engine.request("DELETE", f"/containers/{engine_id}", {"v": True, "force": True})

    async def _create(self, name: str, cfg: dict[str, Any], data: dict[str, Any]) -> str:
        """Create an engine container and note its ID in ``data`` (a record's backend_data).

        A leftover of the same name (a crash mid-create) is replaced. If the
        call is cancelled (the client gave up), the engine still finishes a
        create it has received: its answer is awaited all the same, so that
        the record knows the ID and the rollback removes the container.
        """

        async def create() -> str:
            try:
                created = await self.engine.request("POST", "/containers/create", {"name": name}, cfg)
            except AlreadyExistsError:
                await self._remove(name)
                created = await self.engine.request("POST", "/containers/create", {"name": name}, cfg)
            return str(created["Id"])

        task = asyncio.ensure_future(create())
        try:
            data[ENGINE_ID] = await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.engine.call_timeout):
                    data[ENGINE_ID] = await task
            raise
        return str(data[ENGINE_ID])

    async def _ours(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = await self.engine.request(
            "GET", "/containers/json", {"all": True, "filters": lbl.ours(self.instance)}
        )
        return rows

    # ---------------------------------------------------------------- recovery

    async def recover(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[dict[str, Observed], dict[str, Observed]]:
        rows = await self._ours()
        by_id = {(r.get("Labels") or {}).get(lbl.ID, ""): r for r in rows}
        records: dict[str, SandboxRecord | ContainerRecord] = {r.id: r for r in sandboxes}
        records.update((r.id, r) for r in containers)
        # Leftovers: engine objects no record claims, or whose record was never committed.
        for cri_id, row in by_id.items():
            rec = records.get(cri_id)
            if rec is None or not rec.committed:
                log.info("removing leftover engine container", cri_id=cri_id, engine_id=row["Id"][:12])
                await self._remove(row["Id"])
        claimed = [r for r in records.values() if r.committed and r.id in by_id]
        found = await asyncio.gather(
            *(self._inspect(by_id[r.id]["Id"]) for r in claimed), return_exceptions=True
        )
        infos: dict[str, dict[str, Any]] = {}
        for rec, info in zip(claimed, found, strict=True):
            if isinstance(info, NotFoundError):
                continue  # removed between the list and the inspect
            if isinstance(info, BaseException):
                raise info
            rec.backend_data[ENGINE_ID] = info["Id"]
            infos[rec.id] = info
        sb_seen: dict[str, Observed] = {}
        for sb in sandboxes:
            info = infos.get(sb.id, {})
            if not info:
                sb_seen[sb.id] = Observed(exists=False)
                continue
            running = bool(info["State"].get("Running"))
            if running:
                sb.backend_data[PID] = int(info["State"].get("Pid") or 0)
                self._watched[sb.id] = info["Id"]
                self._sandbox_ids.add(sb.id)
            sb_seen[sb.id] = Observed(
                exists=True,
                running=running,
                started_at=parse_time(info["State"].get("StartedAt")),
                status=SandboxStatus(
                    ready=running,
                    ip=sb.status.ip or ("" if convert.sandbox_host_network(sb.config) else self._ip_of(info)),
                    additional_ips=sb.status.additional_ips,
                ),
            )
        ct_seen: dict[str, Observed] = {}
        for ct in containers:
            info = infos.get(ct.id, {})
            if not info:
                ct_seen[ct.id] = Observed(exists=False)
                continue
            state = info["State"]
            running = bool(state.get("Running"))
            started = parse_time(state.get("StartedAt"))
            exited = exit_info(state) if not running and started else None
            if running:
                ct.backend_data[PID] = int(state.get("Pid") or 0)
                self._watched[ct.id] = info["Id"]
                sink = self._events.log_sink(ct.id) if self._events else None
                if sink is not None and ct.id not in self._followers:
                    # Resume after the last records the shim wrote before it went
                    # down; with none, all of the output is still to be written.
                    marks = await self.engine.run(functools.partial(_last_log_marks, ct.log_path))
                    tty = bool(info["Config"].get("Tty"))
                    self._follow(ct.id, info["Id"], tty, sink, marks)
            ct_seen[ct.id] = Observed(exists=True, running=running, exit=exited, started_at=started)
        return sb_seen, ct_seen

    # ---------------------------------------------------------------- sandboxes

    def _ip_of(self, info: dict[str, Any]) -> str:
        settings = info.get("NetworkSettings") or {}
        networks = settings.get("Networks") or {}
        net: dict[str, Any] = networks.get(self.network) or next(iter(networks.values()), {})
        return str((net or {}).get("IPAddress") or settings.get("IPAddress") or "")

    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        config = sandbox.config
        image = self.images.pause_image
        if not self._pause_present:
            await self.images.ensure(image)
            self._pause_present = True
        cfg = convert.sandbox_config(
            sandbox.id,
            sandbox.handler,
            sandbox.created_at,
            config,
            image=image,
            network=self.network,
            runtime=self._runtime(sandbox.handler),
            cgroup_parent=self.cgroup_parent,
            instance=self.instance,
        )
        name = lbl.sandbox_name(sandbox.id, config)
        try:
            engine_id = await self._create(name, cfg, sandbox.backend_data)
        except NotFoundError:
            # The pause image was removed since we last looked.
            await self.images.ensure(image)
            engine_id = await self._create(name, cfg, sandbox.backend_data)
        try:
            await self.engine.request("POST", f"/containers/{engine_id}/start")
            info = await self._inspect(engine_id)
            if config.HasField("dns_config"):
                path = str(info.get("ResolvConfPath") or "")
                if path:
                    content = convert.resolv_conf(config.dns_config)
                    await self.engine.run(lambda: _write_file(path, content))
                    sandbox.backend_data[RESOLV] = path
            sandbox.backend_data[PID] = int(info["State"].get("Pid") or 0)
            host_net = convert.sandbox_host_network(config)
            ip = "" if host_net else self._ip_of(info)
        except BaseException:
            await asyncio.shield(self._remove(engine_id))
            sandbox.backend_data.pop(ENGINE_ID, None)
            raise
        self._watched[sandbox.id] = engine_id
        self._sandbox_ids.add(sandbox.id)
        return SandboxNetwork(ip=ip)

    async def stop_sandbox(self, sandbox: SandboxRecord) -> None:
        eid = sandbox.backend_data.get(ENGINE_ID)
        if not eid:
            return
        self._stopping.add(sandbox.id)
        self._watched.pop(sandbox.id, None)
        try:
            await self._stop_engine(str(eid), _STOP_PAUSE_TIMEOUT)
        except NotFoundError:
            pass
        finally:
            self._stopping.discard(sandbox.id)

    async def _stop_engine(self, engine_id: str, grace: int) -> None:
        # The SDK waits timeout + its own call timeout for the answer; so do we.
        grace = max(0, grace)
        await self.engine.request(
            "POST", f"/containers/{engine_id}/stop", {"t": grace}, deadline=grace + self.engine.call_timeout
        )

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        eid = sandbox.backend_data.get(ENGINE_ID) or await self._engine_id_of(sandbox.id)
        self._watched.pop(sandbox.id, None)
        self._sandbox_ids.discard(sandbox.id)
        if eid:
            await self._remove(str(eid))

    # ---------------------------------------------------------------- containers

    async def _engine_id_of(self, cri_id: str) -> str:
        rows: list[dict[str, Any]] = await self.engine.request(
            "GET",
            "/containers/json",
            {"all": True, "filters": {"label": [f"{lbl.ID}={cri_id}", f"{lbl.INSTANCE}={self.instance}"]}},
        )
        return str(rows[0]["Id"]) if rows else ""

    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        config = container.config
        ref = container.image_ref or config.image.image
        try:
            container.image_ref = await self.images.resolve(ref)
        except NotFoundError as exc:
            raise NotFoundError(f"image {ref!r} not found") from exc
        pause_id = sandbox.backend_data.get(ENGINE_ID)
        if not pause_id:
            raise FailedPreconditionError(f"sandbox {sandbox.id} has no pause container")
        ns = config.linux.security_context.namespace_options
        target = await self._engine_id_of(ns.target_id) if ns.pid == pb.TARGET and ns.target_id else ""
        cfg = convert.container_config(
            container.id,
            container.sandbox_id,
            container.created_at,
            config,
            sandbox.config,
            image_id=container.image_ref,
            image_name=container.image_name or config.image.image,
            log_path=container.log_path,
            pause_engine_id=str(pause_id),
            target_engine_id=target,
            runtime=self._runtime(sandbox.handler),
            cgroup_parent=self.cgroup_parent,
            facts=self.facts,
            instance=self.instance,
        )
        resolv = sandbox.backend_data.get(RESOLV)
        if resolv and convert.sandbox_host_network(sandbox.config):
            # With the host's network each container gets its own copy of the
            # host's resolv.conf; the pod's DNS config lives in the pause one.
            cfg["HostConfig"]["Binds"].append(f"{resolv}:/etc/resolv.conf:ro")
        await self._create(lbl.container_name(container.id, config), cfg, container.backend_data)

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord, logs: LogSink) -> int:
        eid = _engine_id(container)
        await self.engine.request("POST", f"/containers/{eid}/start")
        info = await self._inspect(eid)
        state = info["State"]
        container.backend_data[PID] = int(state.get("Pid") or 0)
        # Informational, kept by the shim across the status it sets next.
        container.status = dataclasses.replace(container.status, pid=container.backend_data[PID])
        upper = ((info.get("GraphDriver") or {}).get("Data") or {}).get("UpperDir")
        if upper:
            container.backend_data[UPPER_DIR] = upper
        started = parse_time(state.get("StartedAt")) or time.time_ns()
        if state.get("Running"):
            try:
                await self._apply_hugepages(container, eid, container.config.linux.resources)
            except FailedPreconditionError:
                # The container must not run without the limits it asked for.
                with contextlib.suppress(CriError):
                    await self._stop_engine(eid, 0)
                raise
        self._watched[container.id] = eid
        self._follow(container.id, eid, bool(info["Config"].get("Tty")), logs, None)
        if not state.get("Running") and parse_time(state.get("FinishedAt")):
            # Exited before we looked: the die event may have come before we watched it.
            self._spawn(self._report_exit(container.id, eid))
        return started

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        eid = _engine_id(container)
        self._stopping.add(container.id)
        try:
            with contextlib.suppress(NotFoundError):
                await self._stop_engine(eid, timeout)
            # The exit status and the end of the output are awaited together.
            inspected, _ = await asyncio.gather(
                self._inspect(eid), self._drain_logs(container.id, stopped=True), return_exceptions=True
            )
            if isinstance(inspected, NotFoundError):
                return ExitInfo(exit_code=137, finished_at=time.time_ns(), reason="Error", message="gone")
            if isinstance(inspected, BaseException):
                raise inspected
            return exit_info(inspected["State"])
        finally:
            self._watched.pop(container.id, None)
            self._stopping.discard(container.id)

    async def remove_container(self, container: ContainerRecord) -> None:
        f = self._followers.pop(container.id, None)
        if f is not None:
            f.cancel()
        self._watched.pop(container.id, None)
        self._oom.discard(container.id)
        self._cpu_prev.pop(container.id, None)
        self._layer_usage.pop(container.id, None)
        # Without an engine ID (a create that failed or was given up), look the container up by its label.
        eid = container.backend_data.get(ENGINE_ID) or await self._engine_id_of(container.id)
        if eid:
            await self._remove(str(eid))

    async def _apply_hugepages(
        self, container: ContainerRecord, eid: str, resources: pb.LinuxContainerResources
    ) -> None:
        """Hugepage limits, written into the cgroup of the running container (the engine has none)."""
        limits = [(h.page_size, h.limit) for h in resources.hugepage_limits]
        pid = int(container.backend_data.get(PID) or 0)
        if not limits or not pid:
            return
        work = functools.partial(self._cgroups.set_hugetlb, pid, eid, limits)
        try:
            skipped = await self.engine.run(work)
        except cgroups.HugetlbError as exc:
            raise FailedPreconditionError(f"hugepage limits of container {container.id}: {exc}") from exc
        for why in skipped:
            # The kubelet asks for limits on every container: say each reason once.
            if why not in self._hugetlb_said:
                self._hugetlb_said.add(why)
                log.warning("hugepage limits not applied", container_id=container.id, reason=why)

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        eid = _engine_id(container)
        if container.status.state == pb.CONTAINER_RUNNING:
            await self._apply_hugepages(container, eid, resources)
        res = convert.resources(resources)
        await self.engine.call(
            self.engine.api.update_container,
            eid,
            cpu_period=res["CpuPeriod"] or None,
            cpu_quota=res["CpuQuota"] or None,
            cpu_shares=res["CpuShares"] or None,
            mem_limit=res["Memory"] or None,
            memswap_limit=res.get("MemorySwap") or None,
            cpuset_cpus=res["CpusetCpus"] or None,
            cpuset_mems=res["CpusetMems"] or None,
        )

    # ---------------------------------------------------------------- exec

    async def _exec_create(self, eid: str, cmd: Sequence[str], stdin: bool, tty: bool, stderr: bool) -> str:
        body = {
            "AttachStdin": stdin,
            "AttachStdout": True,
            "AttachStderr": stderr,
            "Tty": tty,
            "Cmd": list(cmd),
            "Privileged": False,
        }
        created = await self.engine.request("POST", f"/containers/{eid}/exec", body=body)
        return str(created["Id"])

    async def _exec_exit(self, exec_id: str) -> int:
        for _ in range(50):
            info = await self.engine.request("GET", f"/exec/{exec_id}/json")
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"])
            await asyncio.sleep(0.02)
        return int(info.get("ExitCode") or 0)

    async def _exec_kill(self, exec_id: str) -> None:
        with contextlib.suppress(CriError):
            info = await self.engine.request("GET", f"/exec/{exec_id}/json")
            pid = int(info.get("Pid") or 0)
            if info.get("Running") and pid:
                await self.engine.run(lambda: streams.kill_tree(pid))

    async def exec_sync(
        self,
        container: ContainerRecord,
        cmd: Sequence[str],
        timeout: float,
    ) -> ExecResult:
        eid = _engine_id(container)
        exec_id = await self._exec_create(eid, cmd, stdin=False, tty=False, stderr=True)
        resp = await self.engine.stream(
            "POST", f"/exec/{exec_id}/start", body={"Detach": False, "Tty": False}, upgrade=True
        )
        out, err = bytearray(), bytearray()

        async def collect() -> None:
            async for stream, data in resp.frames(False):
                (err if stream == "stderr" else out).extend(data)

        try:
            async with asyncio.timeout(timeout if timeout > 0 else None):
                await collect()
        except TimeoutError as exc:
            await self._exec_kill(exec_id)
            raise DeadlineExceededError(f"command {list(cmd)!r} timed out after {timeout}s") from exc
        except BaseException:
            await asyncio.shield(self._exec_kill(exec_id))
            raise
        finally:
            resp.close()
        return ExecResult(exit_code=await self._exec_exit(exec_id), stdout=bytes(out), stderr=bytes(err))

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        eid = _engine_id(container)
        exec_id = await self._exec_create(
            eid, cmd, stdin=io.stdin, tty=io.tty, stderr=io.stderr and not io.tty
        )
        resp = await self.engine.stream(
            "POST", f"/exec/{exec_id}/start", body={"Detach": False, "Tty": io.tty}, upgrade=True
        )

        async def resize(size: TerminalSize) -> None:
            await self.engine.request("POST", f"/exec/{exec_id}/resize", {"h": size.height, "w": size.width})

        try:
            await streams.pump(resp, io, resize)
        except BaseException:
            # The client went away: the process must not outlive its session.
            await asyncio.shield(self._exec_kill(exec_id))
            raise
        finally:
            resp.close()
        return await self._exec_exit(exec_id)

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        eid = _engine_id(container)
        query = {
            "stream": 1,
            "stdin": int(io.stdin),
            "stdout": int(io.stdout),
            "stderr": int(io.stderr),
            "logs": 0,
        }
        resp = await self.engine.stream("POST", f"/containers/{eid}/attach", query=query, upgrade=True)

        async def resize(size: TerminalSize) -> None:
            query = {"h": size.height, "w": size.width}
            await self.engine.request("POST", f"/containers/{eid}/resize", query)

        tty = bool((await self._inspect(eid))["Config"].get("Tty"))
        io_view = _TtyView(io, tty)
        try:
            await streams.pump(resp, io_view, resize)
        finally:
            resp.close()

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        eid = _engine_id(sandbox)
        pid = int(sandbox.backend_data.get(PID) or 0)
        if not pid or not await self.engine.run(lambda: os.path.exists(f"/proc/{pid}/ns/net")):
            info = await self._inspect(eid)
            pid = int(info["State"].get("Pid") or 0)
            if not pid:
                raise FailedPreconditionError(f"sandbox {sandbox.id} is not running")
            sandbox.backend_data[PID] = pid
        sock = await asyncio.wrap_future(self._netns.submit(pid))
        loop = asyncio.get_running_loop()
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
        except OSError as exc:
            sock.close()
            raise FailedPreconditionError(
                f"port {port} in sandbox {sandbox.id}: {exc.strerror or exc}"
            ) from exc
        reader, writer = await asyncio.open_connection(sock=sock)

        async def to_pod() -> None:
            while data := await stream.read():
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        async def from_pod() -> None:
            while data := await reader.read(65536):
                await stream.write(data)

        up = asyncio.create_task(to_pod())
        try:
            await from_pod()
        finally:
            if not up.done():
                up.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await up
            writer.close()

    # ---------------------------------------------------------------- stats

    def _sample(
        self, cri_id: str, record: ContainerRecord | SandboxRecord, full: bool = False
    ) -> cgroups.Sample | None:
        pid = int(record.backend_data.get(PID) or 0)
        eid = str(record.backend_data.get(ENGINE_ID) or "")
        if not pid or not eid:
            return None
        return self._cgroups.sample(pid, expect=eid, full=full)

    def _layer(self, container: ContainerRecord, now: int) -> pb.FilesystemUsage | None:
        upper = container.backend_data.get(UPPER_DIR)
        if not upper:
            return None
        cached = self._layer_usage.get(container.id)
        if cached is None or time.monotonic() - cached[0] > 30:
            used, inodes = dir_usage(str(upper), limit=200_000)
            cached = (time.monotonic(), used, inodes)
            self._layer_usage[container.id] = cached
        return pb.FilesystemUsage(
            timestamp=now,
            fs_id=pb.FilesystemIdentifier(mountpoint=str(upper)),
            used_bytes=pb.UInt64Value(value=cached[1]),
            inodes_used=pb.UInt64Value(value=cached[2]),
        )

    def _container_stats(self, ct: ContainerRecord) -> tuple[pb.ContainerStats, cgroups.Sample | None]:
        st = container_stats_of(ct)
        now = time.time_ns()
        sample = None if ct.status.finished_at else self._sample(ct.id, ct)
        if sample is not None:
            _fill_cpu_mem(st.cpu, st.memory, sample, self._cpu_prev.get(ct.id))
            if sample.cpu_ns is not None:
                self._cpu_prev[ct.id] = (sample.timestamp, sample.cpu_ns)
        else:
            st.cpu.timestamp = now
            st.memory.timestamp = now
        layer = self._layer(ct, now)
        if layer is not None:
            st.writable_layer.CopyFrom(layer)
        return st, sample

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, pb.ContainerStats]:
        def work() -> dict[str, pb.ContainerStats]:
            return {ct.id: self._container_stats(ct)[0] for ct in containers}

        return await self.engine.run(work)

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, pb.PodSandboxStats]:
        def work() -> dict[str, pb.PodSandboxStats]:
            out: dict[str, pb.PodSandboxStats] = {}
            for sb in sandboxes:
                ps = sandbox_stats_of(sb)
                now = time.time_ns()
                linux = ps.linux
                samples = []
                pause = self._sample(sb.id, sb) if sb.status.ready else None
                if pause is not None:
                    samples.append(pause)
                for ct in containers:
                    if ct.sandbox_id != sb.id:
                        continue
                    cs, sample = self._container_stats(ct)
                    linux.containers.append(cs)
                    if sample is not None:
                        samples.append(sample)
                total = _sum_samples(samples, now)
                _fill_cpu_mem(linux.cpu, linux.memory, total, self._cpu_prev.get(sb.id))
                if total.cpu_ns is not None:
                    self._cpu_prev[sb.id] = (total.timestamp, total.cpu_ns)
                linux.process.timestamp = now
                linux.process.process_count.value = total.pids or 0
                pid = int(sb.backend_data.get(PID) or 0)
                if pause is not None and pid and not convert.sandbox_host_network(sb.config):
                    ifaces = cgroups.net_interfaces(pid)
                    linux.network.timestamp = now
                    for i in ifaces:
                        nu = pb.NetworkInterfaceUsage(
                            name=i.name,
                            rx_bytes=pb.UInt64Value(value=i.rx_bytes),
                            rx_errors=pb.UInt64Value(value=i.rx_errors),
                            tx_bytes=pb.UInt64Value(value=i.tx_bytes),
                            tx_errors=pb.UInt64Value(value=i.tx_errors),
                        )
                        linux.network.interfaces.append(nu)
                        if i.name == "eth0":
                            linux.network.default_interface.CopyFrom(nu)
                out[sb.id] = ps
            return out

        return await self.engine.run(work)

    def _layer_metrics(self, ct: ContainerRecord, now: int) -> metrics.Layer | None:
        usage = self._layer(ct, now)
        if usage is None:
            return None
        upper = usage.fs_id.mountpoint
        try:
            st, vfs = os.stat(upper), os.statvfs(upper)
        except OSError:
            return None
        return metrics.Layer(
            device=cgroups.device_name(os.major(st.st_dev), os.minor(st.st_dev)),
            used_bytes=usage.used_bytes.value,
            capacity_bytes=vfs.f_blocks * vfs.f_frsize,
            inodes_total=vfs.f_files,
            inodes_free=vfs.f_ffree,
        )

    async def metric_descriptors(self) -> list[pb.MetricDescriptor]:
        return metrics.descriptors()

    async def sandbox_metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> list[pb.PodSandboxMetrics]:
        def work() -> list[pb.PodSandboxMetrics]:
            by_pod: dict[str, list[ContainerRecord]] = {}
            for ct in containers:
                by_pod.setdefault(ct.sandbox_id, []).append(ct)
            out = []
            for sb in sandboxes:
                md = sb.config.metadata
                pm = pb.PodSandboxMetrics(pod_sandbox_id=sb.id)
                pid = int(sb.backend_data.get(PID) or 0)
                if sb.status.ready and pid and not convert.sandbox_host_network(sb.config):
                    labels = (
                        "POD",
                        sb.id,
                        self.images.pause_image,
                        lbl.sandbox_name(sb.id, sb.config),
                        md.namespace,
                        md.name,
                    )
                    pm.metrics.extend(metrics.network_metrics(labels, cgroups.net_interfaces(pid)))
                for ct in by_pod.get(sb.id, ()):
                    if ct.status.state != pb.CONTAINER_RUNNING:
                        continue
                    sample = self._sample(ct.id, ct, full=True)
                    if sample is None:
                        continue
                    pid = int(ct.backend_data.get(PID) or 0)
                    detail = self._cgroups.detail(pid, expect=str(ct.backend_data.get(ENGINE_ID) or ""))
                    labels = (
                        ct.config.metadata.name,
                        ct.id,
                        ct.image_name or ct.config.image.image,
                        lbl.container_name(ct.id, ct.config),
                        md.namespace,
                        md.name,
                    )
                    found = metrics.container_metrics(
                        labels,
                        sample,
                        detail,
                        ct.status.started_at,
                        self._layer_metrics(ct, sample.timestamp),
                        cgroups.device_name,
                    )
                    pm.container_metrics.add(container_id=ct.id, metrics=found)
                out.append(pm)
            return out

        return await self.engine.run(work)

    # ---------------------------------------------------------------- images

    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        return await self.images.pull(image.image, auth)

    async def list_images(self) -> list[pb.Image]:
        return await self.images.list()

    async def image_status(self, image: pb.ImageSpec) -> pb.Image | None:
        return await self.images.status(image.image)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await self.images.remove(image.image)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return await self.images.fs_info()

    # ---------------------------------------------------------------- output

    def _follow(self, cri_id: str, engine_id: str, tty: bool, sink: LogSink, marks: _Marks | None) -> None:
        old = self._followers.pop(cri_id, None)
        if old is not None:
            old.cancel()
        task = asyncio.create_task(self._pump_logs(cri_id, engine_id, tty, sink, marks))
        self._followers[cri_id] = task

    async def _pump_logs(
        self, cri_id: str, engine_id: str, tty: bool, sink: LogSink, marks: _Marks | None
    ) -> None:
        """Copy the container's output into its sink until it exits; resume if the stream breaks.

        The engine ends a followed log stream some milliseconds after the
        container has stopped. When the container is known to have stopped,
        :meth:`_drain_logs` cuts the followed stream and the rest is read
        without following: by then the engine has written all of the output.

        A resumed read skips what was written already (:class:`LogResume`).
        Records are stamped with the engine's time (without a TTY), so that
        after a restart the log itself says where to resume (``marks``).
        """
        resume = LogResume(marks)
        follow = _LogFollow(tty=tty)
        self._follows[cri_id] = follow
        try:
            while True:
                final = follow.finishing
                query: dict[str, Any] = {
                    "follow": int(not final),
                    "stdout": 1,
                    "stderr": 1,
                    "timestamps": int(not tty),
                }
                since = resume.since(tty)
                if since is not None:
                    query["since"] = engine_time(since)
                try:
                    resp = await self.engine.stream("GET", f"/containers/{engine_id}/logs", query=query)
                except NotFoundError:
                    return
                except CriError:
                    await asyncio.sleep(1)
                    continue
                follow.resp = None if final else resp
                resume.reread()
                try:
                    async for stream, data in resp.frames(tty):
                        at = 0
                        if not tty:
                            # "RFC3339Nano content"
                            stamp, _, data = data.partition(b" ")
                            try:
                                at = parse_time(stamp.decode())
                            except (ValueError, UnicodeDecodeError):
                                at = 0
                            if not resume.fresh(stream, at):
                                continue
                        sink.write(stream, data, at)
                finally:
                    follow.resp = None
                    resp.close()
                if final:
                    return
                if follow.finishing:
                    continue  # cut by _drain_logs: the rest, without following
                if cri_id in self._stopping:
                    return  # stopped by us: the stream ended because the container did
                try:
                    info = await self._inspect(engine_id)
                except NotFoundError:
                    return
                except CriError:
                    await asyncio.sleep(1)
                    continue
                if not info["State"].get("Running"):
                    return
                if tty:
                    resume.newest = time.time_ns()
        finally:
            if self._follows.get(cri_id) is follow:
                del self._follows[cri_id]
            with contextlib.suppress(Exception):
                sink.close()

    async def _drain_logs(self, cri_id: str, stopped: bool) -> None:
        """Wait (a bounded time) until the container's output is all in its log.

        ``stopped``: the engine reports the container not running, so its
        output is complete on the engine's side and the followed stream can be
        cut short (see :meth:`_pump_logs`).
        """
        f = self._followers.get(cri_id)
        if f is None:
            return
        follow = self._follows.get(cri_id)
        # With a TTY the records carry no time to resume from: wait for the end.
        if stopped and follow is not None and not follow.tty:
            follow.finishing = True
            if follow.resp is not None:
                follow.resp.close()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
            async with asyncio.timeout(_LOG_DRAIN_WAIT):
                await asyncio.shield(f)

    # ---------------------------------------------------------------- events

    async def _watch_events(self) -> None:
        """Follow the engine's events; reconnect (catching up) when dockerd comes back.

        Container deaths become exits; image changes invalidate the image-ID
        cache, which is only trusted while this stream is connected.
        """
        since: int | None = None
        filters = json.dumps(
            {
                "type": ["container", "image"],
                "event": ["die", "oom", "tag", "untag", "delete", "pull", "import", "load"],
            }
        )
        while not self._closed:
            try:
                query: dict[str, Any] = {"filters": filters}
                if since is not None:
                    query["since"] = engine_time(since)
                resp = await self.engine.stream("GET", "/events", query=query)
            except CriError:
                await asyncio.sleep(1)
                continue
            self.images.trust_cache(True)
            # Anything that died while we were not listening.
            self._spawn(self._check_watched())
            try:
                async for ev in resp.json_lines():
                    since = int(ev.get("timeNano") or time.time_ns())
                    if ev.get("Type") == "image":
                        self.images.trust_cache(True)  # drops what it held
                        continue
                    attrs = (ev.get("Actor") or {}).get("Attributes") or {}
                    cri_id = attrs.get(lbl.ID, "")
                    if attrs.get(lbl.INSTANCE) != self.instance or not cri_id:
                        continue
                    if ev.get("Action", ev.get("status")) == "oom":
                        self._oom.add(cri_id)
                    elif cri_id not in self._stopping and cri_id in self._watched:
                        self._spawn(self._report_exit(cri_id, str(ev.get("id") or "")))
            finally:
                resp.close()
                self.images.trust_cache(False)
            await asyncio.sleep(0.2)

    async def _check_watched(self) -> None:
        for cri_id, eid in list(self._watched.items()):
            await self._report_exit(cri_id, eid, died=False)

    async def _report_exit(self, cri_id: str, engine_id: str, died: bool = True) -> None:
        """Report the end of a watched container or sandbox, once, if it has ended.

        ``died``: the engine said so (an event, or a start that found it
        exited); its state may lag a moment behind. Otherwise this is a check
        of something that may well be running.
        While the engine cannot be asked, the object stays watched and is
        looked at again every second (and when the event stream reconnects).
        """
        if cri_id not in self._watched or cri_id in self._stopping or cri_id in self._reporting:
            return
        if self._events is None:
            return
        self._reporting.add(cri_id)
        try:
            for _ in range(5 if died else 1):
                try:
                    state = (await self._inspect(engine_id))["State"]
                except NotFoundError:
                    state = {"Running": False, "ExitCode": 137, "Error": "container vanished from the engine"}
                except CriError:
                    if cri_id not in self._retrying:
                        self._retrying.add(cri_id)
                        self._spawn(self._report_exit_later(cri_id, engine_id))
                    return
                if not state.get("Running"):
                    break
                if died:
                    await asyncio.sleep(0.05)  # a die event can come before the engine's state says so
            else:
                return
            if self._watched.pop(cri_id, None) is None or cri_id in self._stopping:
                return  # stopped on request meanwhile: its exit is reported there
            if cri_id in self._sandbox_ids:
                self._sandbox_ids.discard(cri_id)
                self._events.sandbox_not_ready(cri_id, "pause container exited")
                return
            await self._drain_logs(cri_id, stopped=True)
            self._events.container_exited(cri_id, await self._exit_of(cri_id, state))
        finally:
            self._reporting.discard(cri_id)

    async def _report_exit_later(self, cri_id: str, engine_id: str) -> None:
        await asyncio.sleep(_EXIT_RECHECK)
        self._retrying.discard(cri_id)
        await self._report_exit(cri_id, engine_id, died=False)

    async def _exit_of(self, cri_id: str, state: dict[str, Any]) -> ExitInfo:
        """How it ended, OOM included: the engine's OOMKilled flag loses a race
        with the exit when the OOM event comes second, the oom event does not."""
        info = exit_info(state)
        if info.exit_code == 137 and info.reason != "OOMKilled":
            for _ in range(4):
                if cri_id in self._oom:
                    break
                await asyncio.sleep(0.05)
            if cri_id in self._oom:
                info = dataclasses.replace(info, reason="OOMKilled")
        self._oom.discard(cri_id)
        return info


class LogResume:
    """Which records of the engine's log a log pump has written, so that a re-read skips them.

    A re-read starts a little before the newest record written, because the
    engine's stdout and stderr copiers write to its log concurrently: a
    record may follow one of the other stream that is newer. Within one
    stream the times never go back (the pieces of a long line share one), so
    what a re-read repeats is known per stream: the records older than the
    last one written, and as many records of that very time as were written.
    """

    def __init__(self, marks: _Marks | None = None) -> None:
        marks = marks or {}
        # Per stream: [time of the last record written, records written at that time].
        self.marks = {name: list(marks.get(name, (0, 0))) for name in ("stdout", "stderr")}
        self.newest: int | None = max((at for at, _n in marks.values()), default=None)
        self._repeats = {name: 0 for name in self.marks}

    def since(self, tty: bool) -> int | None:
        """Where a (re)read starts; None: from the beginning."""
        if self.newest is None:
            return None
        # With a TTY the records carry no time: from just after the newest.
        return self.newest + 1 if tty else max(0, self.newest - _RESUME_OVERLAP_NS)

    def reread(self) -> None:
        """A read starts over: the records at each stream's mark come again."""
        self._repeats = {name: n for name, (_at, n) in self.marks.items()}

    def fresh(self, stream: str, at: int) -> bool:
        """Whether a record of ``stream`` at ``at`` (0: unknown) is new, and if so, count it."""
        if not at:
            return True
        mark = self.marks[stream]
        if at < mark[0]:
            return False
        if at == mark[0]:
            if self._repeats[stream] > 0:
                self._repeats[stream] -= 1
                return False
            mark[1] += 1
            return True
        mark[0], mark[1] = at, 1
        self._repeats[stream] = 0
        self.newest = max(self.newest or 0, at)
        return True


@dataclasses.dataclass
class _LogFollow:
    """A log pump's followed stream, and whether it is to finish without following."""

    tty: bool
    resp: RawResponse | None = None
    finishing: bool = False


class _TtyView:
    """A StreamIO whose tty flag is the container's (attach follows how it was created)."""

    def __init__(self, io: StreamIO, tty: bool) -> None:
        self._io = io
        self.stdin = io.stdin
        self.stdout = io.stdout
        self.stderr = io.stderr
        self.tty = tty

    async def read_stdin(self) -> bytes:
        return await self._io.read_stdin()

    async def write_stdout(self, data: bytes) -> None:
        await self._io.write_stdout(data)

    async def write_stderr(self, data: bytes) -> None:
        await self._io.write_stderr(data)

    def resizes(self) -> Any:
        return self._io.resizes()


def _sum_samples(samples: list[cgroups.Sample], now: int) -> cgroups.Sample:
    def total(attr: str) -> int | None:
        values = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return sum(values) if values else None

    return cgroups.Sample(
        timestamp=now,
        cpu_ns=total("cpu_ns"),
        memory_usage=total("memory_usage"),
        working_set=total("working_set"),
        rss=total("rss"),
        page_faults=total("page_faults"),
        major_page_faults=total("major_page_faults"),
        pids=total("pids"),
    )


def _fill_cpu_mem(
    cpu: pb.CpuUsage, mem: pb.MemoryUsage, s: cgroups.Sample, prev: tuple[int, int] | None
) -> None:
    cpu.timestamp = s.timestamp
    mem.timestamp = s.timestamp
    if s.cpu_ns is not None:
        cpu.usage_core_nano_seconds.value = s.cpu_ns
        if prev is not None and s.timestamp > prev[0] and s.cpu_ns >= prev[1]:
            cpu.usage_nano_cores.value = (s.cpu_ns - prev[1]) * 1_000_000_000 // (s.timestamp - prev[0])
    if s.working_set is not None:
        mem.working_set_bytes.value = s.working_set
    if s.memory_usage is not None:
        mem.usage_bytes.value = s.memory_usage
    if s.rss is not None:
        mem.rss_bytes.value = s.rss
    if s.page_faults is not None:
        mem.page_faults.value = s.page_faults
    if s.major_page_faults is not None:
        mem.major_page_faults.value = s.major_page_faults
    avail = cgroups.available(s)
    if avail is not None:
        mem.available_bytes.value = avail


def _last_log_marks(path: str) -> _Marks | None:
    """Where a CRI log file ends, per stream: (time of its last record, records at that time).

    Read from the last 64 KiB. A stream with no record there gets the time
    of the first record read and a count of 0: it wrote nothing since.
    None without any record.
    """
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read()
    except OSError:
        return None
    marks: dict[str, tuple[int, int]] = {}
    done: set[str] = set()
    first = 0
    for line in reversed(tail.splitlines()):
        parts = line.split(b" ", 2)
        if len(parts) < 2:
            continue
        try:
            at = parse_time(parts[0].decode())
            stream = parts[1].decode()
        except (ValueError, UnicodeDecodeError):
            continue
        if stream not in ("stdout", "stderr"):
            continue
        first = at
        if stream in done:
            continue
        mark = marks.get(stream)
        if mark is None:
            marks[stream] = (at, 1)
        elif mark[0] == at:
            marks[stream] = (at, mark[1] + 1)
        else:
            done.add(stream)
    if not marks:
        return None
    for stream in ("stdout", "stderr"):
        marks.setdefault(stream, (first, 0))
    return marks


def _write_file(path: str, content: str) -> None:
    tmp = f"{path}.crishim"
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, path)
