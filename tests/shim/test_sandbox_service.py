"""RunPodSandbox that fails at any of its steps leaves nothing behind; stopping and removing are
idempotent (issue 44). Driven through the edge, watched through the CRI (tests/shim/services_kit.py)."""

from __future__ import annotations

import asyncio

import pytest

from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests.criutil import until
from tests.shim.services_kit import (
    Disk,
    Fault,
    Kit,
    backend_holds,
    create,
    listed_pods,
    pod_request,
    pod_status,
    record_files,
    run_pod,
    start,
    subscribed,
)

LABELS = {"app": "failing"}
DOWN = "UNAVAILABLE: the runtime is down"
ROLLBACK = "INTERNAL: the rollback failed too"
MAX_WRITES = 4  # write-1 .. write-4 below; test_the_fault_table_covers_... checks it is enough

# Every backend step RunPodSandbox takes (run_sandbox; stop_sandbox and remove_sandbox when it
# rolls back) and each of its state writes (the record before any effect ... the commit).
RUN_FAULTS = {
    "run_sandbox": Fault(Code.UNAVAILABLE, errors=(("run_sandbox", DOWN),)),
    "run_sandbox-no-address": Fault(
        Code.RESOURCE_EXHAUSTED, errors=(("run_sandbox", "RESOURCE_EXHAUSTED: no pod IP left"),)
    ),
    "run_sandbox+rollback-stop_sandbox": Fault(
        Code.UNAVAILABLE, errors=(("run_sandbox", DOWN), ("stop_sandbox", ROLLBACK))
    ),
    "run_sandbox+rollback-remove_sandbox": Fault(
        Code.UNAVAILABLE, errors=(("run_sandbox", DOWN), ("remove_sandbox", ROLLBACK))
    ),
    **{f"write-{n}": Fault(Code.RESOURCE_EXHAUSTED, full_disk_at=n) for n in range(1, MAX_WRITES + 1)},
    "write-last+rollback-remove_sandbox": Fault(
        Code.RESOURCE_EXHAUSTED, full_disk_at=-1, errors=(("remove_sandbox", ROLLBACK),), backend_keeps=True
    ),
    # A failed stop must not keep the pod's remains: the remove is still asked (5f37ecf's
    # _undo_sandbox skipped it, and dropped the record: the backend kept the pod and its IP).
    "write-last+rollback-stop_sandbox": Fault(
        Code.RESOURCE_EXHAUSTED, full_disk_at=-1, errors=(("stop_sandbox", ROLLBACK),)
    ),
}


async def pod_views(kit: Kit) -> dict[str, list[str]]:
    """ListPodSandbox as the kubelet and crictl ask it: whole, by state, by label."""
    return {
        "all": await listed_pods(kit),
        "ready": await listed_pods(kit, state=pb.SANDBOX_READY),
        "notready": await listed_pods(kit, state=pb.SANDBOX_NOTREADY),
        "label": await listed_pods(kit, labels=LABELS),
    }


