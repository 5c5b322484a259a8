"""The docker backend against a real engine: sandboxes, containers, logs, exec, stats, recovery."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import docker
import pytest

from backends.contract import Backend, ContainerRecord, SandboxStatus, TerminalSize
from backends.docker import create
from backends.docker import labels as lbl
from cri_api import api_pb2 as pb
from shim.cri.container_io import CriLogWriter, last_log_marks
from shim.cri.errors import CriError, DeadlineExceededError, NotFoundError, UnavailableError
from tests.as_shim import AsShim
from tests.docker.dockerkit import (
    BUSYBOX,
    ENDPOINT,
    INSTANCE,
    PAUSE,
    Events,
    Harness,
    HttpGet,
    container_record,
    new_backend,
    sandbox_record,
)

pytestmark = pytest.mark.docker


def log_records(path: Path) -> list[tuple[str, str, str]]:
    out = []
    for line in path.read_text().splitlines():
        _ts, stream, tag, content = line.split(" ", 3)
        out.append((stream, tag, content))
    return out


async def test_is_a_backend(harness: Harness) -> None:
    assert isinstance(harness.backend, Backend)
    health = await harness.backend.lifecycle.health()
    assert health.runtime_ready and health.network_ready
    assert harness.backend.lifecycle.runtime_config().linux.cgroup_driver in (pb.CGROUPFS, pb.SYSTEMD)


async def test_sandbox_run_stop_remove(harness: Harness) -> None:
    sb = sandbox_record(
        "web",
        dns_config=pb.DNSConfig(servers=["10.0.0.10"], searches=["svc.local"], options=["ndots:5"]),
        port_mappings=[pb.PortMapping(protocol=pb.TCP, container_port=80, host_port=0)],
    )
    await harness.run_sandbox(sb)
    assert sb.status.ip.count(".") == 3, sb.status.ip
    eid = sb.backend_data["engine_id"]
    info = harness.engine.inspect_container(eid)
    assert info["State"]["Running"]
    assert info["Config"]["Labels"][lbl.ID] == sb.id
    assert info["Config"]["Hostname"] == "web"
    assert lbl.decode_sandbox_config(info["Config"]["Labels"][lbl.CONFIG]) == sb.config
    resolv = await asyncio.to_thread(Path(info["ResolvConfPath"]).read_text)
    assert "nameserver 10.0.0.10" in resolv and "search svc.local" in resolv and "options ndots:5" in resolv

    await harness.backend.lifecycle.stop_sandbox(sb)
    assert not harness.engine.inspect_container(eid)["State"]["Running"]
    await harness.backend.lifecycle.stop_sandbox(sb)  # idempotent
    await harness.backend.lifecycle.remove_sandbox(sb)
    with pytest.raises(docker.errors.NotFound):
        harness.engine.inspect_container(eid)
    await harness.backend.lifecycle.remove_sandbox(sb)  # idempotent
    assert sb.id not in harness.events.not_ready


async def test_container_exit_code_and_logs(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(
        container_record(
            sb,
            ["sh", "-c", "echo out; echo err >&2; printf tail; hostname; exit 3"],
            envs=[pb.KeyValue(key="X", value=b"1")],
        ),
        sb,
    )
    assert ct.image_ref.startswith("sha256:")
    log_path = tmp_path / "c.log"
    started = await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log_path)))
    assert abs(started - time.time_ns()) < 30e9
    exit_info = await harness.events.exit_of(ct.id)
    assert exit_info.exit_code == 3
    assert exit_info.reason == "Error"
    assert exit_info.finished_at >= started
    records = log_records(log_path)
    assert ("stdout", "F", "out") in records
    assert ("stderr", "F", "err") in records
    # The pod's hostname is the container's: it shares the pause container's UTS.
    assert ("stdout", "F", "tailpod") in records


async def test_stop_timeout_kills(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(
        container_record(sb, ["sh", "-c", "trap '' TERM; touch /tmp/ready; sleep 1000 & wait; sleep 1000"]),
        sb,
    )
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    # A TERM that came before the trap was set would end it at once.
    await harness.backend.exec.exec_sync(ct, ["sh", "-c", "until [ -e /tmp/ready ]; do sleep 0.05; done"])
    t0 = time.monotonic()
    info = await harness.backend.lifecycle.stop_container(ct, 1)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 10, elapsed
    assert info.exit_code == 137
    # The process ends with the stop's exit, not with a second one the event watcher heard.
    assert await harness.events.exit_of(ct.id) == info


async def test_exec_sync_streams_and_code(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(container_record(sb, ["sleep", "1000"]), sb)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    res = await harness.backend.exec.exec_sync(ct, ["sh", "-c", "echo hi; echo oops >&2; exit 7"])
    assert (res.exit_code, res.stdout, res.stderr) == (7, b"hi\n", b"oops\n")
    # The timeout and its kill are in tests/contract (every backend).


async def test_stats(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(container_record(sb, ["sh", "-c", "while :; do :; done"]), sb)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    await asyncio.sleep(0.3)
    shim = AsShim()  # the CPU rate is the shim's, from the previous sample
    first = (await shim.container_stats(harness.backend.stats, [ct]))[ct.id]
    await asyncio.sleep(0.3)
    stats = (await shim.container_stats(harness.backend.stats, [ct]))[ct.id]
    assert stats.attributes.id == ct.id and stats.attributes.labels["role"] == "c"
    assert stats.cpu.usage_core_nano_seconds.value > first.cpu.usage_core_nano_seconds.value > 0
    assert stats.cpu.usage_nano_cores.value > 100_000_000  # a busy loop uses a good part of a core
    assert stats.memory.working_set_bytes.value > 0
    pod = (await AsShim().sandbox_stats(harness.backend.stats, [sb], [ct]))[sb.id]
    assert pod.attributes.id == sb.id
    assert [c.attributes.id for c in pod.linux.containers] == [ct.id]
    assert pod.linux.process.process_count.value >= 2  # pause + the loop
    assert pod.linux.network.default_interface.name == "eth0"
    assert pod.linux.cpu.usage_core_nano_seconds.value >= stats.cpu.usage_core_nano_seconds.value


async def test_pod_metrics(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    res = pb.LinuxContainerResources(memory_limit_in_bytes=64 << 20, cpu_quota=50_000, cpu_period=100_000)
    ct = await harness.create(
        container_record(
            sb, ["sh", "-c", "while :; do :; done"], linux=pb.LinuxContainerConfig(resources=res), name="busy"
        ),
        sb,
    )
    idle = await harness.create(container_record(sb, ["sleep", "1000"], name="idle"), sb)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    ct.status = dataclasses.replace(ct.status, started_at=time.time_ns())
    await asyncio.sleep(1.2)  # past one whole second of CPU time, at half a core
    descriptors = {d.name: list(d.label_keys) for d in AsShim.metric_descriptors()}
    [pod] = await AsShim.sandbox_metrics(harness.backend.metrics, [sb], [ct, idle])
    assert pod.pod_sandbox_id == sb.id
    # Only running containers are measured (idle was never started).
    assert [c.container_id for c in pod.container_metrics] == [ct.id]
    every = list(pod.metrics) + [m for c in pod.container_metrics for m in c.metrics]
    for m in every:
        assert m.name in descriptors and len(m.label_values) == len(descriptors[m.name]), m
    # Every family has a sample, but those of block I/O: no I/O may have reached a device.
    io = {"container_blkio_device_usage_total"} | {f"container_fs_{x}_total" for x in ("reads", "writes")}
    io |= {f"container_fs_{x}_bytes_total" for x in ("reads", "writes")}
    assert set(descriptors) - io - {m.name for m in every} == set()
    assert len(descriptors) >= 45
    got = {m.name: m for m in pod.container_metrics[0].metrics}
    labels = dict(
        zip(
            descriptors["container_cpu_usage_seconds_total"],
            got["container_memory_rss"].label_values,
            strict=True,
        )
    )
    md = sb.config.metadata
    assert labels == {
        "container": "busy",
        "id": ct.id,
        "image": BUSYBOX,
        "name": lbl.container_name(ct.id, ct.config),
        "namespace": md.namespace,
        "pod": md.name,
    }
    assert got["container_cpu_usage_seconds_total"].metric_type == pb.COUNTER
    assert got["container_cpu_usage_seconds_total"].value.value >= 0
    assert got["container_cpu_cfs_periods_total"].value.value > 5
    assert got["container_cpu_cfs_throttled_periods_total"].value.value > 0  # a busy loop at half a core
    assert got["container_spec_memory_limit_bytes"].value.value == 64 << 20
    assert got["container_spec_cpu_quota"].value.value == 50_000
    assert got["container_spec_cpu_period"].value.value == 100_000
    assert got["container_memory_working_set_bytes"].metric_type == pb.GAUGE
    assert got["container_memory_working_set_bytes"].value.value > 0
    assert got["container_processes"].value.value >= 1
    assert got["container_threads"].value.value >= got["container_processes"].value.value
    assert got["container_file_descriptors"].value.value >= 3  # stdio at least
    assert got["container_fs_limit_bytes"].value.value > got["container_fs_usage_bytes"].value.value
    assert got["container_fs_inodes_total"].value.value > got["container_fs_inodes_free"].value.value > 0
    assert got["container_fs_usage_bytes"].label_values[-1].startswith("/dev/")
    faults = {
        tuple(m.label_values[-2:])
        for m in pod.container_metrics[0].metrics
        if m.name.endswith("failures_total")
    }
    assert ("pgfault", "hierarchy") in faults
    assert got["container_start_time_seconds"].value.value == ct.status.started_at // 1_000_000_000
    net = {(m.name, m.label_values[-1]): m for m in pod.metrics}
    assert net[("container_network_receive_bytes_total", "eth0")].value.value >= 0
    assert net[("container_network_transmit_packets_total", "eth0")].label_values[0] == "POD"


def hugetlb_file(pid: int, size: str) -> Path:
    """The hugetlb limit file of the cgroup ``pid`` is in (v1 controller, else cgroup v2)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "hugetlb" in ctrls.split(","):
            return Path(f"/sys/fs/cgroup/hugetlb{path}/hugetlb.{size}.limit_in_bytes")
    unified = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
    return Path(f"{unified}{path}/hugetlb.{size}.max")


