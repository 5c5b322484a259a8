"""The encoded answers at the edge (shim/cri/answers.py): every answer equals the plain path's
message encoded; kept List answers and kept status answers follow every change."""

import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from backends.contract.records import ContainerRecord
from cri_api import api_pb2 as pb
from shim.cri.answers import Answers, ListCache, StatusCache, field1_entry
from shim.cri.filters import record_labels, with_labels
from shim.cri.store import Store, Table
from tests.conftest import Running
from tests.criutil import until
from tests.shim.services_kit import create, open_kit, run_pod, start


def test_concatenated_entries_are_a_valid_response() -> None:
    items = [pb.Container(id=str(i) * 64, labels={"a": "b" * i}) for i in range(1, 300, 37)]
    data = b"".join(field1_entry(c.SerializeToString()) for c in items)
    assert list(pb.ListContainersResponse.FromString(data).containers) == items
    assert data == pb.ListContainersResponse(containers=items).SerializeToString()


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


def test_list_entries_follow_each_records_revision() -> None:
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
    store = Store(None)
    for r in recs:
        store.add(r)
    first = pb.ListContainersResponse.FromString(cache.encode(recs))
    assert [c.id for c in first.containers] == [r.id for r in recs] and len(built) == 3
    assert cache.encode(recs) == first.SerializeToString() and len(built) == 3  # all kept
    store.update(recs[1], status=dataclasses.replace(recs[1].status, started_at=5))
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


def test_status_cache_reuses_only_for_the_same_record_at_the_same_revision() -> None:
    cache = StatusCache(size=2)
    built: list[str] = []

    def build(tag: str) -> Callable[[], bytes]:
        return lambda: built.append(tag) or tag.encode()

    store = Store(None)
    a, b, c = (_labelled(name, {}) for name in "abc")
    for r in (a, b, c):
        store.add(r)
    assert cache.get(a, build("1")) == b"1"
    assert cache.get(a, build("2")) == b"1"  # the same record, unchanged
    store.update(a, status=dataclasses.replace(a.status, started_at=5))
    assert cache.get(a, build("3")) == b"3"  # changed through the store: built again
    twin = dataclasses.replace(a)  # another record of the same ID (removed and made again)
    assert cache.get(twin, build("4")) == b"4"
    cache.get(b, build("5"))
    cache.get(c, build("6"))  # over the bound: the oldest entry goes
    assert len(cache) == 2
    assert cache.get(twin, build("7")) == b"7"
    assert built == ["1", "3", "4", "5", "6", "7"]


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


def test_answers_are_kept_for_their_version_and_bounded() -> None:
    answers = Answers(size=2, max_bytes=4)
    answers.put("a", 1, b"A")
    assert answers.get("a", 1) == b"A"
    answers.put("b", 1, b"B")
    answers.put("c", 1, b"C")  # over the bound: the oldest filter goes
    assert answers.get("a", 1) is None and answers.get("c", 1) == b"C"
    answers.put("big", 1, b"12345")  # longer than max_bytes: not kept
    assert answers.get("big", 1) is None and len(answers) == 2
    assert answers.get("c", 2) is None  # anything changed since: built again...
    assert len(answers) == 0  # ...and nothing of the old version is held any more
    answers.put("c", 2, b"C2")
    answers.put("d", 1, b"D")  # built before a change it did not see: replaces nothing usable
    assert answers.get("c", 2) is None and answers.get("d", 2) is None


def test_the_version_moves_with_every_change_of_the_store() -> None:
    store = Store(None)
    table: Table[ContainerRecord] = store.containers
    rec = _labelled("a", {"app": "web"})
    seen = [table.version]

    def moved() -> bool:
        fresh = table.version not in seen
        seen.append(table.version)
        return fresh

    store.add(rec)
    assert moved()
    store.update(rec, committed=True)
    assert moved()
    store.record_effect(rec, status=dataclasses.replace(rec.status, started_at=5))
    assert moved()
    sandboxes = store.sandboxes.version
    # What no answer is made of moves nothing: the kept entry, the label map, a backend's notes.
    rec.wire = (rec.revision, b"x")
    rec.label_map = {"app": "web"}
    rec.backend_data["k"] = "v"
    assert not moved()
    store.remove(rec)
    assert moved()
    table.discard(rec.id)  # nothing there: nothing changed
    assert not moved()
    assert store.sandboxes.version == sandboxes  # each table its own


