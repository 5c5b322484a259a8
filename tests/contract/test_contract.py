"""The CRI contract, run against every backend (see conftest.BACKENDS)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from backends.contract import Capability
from cri_api import api_pb2 as pb
from tests.contract.conftest import Cri
from tests.criutil import container_config, sandbox_config


async def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code()


async def run_pod(cri: Cri, **kw: object) -> tuple[str, pb.PodSandboxConfig]:
    await cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=cri.image)))
    sc = sandbox_config(log_directory=os.path.join(cri.root, "logs"), **kw)  # type: ignore[arg-type]
    pod = (await cri.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    return pod, sc


async def create(
    cri: Cri, pod: str, sc: pb.PodSandboxConfig, command: list[str], image: str = "", **kw: object
) -> str:
    cc = container_config(image=image or cri.image, command=command, **kw)  # type: ignore[arg-type]
    req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
    return (await cri.rt.CreateContainer(req)).container_id


async def wait_state(cri: Cri, cid: str, state: int, seconds: float = 20) -> pb.ContainerStatus:
    deadline = time.monotonic() + seconds
    while True:
        st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
        if st.state == state or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.1)


async def test_pod_lifecycle(cri: Cri) -> None:
    pod, sc = await run_pod(cri, labels={"tier": "x"}, annotations={"note": "kept exactly"})
    st = (await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status
    assert st.state == pb.SANDBOX_READY
    assert st.metadata == sc.metadata
    assert dict(st.labels) == {"tier": "x"} and dict(st.annotations) == {"note": "kept exactly"}
    assert st.created_at > 10**18
    assert st.network.ip
    await cri.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
    await cri.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))  # idempotent
    st = (await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status
    assert st.state == pb.SANDBOX_NOTREADY
    await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
    await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))  # idempotent
    code = await code_of(cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod)))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_container_exit_code_and_logs(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sh", "-c", "echo hello; echo oops >&2; exit 3"], log_path="c.log")
    st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st.state == pb.CONTAINER_CREATED and st.started_at == 0
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st = await wait_state(cri, cid, pb.CONTAINER_EXITED)
    assert st.state == pb.CONTAINER_EXITED
    assert st.exit_code == 3 and st.reason == "Error"
    assert st.created_at <= st.started_at <= st.finished_at
    with open(os.path.join(cri.root, "logs", "c.log")) as f:
        lines = f.read().splitlines()
    assert any(line.endswith(" stdout F hello") for line in lines), lines
    assert any(line.endswith(" stderr F oops") for line in lines), lines
    # Exit 0 is Completed.
    ok = await create(cri, pod, sc, ["true"], name="ok")
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=ok))
    st = await wait_state(cri, ok, pb.CONTAINER_EXITED)
    assert (st.exit_code, st.reason) == (0, "Completed")


async def test_stop_remove_idempotent_and_states(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sleep", "3600"])
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    assert (await wait_state(cri, cid, pb.CONTAINER_RUNNING)).state == pb.CONTAINER_RUNNING
    code = await code_of(cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    await cri.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1))
    await cri.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1))
    assert (await wait_state(cri, cid, pb.CONTAINER_EXITED)).state == pb.CONTAINER_EXITED
    await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    code = await code_of(cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)))
    assert code == grpc.StatusCode.NOT_FOUND


async def _started_with_traps(cri: Cri, pod: str, sc: pb.PodSandboxConfig, name: str, **kw: object) -> str:
    """A container whose shell says which signal stopped it, started and with its traps set."""
    script = (
        "trap 'echo got-term; exit 0' TERM; trap 'echo got-quit; exit 0' QUIT; "
        "touch /tmp/ready; sleep 3600 & wait"
    )
    cid = await create(cri, pod, sc, ["sh", "-c", script], name=name, log_path=f"{name}.log", **kw)
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    ready = ["sh", "-c", "until [ -e /tmp/ready ]; do sleep 0.05; done"]
    await cri.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=ready, timeout=20))
    return cid


async def test_the_stop_signal_is_reported_and_used(cri: Cri) -> None:
    """ContainerStatus.stop_signal is what StopContainer sends: the config's, else SIGTERM (the
    image has no STOPSIGNAL); the kubelet shows it as the pod status' stopSignal."""
    if cri.backend.exec is None:
        pytest.skip(f"{cri.kind} declares no ExecSync")
    pod, sc = await run_pod(cri)
    for name, asked, want, said in (
        ("quit", pb.SIGNAL_SIGQUIT, pb.SIGNAL_SIGQUIT, "got-quit"),
        ("default", pb.SIGNAL_RUNTIME_DEFAULT, pb.SIGNAL_SIGTERM, "got-term"),
    ):
        cid = await _started_with_traps(cri, pod, sc, name, stop_signal=asked)
        st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
        assert st.stop_signal == want, (name, pb.Signal.Name(st.stop_signal))
        await cri.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=30))
        st = await wait_state(cri, cid, pb.CONTAINER_EXITED)
        assert (st.exit_code, st.stop_signal) == (0, want), name
        with open(os.path.join(cri.root, "logs", f"{name}.log")) as f:
            lines = f.read().splitlines()
        assert [line.rsplit(" ", 1)[-1] for line in lines] == [said], (name, lines)