async def test_hugepage_limits(harness: Harness, tmp_path: Path) -> None:
    sizes = sorted(os.listdir("/sys/kernel/mm/hugepages"))  # e.g. hugepages-2048kB
    if not sizes:
        pytest.skip("this kernel has no huge page sizes")
    res = pb.LinuxContainerResources(
        hugepage_limits=[
            pb.HugepageLimit(page_size="2MB", limit=4 << 20),
            pb.HugepageLimit(page_size="1GB", limit=0),
        ]
    )
    sb = await harness.run_sandbox()
    ct = await harness.create(
        container_record(sb, ["sleep", "1000"], linux=pb.LinuxContainerConfig(resources=res)), sb
    )
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    pid = ct.backend_data["pid"]
    assert hugetlb_file(pid, "2MB").read_text().strip() == str(4 << 20)
    if "hugepages-1048576kB" in sizes:
        assert hugetlb_file(pid, "1GB").read_text().strip() == "0"
    ct.status = dataclasses.replace(ct.status, started_at=time.time_ns())
    res.hugepage_limits[0].limit = 8 << 20
    await harness.backend.resources.update_container_resources(ct, res)
    assert hugetlb_file(pid, "2MB").read_text().strip() == str(8 << 20)


class Session:
    """A StreamIO for tests: scripted stdin, recorded output."""

    def __init__(self, stdin: bytes | None, tty: bool = False) -> None:
        self.stdin = stdin is not None
        self.stdout = True
        self.stderr = not tty
        self.tty = tty
        self._in = [stdin] if stdin else []
        self.out = bytearray()
        self.err = bytearray()

    async def read_stdin(self) -> bytes:
        await asyncio.sleep(0.05)
        return self._in.pop(0) if self._in else b""

    async def write_stdout(self, data: bytes) -> None:
        self.out += data

    async def write_stderr(self, data: bytes) -> None:
        self.err += data

    async def resizes(self) -> AsyncIterator[TerminalSize]:
        yield TerminalSize(100, 30)


