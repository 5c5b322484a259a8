"""Pre-encoded List responses decode to the same messages; kept List answers and cached status
responses follow every change."""

import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from backends.contract.records import ContainerRecord, SandboxRecord
from cri_api import api_pb2 as pb
from shim.cri.list_cache import Answers, ListCache, StatusCache, field1_entry, record_labels, with_labels
from shim.cri.servicer import _split_entries
from shim.cri.store import Table
from tests.conftest import Running
from tests.criutil import until


def test_concatenated_entries_are_a_valid_response() -> None:
    items = [pb.Container(id=str(i) * 64, labels={"a": "b" * i}) for i in range(1, 300, 37)]
    data = b"".join(field1_entry(c.SerializeToString()) for c in items)
    assert list(pb.ListContainersResponse.FromString(data).containers) == items
    assert len(_split_entries(data)) == len(items)


def _labelled(name: str, labels: dict[str, str]) -> ContainerRecord:
    return ContainerRecord(
        id=name * 64,
        sandbox_id="s" * 64,
        backend="fake",
        config=pb.ContainerConfig(labels=labels),
        created_at=1,
        log_path="",
    )


def test_with_labels_keeps_the_records_holding_every_pair() -> None:
    recs = [
        _labelled("a", {"app": "web", "tier": "1"}),
        _labelled("b", {"app": "web"}),
        _labelled("c", {}),
        _labelled("d", {"app": "db", "tier": "1"}),
    ]

    def ids(selector: dict[str, str]) -> str:
        return "".join(r.id[0] for r in with_labels(recs, selector))

    assert with_labels(recs, {}) is recs  # no selector: every record, no pass over them
    assert ids({"app": "web"}) == "ab"  # one pair
    assert ids({"app": "web", "tier": "1"}) == "a"  # several pairs: all must hold
    assert ids({"tier": "1"}) == "ad"
    assert ids({"app": ""}) == ""  # an empty value matches only a label that is there and empty
    assert ids({"absent": "x"}) == ""
    assert ids({"app": "web", "absent": "x"}) == ""
    # The label maps are kept on the records, empty ones too.
    assert all(r.label_map is not None for r in recs)


def test_list_entries_follow_each_records_status() -> None:
    built: list[str] = []

    def build(r: ContainerRecord) -> pb.Container:
        built.append(r.id)
        return pb.Container(id=r.id, state=r.status.state)

    cache: ListCache[ContainerRecord] = ListCache(build)
    recs = [
        ContainerRecord(
            id=c * 64,
            sandbox_id="s" * 64,
            backend="fake",
            config=pb.ContainerConfig(),
            created_at=1,
            log_path="",
        )
        for c in "abc"
    ]
    first = pb.ListContainersResponse.FromString(cache.encode(recs))
    assert [c.id for c in first.containers] == [r.id for r in recs] and len(built) == 3
    assert cache.encode(recs) == first.SerializeToString() and len(built) == 3  # all kept
    recs[1].status = dataclasses.replace(recs[1].status, started_at=5)  # a new status object
    again = pb.ListContainersResponse.FromString(cache.encode(recs[::-1]))
    assert built[3:] == [recs[1].id]
    assert [c.state for c in again.containers] == [
        pb.CONTAINER_CREATED,
        pb.CONTAINER_RUNNING,
        pb.CONTAINER_CREATED,
    ]


def test_record_labels_are_the_configs_read_once() -> None:
    r = ContainerRecord(
        id="a" * 64,
        sandbox_id="s" * 64,
        backend="fake",
        config=pb.ContainerConfig(labels={"app": "web", "tier": "1"}),
        created_at=1,
        log_path="",
    )
    labels = record_labels(r)
    assert labels == {"app": "web", "tier": "1"} and type(labels) is dict
    assert record_labels(r) is labels
    assert with_labels([r], {"app": "web"}) == [r] and with_labels([r], {"app": "db"}) == []