async def test_remove_running_pod_removes_its_containers(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sleep", "3600"])
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
    assert len((await cri.rt.ListContainers(pb.ListContainersRequest())).containers) == 0
    assert len((await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items) == 0


async def test_already_exists(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    dup = await code_of(cri.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc)))
    assert dup == grpc.StatusCode.ALREADY_EXISTS
    await create(cri, pod, sc, ["sleep", "60"], name="c")
    again = await code_of(create(cri, pod, sc, ["sleep", "60"], name="c"))
    assert again == grpc.StatusCode.ALREADY_EXISTS
    await create(cri, pod, sc, ["sleep", "60"], name="c", attempt=1)  # a new attempt is a new name
    assert len((await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items) == 1


async def test_container_filters(cri: Cri) -> None:
    pod_a, sc_a = await run_pod(cri, name="a")
    pod_b, sc_b = await run_pod(cri, name="b")
    c1 = await create(cri, pod_a, sc_a, ["sleep", "60"], name="one", labels={"k": "1"})
    c2 = await create(cri, pod_a, sc_a, ["sleep", "60"], name="two", labels={"k": "2"})
    c3 = await create(cri, pod_b, sc_b, ["sleep", "60"], name="three", labels={"k": "1"})
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=c2))

    async def ids(**f: object) -> set[str]:
        resp = await cri.rt.ListContainers(pb.ListContainersRequest(filter=pb.ContainerFilter(**f)))
        return {c.id for c in resp.containers}

    assert await ids() == {c1, c2, c3}
    assert await ids(pod_sandbox_id=pod_a) == {c1, c2}
    assert await ids(pod_sandbox_id=pod_a[:10]) == {c1, c2}
    assert await ids(id=c3[:8]) == {c3}
    assert await ids(label_selector={"k": "1"}) == {c1, c3}
    assert await ids(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING)) == {c2}
    assert await ids(state=pb.ContainerStateValue(state=pb.CONTAINER_CREATED), pod_sandbox_id=pod_a) == {c1}
    stats = await cri.rt.ListContainerStats(
        pb.ListContainerStatsRequest(filter=pb.ContainerStatsFilter(label_selector={"k": "2"}))
    )
    assert [s.attributes.id for s in stats.stats] == [c2]


async def test_prefix_lookup(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sleep", "60"])
    st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid[:12]))).status
    assert st.id == cid
    sst = (await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod[:6]))).status
    assert sst.id == pod


async def test_exec_sync(cri: Cri) -> None:
    if cri.backend.exec is None:
        pytest.skip(f"{cri.kind} declares no ExecSync")
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sleep", "3600"])
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    await wait_state(cri, cid, pb.CONTAINER_RUNNING)
    out = await cri.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo hi; exit 4"]))
    assert (out.stdout, out.exit_code) == (b"hi\n", 4)
    code = await code_of(
        cri.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["sleep", "10"], timeout=1))
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_images(cri: Cri) -> None:
    ref = (await cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=cri.image)))).image_ref
    assert ref
    st = await cri.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=cri.image)))
    assert st.image.id == ref and st.image.size > 0
    by_id = await cri.im.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=ref)))
    assert by_id.image.id == ref
    listed = await cri.im.ListImages(pb.ListImagesRequest())
    assert ref in {i.id for i in listed.images}
    code = await code_of(cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=""))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_refusals_match_the_absent_parts(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sleep", "60"])
    if cri.backend.checkpoint is None:
        code = await code_of(cri.rt.CheckpointContainer(pb.CheckpointContainerRequest(container_id=cid)))
        assert code == grpc.StatusCode.UNIMPLEMENTED
    if cri.backend.resources is None:
        req = pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=pod)
        assert await code_of(cri.rt.UpdatePodSandboxResources(req)) == grpc.StatusCode.UNIMPLEMENTED