async def test_streaming_exec_stdin_half_close(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(container_record(sb, ["sleep", "1000"]), sb)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    io = Session(b"hello\nworld\n")
    code = await harness.backend.exec.exec(ct, ["sh", "-c", "cat; echo done >&2; exit 4"], io)
    assert (code, bytes(io.out), bytes(io.err)) == (4, b"hello\nworld\n", b"done\n")
    tty = Session(None, tty=True)
    code = await harness.backend.exec.exec(ct, ["sh", "-c", "sleep 0.3; stty size"], tty)
    assert code == 0 and b"30 100" in tty.out


async def test_port_forward_into_pod(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(
        container_record(sb, ["sh", "-c", "echo pong > /tmp/index.html; httpd -f -p 127.0.0.1:8080 -h /tmp"]),
        sb,
    )
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    await asyncio.wait_for(
        harness.backend.exec.exec_sync(
            ct,
            ["sh", "-c", "until wget -q -O /dev/null http://127.0.0.1:8080/index.html; do sleep 0.1; done"],
        ),
        10,
    )

    conn = HttpGet("/index.html")
    # 127.0.0.1:8080 exists only inside the pod's network namespace.
    await asyncio.wait_for(harness.backend.exec.port_forward(sb, 8080, conn), 10)
    assert conn.got.startswith(b"HTTP/1.") and conn.got.endswith(b"pong\n"), bytes(conn.got)


async def test_recover_after_restart(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    running = await harness.create(container_record(sb, ["sleep", "1000"], name="run"), sb)
    await harness.events.start(harness.backend.lifecycle, running, sb, CriLogWriter(str(tmp_path / "a.log")))
    exited = await harness.create(container_record(sb, ["sh", "-c", "exit 5"], name="ex"), sb)
    await harness.events.start(harness.backend.lifecycle, exited, sb, CriLogWriter(str(tmp_path / "b.log")))
    await harness.events.exit_of(exited.id)
    leftover = await harness.create(container_record(sb, ["true"], name="left"), sb)
    left_eid = leftover.backend_data["engine_id"]
    await harness.events.close()
    await harness.backend.lifecycle.close()

    events = Events()
    harness.backend = await new_backend(events)
    harness.events = events
    # The shim's records as persisted: the leftover's record was never committed.
    leftover.committed = False
    kept = [running, exited, leftover]
    sandboxes, containers = await harness.backend.lifecycle.recover([sb], kept)
    assert sandboxes[sb.id].exists and sandboxes[sb.id].running
    assert sandboxes[sb.id].status == SandboxStatus(ready=True, ip=sb.status.ip)
    assert containers[running.id].exists and containers[running.id].running
    assert containers[running.id].started_at > 0
    ex = containers[exited.id]
    assert ex.exists and not ex.running and ex.exit is not None and ex.exit.exit_code == 5
    assert not containers[leftover.id].exists
    with pytest.raises(docker.errors.NotFound):
        harness.engine.inspect_container(left_eid)
    assert await events.reattach(harness.backend.lifecycle, running, CriLogWriter(str(tmp_path / "a.log")))
    assert not await events.reattach(harness.backend.lifecycle, exited)

    # The recovered backend still sees exits it did not ask for.
    harness.engine.kill(running.backend_data["engine_id"], "SIGKILL")
    info = await events.exit_of(running.id)
    assert (info.exit_code, info.reason) == (137, "Error")


async def test_log_resumes_exactly_after_a_restart(harness: Harness, tmp_path: Path) -> None:
    # Output is pouring out when the backend goes away (as with a SIGKILLed shim);
    # the next one resumes from what the log file holds: no line lost, none twice.
    lines = 30_000
    log_path = tmp_path / "c.log"
    script = f"i=0; while [ $i -lt {lines} ]; do i=$((i+1)); echo $i; echo e$i >&2; done; sleep 1000"
    sb = await harness.run_sandbox()
    ct = await harness.create(container_record(sb, ["sh", "-c", script], log_path=str(log_path)), sb)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log_path)))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if log_path.exists() and log_path.stat().st_size > 20_000:
            break
    await harness.events.close()
    await harness.backend.lifecycle.close()
    assert len(log_records(log_path)) < 2 * lines  # cut in the middle

    events = Events()
    harness.backend = await new_backend(events)
    harness.events = events
    _, seen = await harness.backend.lifecycle.recover([sb], [ct])
    assert seen[ct.id].running
    after = last_log_marks(str(log_path))
    assert await events.reattach(harness.backend.lifecycle, ct, CriLogWriter(str(log_path)), after)
    for _ in range(200):
        if len(log_records(log_path)) >= 2 * lines:
            break
        await asyncio.sleep(0.1)
    records = log_records(log_path)
    assert [int(c) for s, _t, c in records if s == "stdout"] == list(range(1, lines + 1))
    assert [c for s, _t, c in records if s == "stderr"] == [f"e{i}" for i in range(1, lines + 1)]
    stamps = [line.split(" ", 1)[0] for line in log_path.read_text().splitlines()]
    assert len(set(stamps)) > lines  # the engine's times, not one per batch read