def test_status_cache_reuses_only_for_the_same_record_and_key() -> None:
    cache = StatusCache(size=2)
    built: list[str] = []

    def build(tag: str) -> Callable[[], bytes]:
        return lambda: built.append(tag) or tag.encode()

    rec, status = object(), object()
    assert cache.get("a", rec, (status, "x", 1), build("1")) == b"1"
    assert cache.get("a", rec, (status, "x", 1), build("2")) == b"1"  # same objects and values
    assert cache.get("a", rec, (object(), "x", 1), build("3")) == b"3"  # a new status object
    same_values = ("x" * 2)[:1]  # an equal string that is another object
    assert cache.get("a", rec, (status, same_values, 1), build("4")) == b"4"
    assert cache.get("a", rec, (status, "x", 1), build("5")) == b"4"
    assert cache.get("a", rec, (status, "x", 2), build("6")) == b"6"
    assert cache.get("a", object(), (status, "x", 2), build("7")) == b"7"  # another record, same ID
    cache.get("b", rec, (), build("8"))
    cache.get("c", rec, (), build("9"))  # over the bound: the oldest entry goes
    assert len(cache) == 2
    assert cache.get("a", rec, (status, "x", 2), build("10")) == b"10"
    assert built == ["1", "3", "4", "6", "7", "8", "9", "10"]


async def test_cached_statuses_follow_every_change(running: Running) -> None:
    """ContainerStatus and PodSandboxStatus, served from encoded bytes, show each change at once."""
    rt = running.rt
    sc = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="p", uid="u", namespace="n"))
    pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cc = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="c"), image=pb.ImageSpec(image="busybox"), command=["sleep", "60"]
    )
    await running.im.PullImage(pb.PullImageRequest(image=cc.image))
    req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
    cid = (await rt.CreateContainer(req)).container_id

    async def state() -> tuple[int, int, int]:
        st = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
        return st.state, st.resources.linux.cpu_shares, st.exit_code

    async def pod_state() -> int:
        return int((await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))).status.state)

    assert await state() == (pb.CONTAINER_CREATED, 0, 0)
    assert await state() == (pb.CONTAINER_CREATED, 0, 0)
    await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    assert (await state())[0] == pb.CONTAINER_RUNNING
    res = pb.LinuxContainerResources(cpu_shares=512)
    await rt.UpdateContainerResources(pb.UpdateContainerResourcesRequest(container_id=cid, linux=res))
    assert await state() == (pb.CONTAINER_RUNNING, 512, 0)
    assert await pod_state() == pb.SANDBOX_READY
    await rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=0))
    st, _, code = await state()
    assert st == pb.CONTAINER_EXITED and code != 0
    await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
    assert await pod_state() == pb.SANDBOX_NOTREADY
    verbose = await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True))
    assert verbose.status.state == pb.CONTAINER_EXITED and "info" in verbose.info
    await rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_answers_are_kept_for_their_epoch_and_bounded() -> None:
    answers = Answers(size=2, max_bytes=4)
    answers.put("a", 1, b"A")
    assert answers.get("a", 1) == b"A"
    answers.put("b", 1, b"B")
    answers.put("c", 1, b"C")  # over the bound: the oldest filter goes
    assert answers.get("a", 1) is None and answers.get("c", 1) == b"C"
    answers.put("big", 1, b"12345")  # longer than max_bytes: not kept
    assert answers.get("big", 1) is None and len(answers) == 2
    assert answers.get("c", 2) is None  # anything changed since: built again...
    assert len(answers) == 0  # ...and nothing of the old epoch is held any more
    answers.put("c", 2, b"C2")
    answers.put("d", 1, b"D")  # built before a change it did not see: replaces nothing usable
    assert answers.get("c", 2) is None and answers.get("d", 2) is None