async def test_pod_resources_are_kept_or_refused_with_nothing_changed(cri: Cri) -> None:
    """UpdatePodSandboxResources: applied and recorded (through a restart), or refused with the
    record as it was (docker: this pod has no cgroup parent, so no pod-level cgroup)."""
    pod, sc = await run_pod(cri)
    req = pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=pod,
        resources=pb.LinuxContainerResources(
            cpu_period=100_000, cpu_quota=200_000, memory_limit_in_bytes=256 << 20
        ),
        overhead=pb.LinuxContainerResources(),
    )
    try:
        await cri.rt.UpdatePodSandboxResources(req)
        applied = True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED), exc
        applied = False
    assert applied == (cri.kind != "docker")
    await cri.restart()
    assert cri.server.shim is not None
    sb = cri.server.shim.store.sandboxes.get(pod)
    assert sb is not None
    assert sb.config.linux.resources == (req.resources if applied else sc.linux.resources)
    st = (await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status
    assert st.state == pb.SANDBOX_READY


async def test_status_features_say_what_each_handler_can(cri: Cri) -> None:
    """The kubelet admits hostUsers: false pods by Status' user_namespaces: runv has them (the
    pod's namespace in its VM), docker not (the engine's remap is daemon-wide), the fake not."""
    status = await cri.rt.Status(pb.StatusRequest())
    handlers = {h.name: h.features for h in status.runtime_handlers}
    caps = cri.backend.capabilities
    assert set(handlers) == {"", cri.kind}
    for features in handlers.values():
        assert features.user_namespaces == bool(caps & Capability.USER_NAMESPACES)
        assert features.recursive_read_only_mounts == bool(caps & Capability.RECURSIVE_READ_ONLY_MOUNTS)
    assert handlers[cri.kind].user_namespaces == (cri.kind == "runv")


async def test_bad_requests_change_nothing(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    before = await cri.rt.ListContainers(pb.ListContainersRequest())
    bad = container_config(image=cri.image, log_path="../../escape.log")
    code = await code_of(
        cri.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=bad, sandbox_config=sc))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    no_image = container_config(image="")
    code = await code_of(
        cri.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=no_image))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    missing_pod = container_config(image=cri.image)
    code = await code_of(
        cri.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id="e" * 64, config=missing_pod))
    )
    assert code == grpc.StatusCode.NOT_FOUND
    after = await cri.rt.ListContainers(pb.ListContainersRequest())
    assert after == before
    # A failed create released its name: the same name can be used now.
    ok = container_config(image=cri.image, command=["sleep", "60"])
    await cri.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=ok, sandbox_config=sc))


# ---- guarantees every backend gives, once here instead of once per backend


async def test_all_output_is_in_the_log_when_the_exit_is_reported(cri: Cri) -> None:
    """A client that sees EXITED reads the log next: every line must be in it by then."""
    pod, sc = await run_pod(cri)
    script = "; ".join(f"echo line-{i}" for i in range(200)) + "; echo to-stderr >&2; exit 0"
    cid = await create(cri, pod, sc, ["sh", "-c", script], log_path="out.log")
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st = await wait_state(cri, cid, pb.CONTAINER_EXITED)
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 0, "Completed")
    with open(os.path.join(cri.root, "logs", "out.log")) as f:
        records = [line.split(" ", 3) for line in f.read().splitlines()]
    stdout = [r[3] for r in records if r[1] == "stdout"]
    assert stdout == [f"line-{i}" for i in range(200)]
    assert [r[3] for r in records if r[1] == "stderr"] == ["to-stderr"]