@pytest.mark.parametrize("kind", ["sandbox", "container"])
async def test_create_given_up_leaves_nothing(harness: Harness, kind: str) -> None:
    # The client gives up while the engine is creating: the shim rolls the record
    # back, and the engine's container must go with it.
    backend = harness.backend
    sb = await harness.run_sandbox() if kind == "container" else sandbox_record("given-up")
    rec = container_record(sb, ["sleep", "1000"]) if kind == "container" else sb
    real = backend.engine.request

    async def slow_answer(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        answer = await real(method, path, *args, **kwargs)
        if path == "/containers/create":
            await asyncio.sleep(1)  # created in the engine; the answer is late
        return answer

    backend.engine.request = slow_answer  # type: ignore[method-assign]
    if kind == "container":
        assert isinstance(rec, ContainerRecord)
        call = asyncio.create_task(backend.lifecycle.create_container(rec, sb))
    else:
        call = asyncio.create_task(backend.lifecycle.run_sandbox(sb))
    await asyncio.sleep(0.5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    backend.engine.request = real  # type: ignore[method-assign]
    assert rec.backend_data.get("engine_id")  # learnt, though the caller had gone
    # What the shim's rollback does.
    if isinstance(rec, ContainerRecord):
        await backend.lifecycle.remove_container(rec)
    else:
        await backend.lifecycle.stop_sandbox(rec)
        await backend.lifecycle.remove_sandbox(rec)
    left = harness.engine.containers(all=True, filters={"label": f"{lbl.ID}={rec.id}"})
    assert left == []


def push_own_image(engine: docker.APIClient) -> str:
    """An image of this test run alone (its own ID), in the registry and not local.

    The shared busybox may be in use by other containers on the engine,
    which the engine refuses to delete by ID.
    """
    repo = "127.0.0.1:5000/crishim-test"
    ref = f"{repo}:{INSTANCE}"
    dockerfile = f"FROM {BUSYBOX}\nLABEL io.cri-shim.test={INSTANCE}\n".encode()
    for _ in engine.build(fileobj=io.BytesIO(dockerfile), tag=ref, rm=True, pull=False, decode=True):
        pass
    for line in engine.push(repo, tag=INSTANCE, stream=True, decode=True):
        assert "error" not in line, line
    engine.remove_image(ref)
    return ref


async def test_images_pull_list_status_remove(harness: Harness) -> None:
    backend = harness.backend
    ref = await asyncio.to_thread(push_own_image, harness.engine)
    assert await backend.images.image_status(pb.ImageSpec(image=ref)) is None
    image_id = await backend.images.pull_image(pb.ImageSpec(image=ref), None, None)
    assert image_id.startswith("sha256:")
    listed = {i.id: i for i in await backend.images.list_images()}
    assert ref in listed[image_id].repo_tags
    status = await backend.images.image_status(pb.ImageSpec(image=ref))
    assert status is not None and status.id == image_id and status.size > 0
    assert any(d.startswith("127.0.0.1:5000/crishim-test@sha256:") for d in status.repo_digests)
    by_digest = await backend.images.image_status(pb.ImageSpec(image=status.repo_digests[0]))
    assert by_digest is not None and by_digest.id == image_id
    pause = await backend.images.image_status(pb.ImageSpec(image=PAUSE))
    assert pause is not None and pause.uid == 65535 and pause.pinned

    fs = await backend.images.image_fs_info()
    store = fs.image_filesystems[0]
    assert os.path.isdir(store.fs_id.mountpoint)  # the kubelet stats it
    # The store's usage, not the disk's: less than what the filesystem holding it has in use.
    disk = os.statvfs(store.fs_id.mountpoint)
    assert 0 < store.used_bytes.value < (disk.f_blocks - disk.f_bfree) * disk.f_frsize
    assert 0 < store.inodes_used.value < disk.f_files - disk.f_ffree

    extra = f"127.0.0.1:5000/crishim-test:{INSTANCE}-extra"
    harness.engine.tag(ref, extra)
    # Concurrent removals of one image all succeed, and it is gone when each
    # returns (critest's "simultaneous RemoveImage").
    removals = [backend.images.remove_image(pb.ImageSpec(image=r)) for r in (ref, image_id, ref, image_id)]
    await asyncio.gather(*removals)
    assert await backend.images.image_status(pb.ImageSpec(image=image_id)) is None
    assert await backend.images.image_status(pb.ImageSpec(image=ref)) is None
    assert await backend.images.image_status(pb.ImageSpec(image=extra)) is None  # every tag went
    await backend.images.remove_image(pb.ImageSpec(image=ref))  # absent: no error
    with pytest.raises(NotFoundError):
        await backend.images.pull_image(pb.ImageSpec(image="127.0.0.1:5000/nothing-here:1"), None, None)
    again = await asyncio.gather(
        *(backend.images.pull_image(pb.ImageSpec(image=ref), None, None) for _ in range(3))
    )
    assert again == [image_id] * 3
    await backend.images.remove_image(pb.ImageSpec(image=image_id))


async def test_create_with_missing_image_is_not_found(harness: Harness) -> None:
    sb = await harness.run_sandbox()
    ct = container_record(sb, ["true"])
    ct.config.image.image = "127.0.0.1:5000/absent:0"
    with pytest.raises(NotFoundError):
        await harness.backend.lifecycle.create_container(ct, sb)


async def test_attach_stdin_once(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(
        container_record(
            sb, ["sh", "-c", "read line; echo got:$line; echo bye >&2"], stdin=True, stdin_once=True
        ),
        sb,
    )
    log_path = tmp_path / "l.log"
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log_path)))
    io = Session(b"ping\n")
    await asyncio.wait_for(harness.backend.exec.attach(ct, io), 10)
    assert bytes(io.out) == b"got:ping\n" and bytes(io.err) == b"bye\n"
    assert (await harness.events.exit_of(ct.id)).exit_code == 0
    assert ("stdout", "F", "got:ping") in log_records(log_path)