@pytest.mark.parametrize("fault", [pytest.param(f, id=i) for i, f in RUN_FAULTS.items()])
async def test_a_failed_run_pod_sandbox_leaves_nothing_behind(
    kit: Kit, monkeypatch: pytest.MonkeyPatch, fault: Fault
) -> None:
    disk = Disk(monkeypatch)
    other = await run_pod(kit, "other", labels=LABELS)  # the same call, that succeeds: its writes counted
    writes = len(disk.writes)
    before = await pod_views(kit)  # asked first: a kept answer would show up stale after
    files, held = record_files(kit), backend_holds(kit)
    assert before["all"] == before["ready"] == before["label"] == [other.id]

    kit.inject(fault.errors)
    nth = writes if fault.full_disk_at == -1 else fault.full_disk_at
    disk.full_from(nth)
    mark = kit.calls_mark()
    req = pod_request(kit, "failing", labels=LABELS)
    code, _, resp = await kit.call("RunPodSandbox", req)
    disk.free()
    if nth > writes:  # a disk that fills up after the call's last write changes nothing
        assert code == Code.OK
        assert await listed_pods(kit, state=pb.SANDBOX_READY) == [other.id, resp.pod_sandbox_id]
        return
    assert (code, resp) == (fault.code, None)
    failed = kit.issued[-1]
    assert failed != other.id

    assert await pod_views(kit) == before
    assert await listed_pods(kit, id=failed) == []
    code, _, _ = await kit.call("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=failed))
    assert code == Code.NOT_FOUND
    assert record_files(kit) == files
    calls = kit.calls_since(mark)
    if fault.backend_keeps:
        assert ("remove_sandbox", (failed,)) in calls
    else:
        assert backend_holds(kit) == held

    # The name is free again: the same request succeeds right after, and is listed.
    again = (await kit.ok("RunPodSandbox", req)).pod_sandbox_id
    assert await listed_pods(kit, labels=LABELS) == [other.id, again]
    assert (await pod_status(kit, again)).state == pb.SANDBOX_READY
    assert again in backend_holds(kit).sandboxes
    assert f"{again}.json" in record_files(kit)["sandboxes"]


async def test_the_fault_table_covers_every_step_of_run_pod_sandbox(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A successful RunPodSandbox calls no backend method and makes no state write that the table
    above does not fail: a new step makes this fail until the table has it."""
    disk = Disk(monkeypatch)
    mark = kit.calls_mark()
    await run_pod(kit)
    failed_methods = {m for f in RUN_FAULTS.values() for m, _ in f.errors}
    assert {m for m, _ in kit.calls_since(mark)} <= failed_methods
    assert 1 <= len(disk.writes) <= MAX_WRITES


async def test_a_pod_is_not_listed_while_it_is_being_made_nor_after_it_failed(kit: Kit) -> None:
    """Not listed before it is made (the kubelet would see a pod that may never exist), whatever
    the filter; nothing to list after its RunPodSandbox failed."""
    other = await run_pod(kit, "other", labels=LABELS)
    before = await pod_views(kit)
    kit.fake.set_latency("run_sandbox", 0.05)
    kit.inject((("run_sandbox", DOWN),))
    mark = kit.calls_mark()
    making = asyncio.ensure_future(kit.call("RunPodSandbox", pod_request(kit, "slow", labels=LABELS)))
    try:
        await until(lambda: any(m == "run_sandbox" for m, _ in kit.calls_since(mark)))
        sid = kit.issued[-1]
        assert await pod_views(kit) == before
        assert before == {"all": [other.id], "ready": [other.id], "notready": [], "label": [other.id]}
        assert await listed_pods(kit, id=sid) == []
    finally:
        code, _, _ = await making
    assert code == Code.UNAVAILABLE
    assert await pod_views(kit) == before


async def test_a_pod_being_made_has_no_status_yet(kit: Kit) -> None:
    kit.fake.set_latency("run_sandbox", 0.05)
    mark = kit.calls_mark()
    making = asyncio.ensure_future(kit.call("RunPodSandbox", pod_request(kit, "slow")))
    try:
        await until(lambda: any(m == "run_sandbox" for m, _ in kit.calls_since(mark)))
        req = pb.PodSandboxStatusRequest(pod_sandbox_id=kit.issued[-1])
        assert (await kit.call("PodSandboxStatus", req))[0] == Code.NOT_FOUND
    finally:
        assert (await making)[0] == Code.OK


# ---------------------------------------------------------------------- stop and remove, again


async def test_stop_pod_sandbox_twice_changes_nothing_the_second_time(kit: Kit) -> None:
    pod = await run_pod(kit)
    cid = await create(kit, pod)
    await start(kit, cid)
    async with subscribed(kit) as events:
        await kit.ok("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
        await events.settle()
        assert events.of(cid) == ["STOPPED"]
        status, files = await pod_status(kit, pod.id), record_files(kit)
        mark = kit.calls_mark()
        await kit.ok("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
        await events.settle()
        assert events.of(cid) == ["STOPPED"]
    assert status.state == pb.SANDBOX_NOTREADY
    assert await pod_status(kit, pod.id) == status
    assert await listed_pods(kit, state=pb.SANDBOX_NOTREADY) == [pod.id]
    assert record_files(kit) == files
    # A second stop may ask the backend to stop the pod again (a teardown that failed halfway
    # gets another try), never a container.
    assert {m for m, _ in kit.calls_since(mark)} <= {"stop_sandbox"}


@pytest.mark.parametrize("stopped_first", [False, True], ids=["running", "stopped"])
async def test_remove_pod_sandbox_twice_is_ok_and_the_second_does_nothing(
    kit: Kit, stopped_first: bool
) -> None:
    pod = await run_pod(kit)
    cid = await create(kit, pod)
    await start(kit, cid)
    if stopped_first:
        await kit.ok("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
    async with subscribed(kit) as events:
        await kit.ok("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
        await events.settle()
        seen = list(events.got)
        mark = kit.calls_mark()
        await kit.ok("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
        await events.settle()
        assert events.got == seen
    assert kit.calls_since(mark) == []
    assert await listed_pods(kit) == []
    assert record_files(kit) == {"sandboxes": frozenset(), "containers": frozenset()}
    assert backend_holds(kit).sandboxes == frozenset()
    assert backend_holds(kit).containers == frozenset()


@pytest.mark.parametrize(
    "method", ["StopPodSandbox", "RemovePodSandbox"], ids=["stop-unknown", "remove-unknown"]
)
async def test_stop_and_remove_of_an_unknown_pod_are_ok_and_touch_nothing(kit: Kit, method: str) -> None:
    pod = await run_pod(kit)
    mark = kit.calls_mark()
    request = getattr(pb, f"{method}Request")(pod_sandbox_id="f" * 64)
    assert (await kit.call(method, request))[0] == Code.OK
    assert kit.calls_since(mark) == []
    assert await listed_pods(kit, state=pb.SANDBOX_READY) == [pod.id]


@pytest.mark.parametrize(
    ("method", "pod_id", "code"),
    [
        ("PodSandboxStatus", "f" * 64, Code.NOT_FOUND),
        ("PodSandboxStatus", "", Code.INVALID_ARGUMENT),
        ("StopPodSandbox", "", Code.INVALID_ARGUMENT),
        ("RemovePodSandbox", "", Code.INVALID_ARGUMENT),
    ],
    ids=["status-unknown", "status-empty", "stop-empty", "remove-empty"],
)
async def test_a_pod_id_that_names_nothing(kit: Kit, method: str, pod_id: str, code: Code) -> None:
    await run_pod(kit)
    request = getattr(pb, f"{method}Request")(pod_sandbox_id=pod_id)
    got, detail, resp = await kit.call(method, request)
    assert (got, resp) == (code, None), detail


async def test_status_after_removal_is_not_found(kit: Kit) -> None:
    pod = await run_pod(kit)
    await kit.ok("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
    code, _, _ = await kit.call("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=pod.id))
    assert code == Code.NOT_FOUND