async def test_a_log_flood_under_rotation_loses_and_repeats_nothing(cri: Cri) -> None:
    """A container writing as fast as it can while the log is rotated the kubelet's way (rename, then
    ReopenContainerLog) over and over: every line is in exactly one file, whole, in order."""
    lines = 200_000
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sh", "-c", f"seq 1 {lines}"], log_path="flood.log")
    path = os.path.join(cri.root, "logs", "flood.log")
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    rotated: list[str] = []
    while True:
        st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
        if st.state != pb.CONTAINER_RUNNING:
            break
        if os.path.exists(path):
            rotated.append(f"{path}.{len(rotated)}")
            os.rename(path, rotated[-1])
            try:
                await cri.rt.ReopenContainerLog(pb.ReopenContainerLogRequest(container_id=cid))
            except grpc.aio.AioRpcError as exc:  # it exited meanwhile: nothing more to write
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
        await asyncio.sleep(0.05)
    got: list[int] = []
    for name in [*rotated, path]:
        if not os.path.exists(name):
            continue
        with open(name) as f:
            for record in f.read().splitlines():
                stamp, stream, tag, content = record.split(" ", 3)
                assert (stream, tag) == ("stdout", "F") and stamp.endswith("Z"), record
                got.append(int(content))
    assert got == list(range(1, lines + 1)), (len(got), len(rotated))


async def test_exec_sync_past_its_timeout_is_killed(cri: Cri) -> None:
    if cri.backend.exec is None:
        pytest.skip(f"{cri.kind} declares no ExecSync")
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sleep", "3600"])
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    await wait_state(cri, cid, pb.CONTAINER_RUNNING)
    t0 = time.monotonic()
    code = await code_of(
        cri.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["sleep", "737"], timeout=1))
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 10
    if cri.kind == "fake":
        return  # no processes to look at
    # Gone when the call returns, and the container's own process untouched.
    ps = await cri.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["ps", "-o", "args"], timeout=5))
    assert b"sleep 737" not in ps.stdout and b"sleep 3600" in ps.stdout, ps.stdout


async def test_out_of_memory_is_reported_as_oomkilled(cri: Cri) -> None:
    if cri.kind == "fake":
        pytest.skip("the fake runs no processes: nothing runs out of memory")
    pod, sc = await run_pod(cri)
    cid = await create(
        cri,
        pod,
        sc,
        ["sh", "-c", "x=a; while true; do x=$x$x$x$x; done"],
        linux=pb.LinuxContainerConfig(resources=pb.LinuxContainerResources(memory_limit_in_bytes=16 << 20)),
    )
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st = await wait_state(cri, cid, pb.CONTAINER_EXITED, seconds=60)
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 137, "OOMKilled")