async def test_published_port_and_security_settings(harness: Harness, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host_port = s.getsockname()[1]
    sb = await harness.run_sandbox(
        sandbox_record(
            "pub",
            port_mappings=[
                pb.PortMapping(protocol=pb.TCP, container_port=8080, host_port=host_port, host_ip="127.0.0.1")
            ],
            linux=pb.LinuxPodSandboxConfig(sysctls={"net.ipv4.ip_unprivileged_port_start": "0"}),
        )
    )
    sc = pb.LinuxContainerSecurityContext(
        run_as_user=pb.Int64Value(value=33),
        run_as_group=pb.Int64Value(value=33),
        supplemental_groups=[50],
        readonly_rootfs=True,
        capabilities=pb.Capability(drop_capabilities=["ALL"], add_capabilities=["NET_BIND_SERVICE"]),
        no_new_privs=True,
    )
    ct = await harness.create(
        container_record(
            sb,
            ["sh", "-c", "httpd -f -p 8080 -h /etc"],
            linux=pb.LinuxContainerConfig(
                security_context=sc,
                resources=pb.LinuxContainerResources(memory_limit_in_bytes=64 << 20, oom_score_adj=-500),
            ),
        ),
        sb,
    )
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    res = await harness.backend.exec.exec_sync(
        ct, ["sh", "-c", "id; cat /proc/sys/net/ipv4/ip_unprivileged_port_start; touch /x"]
    )
    assert b"uid=33" in res.stdout and b"gid=33" in res.stdout and b"50" in res.stdout, res.stdout
    assert res.stdout.splitlines()[1] == b"0"
    assert res.exit_code != 0 and b"Read-only file system" in res.stderr
    host = harness.engine.inspect_container(ct.backend_data["engine_id"])["HostConfig"]
    assert host["Memory"] == 64 << 20
    assert "no-new-privileges" in host["SecurityOpt"]

    async def fetch() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", host_port)
        writer.write(b"GET /passwd HTTP/1.0\r\n\r\n")
        data = await reader.read()
        writer.close()
        await writer.wait_closed()
        return data

    for _ in range(50):
        try:
            body = await fetch()
            if body:
                break
        except OSError:
            pass
        await asyncio.sleep(0.1)
    assert b"www-data" in body


async def test_engine_down_is_unavailable(tmp_path: Path) -> None:
    events = Events()
    backend = create("docker", {"endpoint": f"unix://{tmp_path}/absent.sock"})
    await backend.lifecycle.start(events)
    try:
        health = await backend.lifecycle.health()
        assert not health.runtime_ready and health.reason == "DockerDaemonNotReady"
        with pytest.raises(UnavailableError):
            await backend.images.list_images()
        with pytest.raises(UnavailableError):
            await backend.lifecycle.run_sandbox(sandbox_record())
    finally:
        await backend.lifecycle.close()


async def test_recover_resumes_output_without_repeats(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(
        container_record(
            sb, ["sh", "-c", "i=0; while [ $i -lt 40 ]; do echo $i; i=$((i+1)); sleep 0.05; done"]
        ),
        sb,
    )
    log_path = tmp_path / "c.log"
    ct.log_path = str(log_path)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log_path)))
    await asyncio.sleep(0.6)
    await harness.events.close()
    await harness.backend.lifecycle.close()  # the shim goes down while the container keeps printing
    await asyncio.sleep(0.4)

    events = Events()
    harness.backend = await new_backend(events)
    harness.events = events
    _, seen = await harness.backend.lifecycle.recover([sb], [ct])
    assert seen[ct.id].running
    after = last_log_marks(str(log_path))
    assert await events.reattach(harness.backend.lifecycle, ct, CriLogWriter(str(log_path)), after)
    await events.exit_of(ct.id)
    numbers = [int(content) for stream, _tag, content in log_records(log_path) if stream == "stdout"]
    assert numbers == list(range(40))


