"""CreateContainer and StartContainer that fail at any of their steps leave nothing behind (or, for a
start, what containerd leaves); stopping and removing are idempotent; the events come once each, in
order, whichever way a container is removed (issue 44). Driven through the edge, watched through the
CRI (tests/shim/services_kit.py)."""

from __future__ import annotations

import asyncio
import os

import pytest

from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests.criutil import until
from tests.shim.services_kit import (
    Disk,
    Fault,
    Held,
    Kit,
    Pod,
    backend_holds,
    container_request,
    container_status,
    create,
    listed_containers,
    pod_status,
    record_files,
    run_pod,
    start,
    subscribed,
)

LABELS = {"tier": "failing"}
DOWN = "UNAVAILABLE: the runtime is down"
ROLLBACK = "INTERNAL: the rollback failed too"
MAX_WRITES = 4  # write-1 .. write-4 below; test_the_fault_table_covers_... checks it is enough

# Every backend step CreateContainer takes (create_container; remove_container when it rolls
# back) and each of its state writes (the record before any effect ... the commit).
CREATE_FAULTS = {
    "create_container": Fault(Code.UNAVAILABLE, errors=(("create_container", DOWN),)),
    "create_container-refused": Fault(
        Code.INVALID_ARGUMENT, errors=(("create_container", "INVALID_ARGUMENT: bad mount"),)
    ),
    "create_container+rollback-remove_container": Fault(
        Code.UNAVAILABLE, errors=(("create_container", DOWN), ("remove_container", ROLLBACK))
    ),
    **{f"write-{n}": Fault(Code.RESOURCE_EXHAUSTED, full_disk_at=n) for n in range(1, MAX_WRITES + 1)},
    "write-last+rollback-remove_container": Fault(
        Code.RESOURCE_EXHAUSTED, full_disk_at=-1, errors=(("remove_container", ROLLBACK),), backend_keeps=True
    ),
}


async def container_views(kit: Kit, pod: Pod) -> dict[str, list[str]]:
    """ListContainers as the kubelet and crictl ask it: whole, by pod, by state, by label."""
    return {
        "all": await listed_containers(kit),
        "pod": await listed_containers(kit, pod=pod.id),
        "created": await listed_containers(kit, state=pb.CONTAINER_CREATED),
        "running": await listed_containers(kit, state=pb.CONTAINER_RUNNING),
        "label": await listed_containers(kit, labels=LABELS),
        "pod+label": await listed_containers(kit, pod=pod.id, labels=LABELS),
    }


@pytest.mark.parametrize("fault", [pytest.param(f, id=i) for i, f in CREATE_FAULTS.items()])
async def test_a_failed_create_container_leaves_nothing_behind(
    kit: Kit, monkeypatch: pytest.MonkeyPatch, fault: Fault
) -> None:
    pod = await run_pod(kit)
    disk = Disk(monkeypatch)
    other = await create(kit, pod, "other", labels=LABELS)  # the same call, that succeeds: its writes counted
    writes = len(disk.writes)
    before = await container_views(kit, pod)  # asked first: a kept answer would show up stale after
    files, held = record_files(kit), backend_holds(kit)
    assert before["all"] == before["pod"] == before["created"] == before["label"] == [other]

    async with subscribed(kit) as events:
        kit.inject(fault.errors)
        nth = writes if fault.full_disk_at == -1 else fault.full_disk_at
        disk.full_from(nth)
        mark = kit.calls_mark()
        req = container_request(pod, "failing", labels=LABELS)
        code, _, resp = await kit.call("CreateContainer", req)
        disk.free()
        if nth > writes:  # a disk that fills up after the call's last write changes nothing
            assert code == Code.OK
            assert await listed_containers(kit) == [other, resp.container_id]
            return
        assert (code, resp) == (fault.code, None)
        failed = kit.issued[-1]
        assert failed not in (pod.id, other)
        calls = kit.calls_since(mark)

        assert await container_views(kit, pod) == before
        assert await listed_containers(kit, id=failed) == []
        code, _, _ = await kit.call("ContainerStatus", pb.ContainerStatusRequest(container_id=failed))
        assert code == Code.NOT_FOUND
        assert record_files(kit) == files
        if fault.backend_keeps:
            assert ("remove_container", (failed,)) in calls
        else:
            assert backend_holds(kit) == held
        assert (await pod_status(kit, pod.id)).state == pb.SANDBOX_READY

        # The name is free again: the same request succeeds right after, listed, and told.
        again = (await kit.ok("CreateContainer", req)).container_id
        await events.settle()
        assert events.of(failed) == []
        assert events.kinds() == ["CREATED"] and events.of(again) == ["CREATED"]
    # (The CRI gives a List no order: 5f37ecf answered by pod in no particular one.)
    assert sorted(await listed_containers(kit, pod=pod.id, labels=LABELS)) == sorted([other, again])
    assert await listed_containers(kit, state=pb.CONTAINER_CREATED) == [other, again]
    assert again in backend_holds(kit).containers
    assert f"{again}.json" in record_files(kit)["containers"]