async def test_a_failed_create_leaves_nothing_and_frees_the_name(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    missing = f"127.0.0.1:5000/no-such-image-{os.getpid()}:1"
    code = await code_of(create(cri, pod, sc, ["sleep", "60"], name="c", image=missing))
    assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
    assert len((await cri.rt.ListContainers(pb.ListContainersRequest())).containers) == 0
    await create(cri, pod, sc, ["sleep", "60"], name="c")
    assert len((await cri.rt.ListContainers(pb.ListContainersRequest())).containers) == 1


async def test_a_restarted_shim_keeps_pods_containers_and_their_output(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    ticker = await create(
        cri,
        pod,
        sc,
        ["sh", "-c", "echo before; sleep 2; echo after; sleep 3600"],
        name="tick",
        log_path="t.log",
    )
    created = await create(cri, pod, sc, ["sleep", "3600"], name="created")
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=ticker))
    await wait_state(cri, ticker, pb.CONTAINER_RUNNING)
    ip = (await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status.network.ip
    await cri.restart()
    st = (await cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status
    assert (st.state, st.network.ip) == (pb.SANDBOX_READY, ip)
    assert (await wait_state(cri, ticker, pb.CONTAINER_RUNNING)).state == pb.CONTAINER_RUNNING
    assert (await wait_state(cri, created, pb.CONTAINER_CREATED)).state == pb.CONTAINER_CREATED
    if cri.backend.exec is not None:
        out = await cri.rt.ExecSync(pb.ExecSyncRequest(container_id=ticker, cmd=["echo", "still-here"]))
        assert out.stdout == b"still-here\n"
    if cri.kind == "fake":
        return  # its programs do not survive a restart (documented); the records do
    deadline = time.monotonic() + 10
    text = ""
    while "after" not in text and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        with open(os.path.join(cri.root, "logs", "t.log")) as f:
            text = f.read()
    lines = [line.split(" ", 3)[3] for line in text.splitlines()]
    assert lines == ["before", "after"], lines  # nothing lost or repeated across the restart


async def test_checkpoints_are_made_or_refused_saying_why(
    cri: Cri, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake checkpoints and restores (tests/shim/test_checkpoint_service.py); docker and runv
    refuse every checkpoint RPC with FAILED_PRECONDITION naming CRIU and what `criu check` said
    here (a stub `criu` on PATH that fails as Debian's 3.17 does on this kernel), and write nothing."""
    bin_dir = os.path.join(short_tmp, "bin")
    os.mkdir(bin_dir)
    with open(os.path.join(bin_dir, "criu"), "w") as f:
        f.write(
            '#!/bin/sh\necho "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds" >&2\nexit 1\n'
        )
    os.chmod(os.path.join(bin_dir, "criu"), 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    pod, sc = await run_pod(cri)
    cid = await create(cri, pod, sc, ["sleep", "1000"], log_path="c.log")
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    out = os.path.join(short_tmp, "out")
    os.mkdir(out)
    location = os.path.join(short_tmp, "c.tar")
    calls = [
        cri.rt.CheckpointContainer(pb.CheckpointContainerRequest(container_id=cid, location=location)),
        cri.rt.CheckpointPod(
            pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=out, container_ids=[cid]), timeout=30
        ),
    ]
    if cri.backend.name == "fake":
        for call in calls:
            await call
        assert os.path.isfile(location) and os.listdir(out) == ["pod.tar"]
        restored = await create(cri, pod, sc, [], image=location, name="restored", log_path="r.log")
        st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=restored))).status
        assert st.state == pb.CONTAINER_CREATED and st.image.image == "docker.io/library/busybox:latest"
        return
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "CRIU" in (info.value.details() or "") and "Unexpected rt vDSO" in (info.value.details() or "")
    assert not os.path.exists(location) and os.listdir(out) == []
    # A container from a checkpoint archive (one of another node, say) is refused the same way.
    with open(location, "wb") as f:
        f.write(b"an archive CRIU would read")
    containers = (await cri.rt.ListContainers(pb.ListContainersRequest())).containers
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await create(cri, pod, sc, [], image=location, name="restored", log_path="r.log")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "CRIU" in (info.value.details() or "")
    assert (await cri.rt.ListContainers(pb.ListContainersRequest())).containers == containers
    before = (await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
    restore = pb.RestorePodRequest(
        checkpoint_path=out,
        config=sandbox_config(name="restored", log_directory=os.path.join(short_tmp, "logs2")),
        container_configs=[container_config(image=cri.image, command=["sleep", "1000"])],
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cri.rt.RestorePod(restore, timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "CRIU" in (info.value.details() or "")
    assert (await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items == before


async def test_noexec_mount_option_stops_a_script_of_the_mount(cri: Cri, short_tmp: str) -> None:
    """Mount.mount_options noexec: a script of the mount does not run (an exit of 126, or an exec
    that cannot start: runv answers FAILED_PRECONDITION, permission denied), the same script runs
    from a plain mount of the same directory; an unknown option is refused, naming it."""
    shared = os.path.join(short_tmp, "shared")
    os.mkdir(shared)
    with open(os.path.join(shared, "run.sh"), "w") as f:
        f.write("#!/bin/sh\necho ran\n")
    os.chmod(os.path.join(shared, "run.sh"), 0o755)
    pod, sc = await run_pod(cri)
    mounts = [
        pb.Mount(container_path="/plain", host_path=shared),
        pb.Mount(container_path="/locked", host_path=shared, mount_options=["noexec"]),
    ]
    if not cri.backend.capabilities & Capability.MOUNT_OPTIONS:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await create(cri, pod, sc, ["sleep", "1000"], mounts=mounts)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mount options" in (
            info.value.details() or ""
        )
        return
    bad = [pb.Mount(container_path="/x", host_path=shared, mount_options=["exec"])]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await create(cri, pod, sc, ["sleep", "1000"], mounts=bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'exec'" in (info.value.details() or "")
    cid = await create(cri, pod, sc, ["sleep", "1000"], mounts=mounts, log_path="c.log")
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    ran = await cri.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["/plain/run.sh"], timeout=10))
    assert (ran.exit_code, ran.stdout) == (0, b"ran\n"), ran
    try:
        refused = await cri.rt.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["/locked/run.sh"], timeout=10)
        )
        assert refused.exit_code == 126, refused
        assert b"ermission denied" in refused.stdout + refused.stderr, refused
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "permission denied" in (
            exc.details() or ""
        )