async def test_exec_client_gone_ends_process(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(container_record(sb, ["sleep", "1000"]), sb)
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    session = asyncio.create_task(harness.backend.exec.exec(ct, ["sleep", "301"], Session(None)))
    await asyncio.sleep(0.5)
    ps = await harness.backend.exec.exec_sync(ct, ["ps", "-o", "args"])
    assert b"sleep 301" in ps.stdout
    session.cancel()
    with pytest.raises(asyncio.CancelledError):
        await session
    ps = await harness.backend.exec.exec_sync(ct, ["ps", "-o", "args"])
    assert b"sleep 301" not in ps.stdout, ps.stdout


class EngineProxy:
    """A unix-socket relay to the real engine that can be cut, to play dockerd going away and back."""

    def __init__(self, path: Path, target: str) -> None:
        self.path = path
        self.target = target.removeprefix("unix://")
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._events: set[asyncio.StreamWriter] = set()  # client ends of /events streams
        self.refusing = False
        self.refusing_events = False

    async def up(self) -> None:
        self._server = await asyncio.start_unix_server(self._relay, path=str(self.path))

    async def down(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    def cut_all_but_events(self) -> None:
        """Every call fails from now on, while the event stream goes on."""
        self.refusing = True
        for w in list(self._writers - self._events):
            w.close()

    def cut_events(self) -> None:
        """The event stream breaks and cannot be had again, while every other call goes on."""
        self.refusing_events = True
        for w in list(self._events):
            w.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.close()
            return
        first = await reader.read(65536)
        events = b" /v1.41/events" in first.split(b"\r\n", 1)[0]
        if events and self.refusing_events:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_unix_connection(self.target)
        up_writer.write(first)
        self._writers |= {writer, up_writer}
        if events:
            self._events |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        try:
            await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}
            self._events -= {writer, up_writer}


@contextlib.asynccontextmanager
async def behind_proxy(
    engine: docker.APIClient, tmp_path: Path
) -> AsyncIterator[tuple[EngineProxy, Harness]]:
    """A backend that reaches the engine through an EngineProxy, with a running container."""
    proxy = EngineProxy(tmp_path / "engine.sock", ENDPOINT)
    await proxy.up()
    events = Events()
    backend = create(
        "docker", {"endpoint": f"unix://{proxy.path}", "pause_image": PAUSE, "instance": INSTANCE}
    )
    await backend.lifecycle.start(events)
    h = Harness(backend, events, engine)
    try:
        yield proxy, h
    finally:
        proxy.refusing = False
        await h.cleanup()
        await events.close()
        await backend.lifecycle.close()
        await proxy.down()


async def start_sleeper(h: Harness, tmp_path: Path) -> ContainerRecord:
    sb = await h.run_sandbox()
    ct = await h.create(container_record(sb, ["sleep", "1000"]), sb)
    await h.events.start(h.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    return ct


async def test_engine_outage_and_return(engine: docker.APIClient, tmp_path: Path) -> None:
    async with behind_proxy(engine, tmp_path) as (proxy, h):
        backend = h.backend
        ct = await start_sleeper(h, tmp_path)

        await proxy.down()
        health = await backend.lifecycle.health()
        assert not health.runtime_ready and health.reason
        with pytest.raises(UnavailableError):
            await backend.images.list_images()
        with pytest.raises(UnavailableError):
            await backend.exec.exec_sync(ct, ["true"])
        # It dies while the shim cannot hear the engine.
        engine.kill(ct.backend_data["engine_id"], "SIGKILL")
        await asyncio.sleep(0.5)

        await proxy.up()
        for _ in range(50):
            if (await backend.lifecycle.health()).runtime_ready:
                break
            await asyncio.sleep(0.1)
        assert (await backend.lifecycle.health()).runtime_ready
        info = await h.events.exit_of(ct.id, timeout=15)
        assert info.exit_code in (137, 143)
        assert [i.id for i in await backend.images.list_images()]


async def test_exit_heard_while_the_engine_cannot_be_asked(engine: docker.APIClient, tmp_path: Path) -> None:
    # The die event arrives, but the inspect that should follow fails: the exit
    # must still be reported once the engine answers again.
    async with behind_proxy(engine, tmp_path) as (proxy, h):
        ct = await start_sleeper(h, tmp_path)
        await asyncio.sleep(0.3)  # the event stream is connected
        proxy.cut_all_but_events()
        engine.kill(ct.backend_data["engine_id"], "SIGKILL")
        await asyncio.sleep(1.0)
        assert ct.id not in h.events.exits  # heard, but not confirmed yet
        proxy.refusing = False
        info = await h.events.exit_of(ct.id, timeout=10)
        assert info.exit_code == 137


class StallingRegistry:
    """A registry on loopback that serves a manifest, then never sends a blob."""

    def __init__(self) -> None:
        self.blob_requests = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        config = (
            b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:'
            + b"1" * 64
            + b'"]}}'
        )
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {
                    "mediaType": "application/vnd.docker.container.image.v1+json",
                    "size": len(config),
                    "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                },
                "layers": [
                    {
                        "mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                        "size": 1 << 20,
                        "digest": "sha256:" + "2" * 64,
                    }
                ],
            }
        ).encode()
        try:
            while True:
                first = await reader.readexactly(1)
                if first == b"\x16":
                    return  # a TLS handshake: the engine tries HTTPS first, then plain HTTP
                head = first + await reader.readuntil(b"\r\n\r\n")
                method, target = head.split(b" ")[:2]
                if b"/blobs/" in target:
                    self.blob_requests += 1
                    # The headers, then silence: no byte of the blob ever comes.
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n")
                    await writer.drain()
                    await reader.read()
                    return
                ctype = "application/json"
                body = b"{}"
                if b"/manifests/" in target:
                    ctype, body = "application/vnd.docker.distribution.manifest.v2+json", manifest
                digest = "sha256:" + hashlib.sha256(body).hexdigest()
                writer.write(
                    f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nDocker-Content-Digest: {digest}\r\n"
                    f"Docker-Distribution-API-Version: registry/2.0\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + (b"" if method == b"HEAD" else body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_pull_without_progress_times_out(engine: docker.APIClient) -> None:
    registry = StallingRegistry()
    await registry.start()
    backend = create(
        "docker",
        {"endpoint": ENDPOINT, "pause_image": PAUSE, "pull_no_progress_timeout": 2, "instance": INSTANCE},
    )
    await backend.lifecycle.start(Events())
    ref = f"127.0.0.1:{registry.port}/stall:{INSTANCE}"
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError) as info:
            await backend.images.pull_image(pb.ImageSpec(image=ref), None, None)
        assert "no progress for 2s" in str(info.value)
        assert 2 <= time.monotonic() - t0 < 15
        assert registry.blob_requests >= 1  # it did get as far as the layers
    finally:
        await backend.lifecycle.close()
        await registry.stop()


async def test_pod_dns(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox(
        sandbox_record(
            "dns", dns_config=pb.DNSConfig(servers=["10.96.0.10"], searches=["ns.svc.cluster.local"])
        )
    )
    ct = await harness.create(
        container_record(
            sb,
            ["cat", "/etc/resolv.conf"],
        ),
        sb,
    )
    log_path = tmp_path / "c.log"
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log_path)))
    info = await harness.events.exit_of(ct.id, timeout=60)
    assert info.exit_code == 0  # OOMKilled is in tests/contract (every backend)
    out = [content for stream, _tag, content in log_records(log_path) if stream == "stdout"]
    assert "nameserver 10.96.0.10" in out and "search ns.svc.cluster.local" in out