async def test_kept_list_answers_follow_every_change(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ListContainers and ListPodSandbox, unfiltered and by state and label, after each step of a
    pod's life (an exit the backend reports too); a relist with nothing changed walks no record."""
    rt = running.rt
    encoded: list[int] = []
    original = ListCache.entries

    def counting(self: ListCache[Any], records: Any) -> list[bytes]:
        encoded.append(1)
        return original(self, records)

    monkeypatch.setattr(ListCache, "entries", counting)
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


# ---------------------------------------------------------------------- the edge equals the plain path


async def test_every_encoded_answer_is_the_plain_paths_message_encoded(short_tmp: str) -> None:
    """For each polled RPC the edge answers, at each step of two pods' lives and under every
    filter the CRI has: the edge's bytes are the service's own answer, encoded."""
    async with open_kit(short_tmp) as kit:
        s = kit.servicer
        fast = s.answers
        checked: list[str] = []

        def same(name: str, edge: Any, plain: Any) -> None:
            assert (
                edge if isinstance(edge, bytes) else edge.SerializeToString()
            ) == plain.SerializeToString()
            checked.append(name)

        def check_all() -> None:
            same("Version", fast.version(pb.VersionRequest()), s.runtime.version(pb.VersionRequest()))
            pods = [p.id for p in s.sandboxes.list_(pb.ListPodSandboxRequest()).items]
            ctrs = [c.id for c in s.containers.list_(pb.ListContainersRequest()).containers]
            pod_filters = [
                pb.PodSandboxFilter(),
                pb.PodSandboxFilter(state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY)),
                pb.PodSandboxFilter(state=pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY)),
                pb.PodSandboxFilter(label_selector={"app": "web"}),
                pb.PodSandboxFilter(id="0"),  # a prefix of none or several: matches nothing
                *(pb.PodSandboxFilter(id=p[:8]) for p in pods),
            ]
            for f in pod_filters:
                req = pb.ListPodSandboxRequest(filter=f)
                for _ in range(2):  # built, then kept
                    same("ListPodSandbox", fast.list_pod_sandbox(req), s.sandboxes.list_(req))
            states = (pb.CONTAINER_CREATED, pb.CONTAINER_RUNNING, pb.CONTAINER_EXITED)
            ctr_filters = [
                pb.ContainerFilter(),
                *(pb.ContainerFilter(state=pb.ContainerStateValue(state=st)) for st in states),
                pb.ContainerFilter(label_selector={"app": "web"}),
                *(pb.ContainerFilter(pod_sandbox_id=p[:10]) for p in pods),
                *(pb.ContainerFilter(id=c[:12]) for c in ctrs),
            ]
            for f in ctr_filters:
                req = pb.ListContainersRequest(filter=f)
                for _ in range(2):
                    same("ListContainers", fast.list_containers(req), s.containers.list_(req))
            for p in pods:
                req = pb.PodSandboxStatusRequest(pod_sandbox_id=p)
                for _ in range(2):
                    same("PodSandboxStatus", fast.pod_sandbox_status(req), s.sandboxes.status(req))
            for c in ctrs:
                req = pb.ContainerStatusRequest(container_id=c)
                for _ in range(2):
                    same("ContainerStatus", fast.container_status(req), s.containers.status(req))

        check_all()
        web = await run_pod(kit, "web", labels={"app": "web"})
        other = await run_pod(kit, "other")
        check_all()
        first = await create(kit, web, "first", labels={"app": "web"})
        second = await create(kit, other, "second")
        check_all()
        await start(kit, first)
        check_all()
        res = pb.LinuxContainerResources(cpu_shares=512)
        await kit.ok(
            "UpdateContainerResources", pb.UpdateContainerResourcesRequest(container_id=first, linux=res)
        )
        check_all()
        await kit.ok("StopContainer", pb.StopContainerRequest(container_id=first))
        await kit.ok("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=other.id))
        check_all()
        await kit.ok("RemoveContainer", pb.RemoveContainerRequest(container_id=second))
        await kit.ok("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=other.id))
        check_all()
        assert {"Version", "ListPodSandbox", "ListContainers", "PodSandboxStatus", "ContainerStatus"} <= set(
            checked
        )