def test_the_epoch_moves_with_every_change_a_list_answer_reads() -> None:
    table: Table[ContainerRecord] = Table("container")
    rec = _labelled("a", {"app": "web"})
    seen = [ContainerRecord.epoch]

    def moved() -> bool:
        now = ContainerRecord.epoch
        fresh = now not in seen
        seen.append(now)
        return fresh

    table.add(rec)
    assert moved()
    rec.committed = True
    assert moved()
    rec.status = dataclasses.replace(rec.status, started_at=5)
    assert moved()
    sandbox_epoch = SandboxRecord.epoch
    # What no answer is made of moves nothing: the kept entry, the label map, a backend's notes.
    rec.wire = (rec.status, b"x")
    rec.label_map = {"app": "web"}
    rec.backend_data["k"] = "v"
    assert not moved()
    table.discard(rec.id)
    assert moved()
    table.discard(rec.id)  # nothing there: nothing changed
    assert not moved()
    assert SandboxRecord.epoch == sandbox_epoch  # each kind its own


async def test_kept_list_answers_follow_every_change(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ListContainers and ListPodSandbox, unfiltered and by state and label, after each step of a
    pod's life (an exit the backend reports too); a relist with nothing changed walks no record."""
    rt = running.rt
    encoded: list[int] = []
    original = ListCache.encode

    def counting(self: ListCache[Any], records: Any) -> bytes:
        encoded.append(1)
        return original(self, records)

    monkeypatch.setattr(ListCache, "encode", counting)
    sc = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="p", uid="u", namespace="n"), labels={"app": "x"}
    )
    cc = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="c"),
        image=pb.ImageSpec(image="busybox"),
        command=["sh", "-c", "sleep 0.2; exit 3"],
        labels={"app": "x"},
    )
    await running.im.PullImage(pb.PullImageRequest(image=cc.image))
    running_only = pb.ContainerStateValue(state=pb.CONTAINER_RUNNING)
    ready_only = pb.PodSandboxStateValue(state=pb.SANDBOX_READY)

    async def containers() -> tuple[list[tuple[str, int]], list[str], list[str]]:
        every = (await rt.ListContainers(pb.ListContainersRequest())).containers
        up = (
            await rt.ListContainers(pb.ListContainersRequest(filter=pb.ContainerFilter(state=running_only)))
        ).containers
        app = pb.ContainerFilter(label_selector={"app": "x"})
        labelled = (await rt.ListContainers(pb.ListContainersRequest(filter=app))).containers
        return [(c.id, c.state) for c in every], [c.id for c in up], [c.id for c in labelled]

    async def pods() -> tuple[list[tuple[str, int]], list[str]]:
        every = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
        ready = pb.PodSandboxFilter(state=ready_only)
        return [(p.id, p.state) for p in every], [
            p.id for p in (await rt.ListPodSandbox(pb.ListPodSandboxRequest(filter=ready))).items
        ]

    assert await containers() == ([], [], []) and await pods() == ([], [])
    pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    assert await pods() == ([(pod, pb.SANDBOX_READY)], [pod])
    cid = (
        await rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc))
    ).container_id
    assert await containers() == ([(cid, pb.CONTAINER_CREATED)], [], [cid])
    await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    assert await containers() == ([(cid, pb.CONTAINER_RUNNING)], [cid], [cid])
    # Nothing changed: the same answers, not one record walked or encoded again.
    encoded.clear()
    assert await containers() == ([(cid, pb.CONTAINER_RUNNING)], [cid], [cid])
    assert await pods() == ([(pod, pb.SANDBOX_READY)], [pod])
    assert encoded == []
    # The process ends on its own: the backend says so, and the next relist shows it.
    exited = ([(cid, pb.CONTAINER_EXITED)], [], [cid])

    async def has_exited() -> bool:
        return await containers() == exited

    await until(has_exited)
    await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
    assert await pods() == ([(pod, pb.SANDBOX_NOTREADY)], [])
    await rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
    assert await containers() == ([], [], [])
    await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
    assert await pods() == ([], [])