async def test_pause_image_pulled_again_when_removed(harness: Harness) -> None:
    await harness.run_sandbox()
    # The first sandbox's pause keeps the image; only its tag goes, and the backend must notice.
    harness.engine.remove_image(PAUSE, force=True)
    sb = await harness.run_sandbox()
    assert sb.status.ip
    assert await harness.backend.images.image_status(pb.ImageSpec(image=PAUSE)) is not None


async def test_image_id_cache_follows_retags(harness: Harness) -> None:
    images = harness.backend._shared.engine_images
    moving = f"127.0.0.1:5000/crishim-moving:{INSTANCE}"
    busybox_id = harness.engine.inspect_image(BUSYBOX)["Id"]
    pause_id = harness.engine.inspect_image(PAUSE)["Id"]
    harness.engine.tag(BUSYBOX, moving)
    try:
        await asyncio.sleep(0.3)  # the event stream is up and the tag event went by
        assert await images.resolve(moving) == busybox_id
        assert await images.resolve(moving) == busybox_id  # now from the cache
        harness.engine.tag(PAUSE, moving)
        for _ in range(50):
            if await images.resolve(moving) == pause_id:
                break
            await asyncio.sleep(0.05)
        assert await images.resolve(moving) == pause_id
    finally:
        harness.engine.remove_image(moving)
    with pytest.raises(NotFoundError):
        for _ in range(50):
            await images.resolve(moving)
            await asyncio.sleep(0.05)