async def test_the_fault_table_covers_every_step_of_create_container(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A successful CreateContainer calls no backend method and makes no state write that the table
    above does not fail: a new step makes this fail until the table has it."""
    pod = await run_pod(kit)
    disk = Disk(monkeypatch)
    mark = kit.calls_mark()
    await create(kit, pod)
    failed_methods = {m for f in CREATE_FAULTS.values() for m, _ in f.errors}
    assert {m for m, _ in kit.calls_since(mark)} <= failed_methods
    assert 1 <= len(disk.writes) <= MAX_WRITES


async def test_a_container_is_not_listed_while_it_is_being_made_nor_after_it_failed(kit: Kit) -> None:
    """Not listed, nor has it a status, before it is made, whatever the filter; no event of it."""
    pod = await run_pod(kit)
    other = await create(kit, pod, "other", labels=LABELS)
    before = await container_views(kit, pod)
    kit.fake.set_latency("create_container", 0.05)
    kit.inject((("create_container", DOWN),))
    async with subscribed(kit) as events:
        mark = kit.calls_mark()
        making = asyncio.ensure_future(kit.call("CreateContainer", container_request(pod, "slow", LABELS)))
        try:
            await until(lambda: any(m == "create_container" for m, _ in kit.calls_since(mark)))
            cid = kit.issued[-1]
            assert await container_views(kit, pod) == before
            assert before["all"] == before["pod"] == before["created"] == before["label"] == [other]
            assert await listed_containers(kit, id=cid) == []
            code, _, _ = await kit.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid))
            assert code == Code.NOT_FOUND
        finally:
            code, _, _ = await making
        assert code == Code.UNAVAILABLE
    assert events.got == []
    assert await container_views(kit, pod) == before


# ---------------------------------------------------------------------- StartContainer


async def test_a_failed_start_leaves_the_container_exited_with_start_error(kit: Kit) -> None:
    """As containerd does: exit code 128, reason StartError, the error as its message, an empty
    log for the kubelet to read; never RUNNING, no STARTED event."""
    pod = await run_pod(kit)
    cid = await create(kit, pod)
    async with subscribed(kit) as events:
        kit.inject((("start_container", "UNAVAILABLE: no such binary"),))
        code, _, resp = await kit.call("StartContainer", pb.StartContainerRequest(container_id=cid))
        assert (code, resp) == (Code.UNAVAILABLE, None)
        await events.settle()
        assert "STARTED" not in events.of(cid)
    st = await container_status(kit, cid)
    assert (st.state, st.reason, st.exit_code) == (pb.CONTAINER_EXITED, "StartError", 128)
    assert "no such binary" in st.message
    assert st.started_at == st.finished_at > 0
    assert os.path.isfile(st.log_path)
    assert await listed_containers(kit, state=pb.CONTAINER_EXITED) == [cid]
    assert await listed_containers(kit, state=pb.CONTAINER_RUNNING) == []
    assert cid not in backend_holds(kit).running
    # It cannot be started again: a failed start is final.
    code, _, _ = await kit.call("StartContainer", pb.StartContainerRequest(container_id=cid))
    assert code == Code.FAILED_PRECONDITION


@pytest.mark.parametrize("nth", [1, -1], ids=["write-first", "write-last-running"])
async def test_a_full_disk_at_start_leaves_the_container_created_and_not_running(
    kit: Kit, monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    """shim/cri/container.py's start: a full disk is found before the container starts, or, when it
    fills up in between, at the write that records RUNNING, the backend's container is stopped:
    "not recorded, so not started". It stays CREATED, told nothing, and starts once the disk takes
    its record."""
    pod = await run_pod(kit)
    probe, cid = await create(kit, pod, "probe"), await create(kit, pod)
    disk = Disk(monkeypatch)
    await start(kit, probe)  # the same call, that succeeds: its writes counted
    writes = len(disk.writes)
    async with subscribed(kit) as events:
        mark = kit.calls_mark()
        disk.full_from(writes if nth == -1 else nth)
        code, _, _ = await kit.call("StartContainer", pb.StartContainerRequest(container_id=cid))
        assert code == Code.RESOURCE_EXHAUSTED
        await events.settle()
        assert events.of(cid) == []
        st = await container_status(kit, cid)
        assert (st.state, st.started_at, st.finished_at) == (pb.CONTAINER_CREATED, 0, 0)
        assert await listed_containers(kit, state=pb.CONTAINER_RUNNING) == [probe]
        assert await listed_containers(kit, state=pb.CONTAINER_CREATED) == [cid]
        assert cid not in backend_holds(kit).running
        methods = [m for m, _ in kit.calls_since(mark)]
        if nth == 1:
            assert "start_container" not in methods
        else:
            assert methods.count("start_container") == methods.count("stop_container") == 1

        disk.free()
        await start(kit, cid)
        await events.settle()
        assert events.of(cid) == ["STARTED"]
    assert (await container_status(kit, cid)).state == pb.CONTAINER_RUNNING
    assert cid in backend_holds(kit).running


async def test_start_container_calls_only_start_container(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one backend step of StartContainer, which the tests above fail; at least two state
    writes (before the start, then RUNNING), which they fill the disk at."""
    pod = await run_pod(kit)
    cid = await create(kit, pod)
    disk = Disk(monkeypatch)
    mark = kit.calls_mark()
    await start(kit, cid)
    assert [m for m, _ in kit.calls_since(mark)] == ["start_container"]
    assert len(disk.writes) >= 2


# ---------------------------------------------------------------------- stop and remove, again


@pytest.mark.parametrize("method", ["StopContainer", "RemoveContainer"], ids=["stop", "remove"])
async def test_twice_is_ok_and_the_second_does_nothing(kit: Kit, method: str) -> None:
    pod = await run_pod(kit)
    cid = await create(kit, pod)
    await start(kit, cid)
    request = getattr(pb, f"{method}Request")(container_id=cid)
    async with subscribed(kit) as events:
        await kit.ok(method, request)
        await events.settle()
        assert events.of(cid) == (["STOPPED"] if method == "StopContainer" else ["STOPPED", "DELETED"])
        seen, files = list(events.got), record_files(kit)
        views = {s: await listed_containers(kit, state=s) for s in (None, pb.CONTAINER_EXITED)}
        mark = kit.calls_mark()
        await kit.ok(method, request)
        await events.settle()
        assert events.got == seen
    assert kit.calls_since(mark) == []
    assert record_files(kit) == files
    assert {s: await listed_containers(kit, state=s) for s in views} == views
    assert cid not in backend_holds(kit).running


@pytest.mark.parametrize(
    ("method", "container_id", "code"),
    [
        ("StopContainer", "f" * 64, Code.OK),
        ("RemoveContainer", "f" * 64, Code.OK),
        ("ContainerStatus", "f" * 64, Code.NOT_FOUND),
        ("StartContainer", "f" * 64, Code.NOT_FOUND),
        ("StopContainer", "", Code.INVALID_ARGUMENT),
        ("RemoveContainer", "", Code.INVALID_ARGUMENT),
        ("ContainerStatus", "", Code.INVALID_ARGUMENT),
        ("StartContainer", "", Code.INVALID_ARGUMENT),
    ],
    ids=[
        "stop-unknown",
        "remove-unknown",
        "status-unknown",
        "start-unknown",
        "stop-empty",
        "remove-empty",
        "status-empty",
        "start-empty",
    ],
)
async def test_a_container_id_that_names_nothing(
    kit: Kit, method: str, container_id: str, code: Code
) -> None:
    pod = await run_pod(kit)
    cid = await create(kit, pod)
    await start(kit, cid)
    mark = kit.calls_mark()
    got, detail, _ = await kit.call(method, getattr(pb, f"{method}Request")(container_id=container_id))
    assert got == code, detail
    assert kit.calls_since(mark) == []
    assert await listed_containers(kit, state=pb.CONTAINER_RUNNING) == [cid]


# ---------------------------------------------------------------------- events


async def test_a_containers_life_is_told_once_a_step_in_order(kit: Kit) -> None:
    pod = await run_pod(kit)
    async with subscribed(kit) as events:
        cid = await create(kit, pod)
        await start(kit, cid)
        await kit.ok("StopContainer", pb.StopContainerRequest(container_id=cid, timeout=10))
        await kit.ok("RemoveContainer", pb.RemoveContainerRequest(container_id=cid))
    assert events.kinds() == ["CREATED", "STARTED", "STOPPED", "DELETED"]
    # Each event shows the container as it was then, in its pod.
    states = [[s.state for s in e.containers_statuses if s.id == cid] for e in events.got]
    assert states == [
        [pb.CONTAINER_CREATED],
        [pb.CONTAINER_RUNNING],
        [pb.CONTAINER_EXITED],
        [pb.CONTAINER_EXITED],
    ]
    assert {e.pod_sandbox_status.id for e in events.got} == {pod.id}
    times = [e.created_at for e in events.got]
    assert times == sorted(times)


async def test_removing_a_pod_with_a_running_container_stops_then_deletes_it(kit: Kit) -> None:
    pod = await run_pod(kit)
    running, created = await create(kit, pod, "running"), await create(kit, pod, "created")
    await start(kit, running)
    async with subscribed(kit) as events:
        await kit.ok("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
    assert events.of(running) == ["STOPPED", "DELETED"]
    assert events.of(created)[-1:] == ["DELETED"]
    assert backend_holds(kit) == Held(frozenset(), frozenset(), frozenset())


def _told(events: list[pb.ContainerEventResponse], cid: str) -> list[tuple[str, int, str, int]]:
    """What each event of ``cid`` says of it: its kind, and the container's state, reason and exit code."""
    out = []
    for e in events:
        if e.container_id != cid:
            continue
        [own] = [s for s in e.containers_statuses if s.id == cid]
        out.append((pb.ContainerEventType.Name(e.container_event_type), own.state, own.reason, own.exit_code))
    return out


async def _removal_told(kit: Kit, name: str, state: str, by: str) -> list[tuple[str, int, str, int]]:
    pod = await run_pod(kit, name)
    cid = await create(kit, pod)
    if state in ("running", "exited"):
        await start(kit, cid)
    if state == "exited":
        await kit.ok("StopContainer", pb.StopContainerRequest(container_id=cid, timeout=10))
    async with subscribed(kit) as events:
        if by == "RemoveContainer":
            await kit.ok(by, pb.RemoveContainerRequest(container_id=cid))
        else:
            await kit.ok(by, pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
    code, _, _ = await kit.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid))
    assert code == Code.NOT_FOUND  # and gone from the disk
    assert f"{cid}.json" not in record_files(kit)["containers"]
    return _told(events.got, cid)


@pytest.mark.parametrize("state", ["running", "exited"])
async def test_removal_by_container_or_by_pod_tells_the_same(kit: Kit, state: str) -> None:
    """RemoveContainer and RemovePodSandbox (without a stop first) remove a container one way: the
    same events, in the same order, saying the same of it."""
    by_container = await _removal_told(kit, "by-container", state, "RemoveContainer")
    by_pod = await _removal_told(kit, "by-pod", state, "RemovePodSandbox")
    assert by_container[-1][0] == "CONTAINER_DELETED_EVENT"
    assert by_pod == by_container


async def test_a_pod_removed_unstopped_is_stopped_first_which_ends_its_created_containers(kit: Kit) -> None:
    """RemovePodSandbox of a ready pod stops it first, as StopPodSandbox does: a container that never
    started can no longer start, so it is ended (SandboxStopped, told STOPPED) before the one removal
    path removes it (told DELETED); RemoveContainer of the same container tells DELETED alone."""
    by_container = await _removal_told(kit, "by-container", "created", "RemoveContainer")
    by_pod = await _removal_told(kit, "by-pod", "created", "RemovePodSandbox")
    assert [told[0] for told in by_container] == ["CONTAINER_DELETED_EVENT"]
    assert [told[0] for told in by_pod] == ["CONTAINER_STOPPED_EVENT", "CONTAINER_DELETED_EVENT"]
    assert by_pod[0][1:] == by_pod[1][1:] and by_pod[0][2] == "SandboxStopped"