async def test_failed_sandbox_leaves_nothing(harness: Harness) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mapping = [pb.PortMapping(protocol=pb.TCP, container_port=80, host_port=port, host_ip="127.0.0.1")]
    await harness.run_sandbox(sandbox_record("first", port_mappings=mapping))
    second = sandbox_record("second", port_mappings=mapping)
    with pytest.raises(CriError):
        await harness.backend.lifecycle.run_sandbox(second)
    assert "engine_id" not in second.backend_data
    rows = harness.engine.containers(all=True, filters={"label": f"io.cri-shim.id={second.id}"})
    assert rows == []


async def test_long_line_split_into_partial_records(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    ct = await harness.create(
        container_record(sb, ["sh", "-c", "head -c 40000 /dev/zero | tr '\\0' a; echo; echo next"]), sb
    )
    log_path = tmp_path / "c.log"
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log_path)))
    await harness.events.exit_of(ct.id)
    records = log_records(log_path)
    assert [(tag, len(content)) for _s, tag, content in records] == [
        ("P", 16384),
        ("P", 16384),
        ("F", 40000 - 2 * 16384),
        ("F", 4),
    ]
    assert "".join(c for _s, _t, c in records[:3]) == "a" * 40000


@pytest.mark.parametrize("how", ["stopped", "exits"])
async def test_all_output_is_logged_when_the_exit_is_reported(
    harness: Harness, tmp_path: Path, how: str
) -> None:
    # A burst of output just before the end: the log pump is still behind when
    # the container stops, and cuts its followed stream to read the rest.
    lines = 20_000
    script = f"seq 1 {lines}; seq 1 {lines} >&2; " + (
        "touch /tmp/done; sleep 1000" if how == "stopped" else "exit 3"
    )
    sb = await harness.run_sandbox()
    ct = await harness.create(container_record(sb, ["sh", "-c", script]), sb)
    log_path = tmp_path / "c.log"
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log_path)))
    if how == "stopped":
        for _ in range(200):
            done = await harness.backend.exec.exec_sync(ct, ["test", "-e", "/tmp/done"])
            if done.exit_code == 0:
                break
            await asyncio.sleep(0.05)
        info = await harness.events.stop(
            harness.backend.lifecycle, ct, 0
        )  # StopContainer: drained, then recorded
        assert info.exit_code in (137, 143)
    else:
        assert (await harness.events.exit_of(ct.id)).exit_code == 3
    records = log_records(log_path)
    for stream in ("stdout", "stderr"):
        got = [int(c) for s, _t, c in records if s == stream]
        assert got == list(range(1, lines + 1)), f"{stream}: {len(got)} records"


async def test_masked_and_readonly_paths(harness: Harness, tmp_path: Path) -> None:
    sb = await harness.run_sandbox()
    sc = pb.LinuxContainerSecurityContext(masked_paths=["/bin/ls"], readonly_paths=["/tmp"])
    ct = await harness.create(
        container_record(sb, ["sleep", "1000"], linux=pb.LinuxContainerConfig(security_context=sc)), sb
    )
    try:
        await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    except CriError as exc:
        # Say what the image holds, so that a failure here tells image from runtime.
        plain = await harness.create(container_record(sb, ["sleep", "1000"], name="plain"), sb)
        await harness.events.start(
            harness.backend.lifecycle, plain, sb, CriLogWriter(str(tmp_path / "p.log"))
        )
        listing = await harness.backend.exec.exec_sync(plain, ["ls", "-li", "/bin/ls", "/bin/sleep"])
        pytest.fail(f"start with /bin/ls masked failed: {exc}; image: {listing.stdout!r} {listing.stderr!r}")
    masked = await harness.backend.exec.exec_sync(ct, ["/bin/ls", "/"])
    assert masked.exit_code != 0  # /bin/ls is /dev/null now
    shell = await harness.backend.exec.exec_sync(ct, ["sh", "-c", "echo alive"])
    assert shell.stdout == b"alive\n"  # busybox itself is not masked with it
    ro = await harness.backend.exec.exec_sync(ct, ["touch", "/tmp/x"])
    assert ro.exit_code != 0 and b"Read-only file system" in ro.stderr


async def test_image_fs_info_counts_writable_layers_apart(harness: Harness, tmp_path: Path) -> None:
    """The engine's one store in both lists (the kubelet sees no split disk), a container's
    writes in container_filesystems, not in image_filesystems."""
    backend = harness.backend
    sb = await harness.run_sandbox()
    ct = await harness.create(container_record(sb, ["sleep", "1000"]), sb)
    await harness.events.start(backend.lifecycle, ct, sb, CriLogWriter(str(tmp_path / "l.log")))
    await backend._store_usage._measure()  # type: ignore[attr-defined]
    before = await backend.images.image_fs_info()
    res = await backend.exec.exec_sync(ct, ["sh", "-c", "head -c 8388608 /dev/urandom > /big && sync"])
    assert res.exit_code == 0, res.stderr
    await backend._store_usage._measure()  # type: ignore[attr-defined]
    after = await backend.images.image_fs_info()
    (images,), (writable,) = after.image_filesystems, after.container_filesystems
    assert images.fs_id.mountpoint == writable.fs_id.mountpoint and os.path.isdir(images.fs_id.mountpoint)
    grew = writable.used_bytes.value - before.container_filesystems[0].used_bytes.value
    assert grew >= 8 << 20, grew
