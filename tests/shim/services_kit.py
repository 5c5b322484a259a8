"""The sandbox, container and image services under test (issue 44), reached only the way a client
reaches them: through the gRPC edge (``CriServicer.begin``), and watched only through the CRI (the
List and Status answers, GetContainerEvents), the state directory's record files and the fake
backend's spy and own view.

Every internal this needs (how a Shim is built, how the fake keeps its pods and containers, where
the state directory writes, how a subscription is known to have started) is reached in one place
here, so that a refactoring of shim/cri/ or backends/ changes this file only, not the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest

from backends.contract import Backend
from backends.fake import PROGRAM_ANNOTATION, FakeBackend, error_from_spec
from backends.registry import HandlerRegistry
from cri_api import api_pb2 as pb
from shim.config import Config
from shim.cri.codes import Code
from shim.cri.errors import ResourceExhaustedError
from shim.cri.servicer import CriServicer, Rpc
from shim.cri.state import Shim
from shim.cri.store import StateDir, Store
from tests.conftest import make_ids
from tests.criutil import container_config, sandbox_config

Answer = tuple[Code, str, Any]

# A container that runs, silently, until it is stopped (the fake's program annotation).
RUNS_UNTIL_STOPPED = {PROGRAM_ANNOTATION: "{}"}


# ---------------------------------------------------------------------- the edge


def rpc_named(servicer: CriServicer, method_name: str) -> Rpc:
    for rpc in servicer.runtime_rpcs + servicer.image_rpcs:
        if rpc.name == method_name:
            return rpc
    raise LookupError(f"no RPC named {method_name!r}")


async def call(servicer: CriServicer, method_name: str, request: Any) -> Answer:
    """One unary call as a transport makes it: (code, detail, response); a response the
    service answered already encoded is decoded into the RPC's response message."""
    outcome = servicer.begin(rpc_named(servicer, method_name), request)
    if inspect.isawaitable(outcome):
        outcome = await outcome
    code, detail, response = outcome
    if isinstance(response, bytes):
        response = getattr(pb, f"{method_name}Response").FromString(response)
    return code, detail, response


# ---------------------------------------------------------------------- the shim


@dataclasses.dataclass
class Kit:
    servicer: CriServicer
    fake: FakeBackend
    root: str
    issued: list[str]  # every ID the shim took for a new pod or container, in order

    @property
    def state_dir(self) -> str:
        return os.path.join(self.root, "state")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.root, "logs")

    async def call(self, method_name: str, request: Any) -> Answer:
        return await call(self.servicer, method_name, request)

    async def ok(self, method_name: str, request: Any) -> Any:
        code, detail, response = await self.call(method_name, request)
        assert code == Code.OK, f"{method_name}: {code.name} {detail}"
        return response

    def inject(self, errors: tuple[tuple[str, str], ...]) -> None:
        """Each (backend method, "CODE: message"): that method's next call fails so."""
        for method, spec in errors:
            self.fake.inject_error(method, error_from_spec(spec))

    def calls_mark(self) -> int:
        return len(self.fake.calls)

    def calls_since(self, mark: int) -> list[tuple[str, tuple[Any, ...]]]:
        """The backend calls (method, arguments) made since ``mark`` (the fake's spy)."""
        return [(c.method, c.args) for c in list(self.fake.calls)[mark:]]


@contextlib.asynccontextmanager
async def open_kit(
    root: str,
    images: tuple[str, ...] = ("busybox",),
    *,
    handlers: Mapping[str, Backend] | None = None,
    default: str = "fake",
    **fake_options: Any,
) -> AsyncIterator[Kit]:
    """A Shim over the fake backend, its state under ``root``, with ``images`` pulled; beside it
    the other ``handlers`` (their lifecycles are the caller's), ``default`` the default handler."""
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    fake = FakeBackend("fake", {"state_dir": os.path.join(root, "fake"), "pull_seconds": 0, **fake_options})
    store = Store(StateDir(os.path.join(root, "state")))
    store.load()
    issued: list[str] = []
    fresh: Callable[[], str] = make_ids(os.path.basename(root))

    def new_id() -> str:
        issued.append(fresh())
        return issued[-1]

    base = Config()
    config = dataclasses.replace(
        base, nri=dataclasses.replace(base.nri, enable=False, socket_path=os.path.join(root, "nri.sock"))
    )
    shim = Shim(
        config, HandlerRegistry({"fake": fake, **(handlers or {})}, default), store, id_factory=new_id
    )
    await fake.lifecycle.start(shim)
    kit = Kit(CriServicer(shim), fake, root, issued)
    try:
        for image in images:
            await kit.ok("PullImage", pb.PullImageRequest(image=pb.ImageSpec(image=image)))
        yield kit
    finally:
        await shim.io.aclose()
        store.close()
        await fake.lifecycle.close()


# ---------------------------------------------------------------------- what exists


@dataclasses.dataclass(frozen=True)
class Held:
    """What the fake runtime itself has (its own view, not the shim's)."""

    sandboxes: frozenset[str]
    containers: frozenset[str]
    running: frozenset[str]


def backend_holds(kit: Kit) -> Held:
    life = kit.fake.runtime.lifecycle
    return Held(frozenset(life.sandboxes), frozenset(life.containers), frozenset(life.running))


def record_files(kit: Kit) -> dict[str, frozenset[str]]:
    """The files of the state directory's record folders (one ``ID.json`` per record)."""
    return {
        folder: frozenset(os.listdir(os.path.join(kit.state_dir, folder)))
        for folder in ("sandboxes", "containers")
    }


class Disk:
    """The state directory's disk: every record write is counted, and from ``full_from(n)`` on the
    n-th write and all after it fail as a full disk does, until ``free()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes: list[str] = []
        self._fail_from = 0
        original = StateDir.write_atomic

        def write_atomic(path: str, data: bytes) -> None:
            self.writes.append(path)
            if self._fail_from and len(self.writes) >= self._fail_from:
                raise ResourceExhaustedError(f"cannot record {path}: No space left on device")
            original(path, data)

        monkeypatch.setattr(StateDir, "write_atomic", staticmethod(write_atomic))

    def full_from(self, nth: int) -> None:
        """The ``nth`` write from now (1: the next one) and every one after it fail."""
        self._fail_from = len(self.writes) + nth if nth else 0

    def free(self) -> None:
        self._fail_from = 0


# ---------------------------------------------------------------------- events


def kind(event_type: int) -> str:
    """CONTAINER_STARTED_EVENT -> STARTED."""
    return pb.ContainerEventType.Name(event_type).removeprefix("CONTAINER_").removesuffix("_EVENT")


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple[Code, str] | None = None

    async def abort(self, code: Code, details: str = "") -> None:
        self.aborted = (code, details)


class Events:
    """What a GetContainerEvents client receives, from ``subscribed`` on."""

    def __init__(self) -> None:
        self.got: list[pb.ContainerEventResponse] = []

    def of(self, container_id: str) -> list[str]:
        return [kind(e.container_event_type) for e in self.got if e.container_id == container_id]

    def kinds(self) -> list[str]:
        return [kind(e.container_event_type) for e in self.got]

    async def settle(self) -> None:
        """Until what was published has reached the client."""
        for _ in range(10):
            await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def subscribed(kit: Kit) -> AsyncIterator[Events]:
    events = Events()
    handler = kit.servicer.stream_handler(rpc_named(kit.servicer, "GetContainerEvents"))
    stream = handler(pb.GetEventsRequest(), _Context())

    async def read() -> None:
        async for event in stream:
            events.got.append(event)

    hub = kit.servicer.shim.events
    before = hub.subscriber_count
    task = asyncio.create_task(read())
    for _ in range(100):  # the subscription starts at the stream's first read
        if hub.subscriber_count > before:
            break
        await asyncio.sleep(0)
    else:
        raise AssertionError("GetContainerEvents did not subscribe")
    try:
        yield events
        await events.settle()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---------------------------------------------------------------------- CRI shorthands


@dataclasses.dataclass(frozen=True)
class Pod:
    id: str
    config: pb.PodSandboxConfig


def pod_request(kit: Kit, name: str = "pod", labels: dict[str, str] | None = None) -> pb.RunPodSandboxRequest:
    cfg = sandbox_config(name=name, uid=f"uid-{name}", log_directory=kit.log_dir, labels=labels)
    return pb.RunPodSandboxRequest(config=cfg)


async def run_pod(kit: Kit, name: str = "pod", labels: dict[str, str] | None = None) -> Pod:
    req = pod_request(kit, name, labels)
    return Pod((await kit.ok("RunPodSandbox", req)).pod_sandbox_id, req.config)


def container_request(
    pod: Pod, name: str = "ctr", labels: dict[str, str] | None = None
) -> pb.CreateContainerRequest:
    cfg = container_config(name=name, log_path=f"{name}.log", labels=labels, annotations=RUNS_UNTIL_STOPPED)
    return pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=cfg, sandbox_config=pod.config)


async def create(kit: Kit, pod: Pod, name: str = "ctr", labels: dict[str, str] | None = None) -> str:
    return str((await kit.ok("CreateContainer", container_request(pod, name, labels))).container_id)


async def start(kit: Kit, container_id: str) -> None:
    await kit.ok("StartContainer", pb.StartContainerRequest(container_id=container_id))


async def listed_pods(
    kit: Kit, *, id: str = "", state: int | None = None, labels: dict[str, str] | None = None
) -> list[str]:
    f = pb.PodSandboxFilter(id=id, label_selector=labels or {})
    if state is not None:
        f.state.state = state
    return [p.id for p in (await kit.ok("ListPodSandbox", pb.ListPodSandboxRequest(filter=f))).items]


async def listed_containers(
    kit: Kit,
    *,
    id: str = "",
    pod: str = "",
    state: int | None = None,
    labels: dict[str, str] | None = None,
) -> list[str]:
    f = pb.ContainerFilter(id=id, pod_sandbox_id=pod, label_selector=labels or {})
    if state is not None:
        f.state.state = state
    resp = await kit.ok("ListContainers", pb.ListContainersRequest(filter=f))
    return [c.id for c in resp.containers]


async def container_status(kit: Kit, container_id: str) -> pb.ContainerStatus:
    resp = await kit.ok("ContainerStatus", pb.ContainerStatusRequest(container_id=container_id))
    return resp.status


async def pod_status(kit: Kit, pod_id: str) -> pb.PodSandboxStatus:
    resp = await kit.ok("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
    return resp.status


@dataclasses.dataclass(frozen=True)
class Fault:
    """A failure to inject into one call of a service."""

    code: Code  # what the client must be answered
    errors: tuple[tuple[str, str], ...] = ()  # backend method -> its next call fails so
    # The call's n-th state write, and every one after it, fail as on a full disk (0: none; -1: its
    # last write, the commit). How many writes a call makes is counted, not assumed: a fault after
    # the last one must change nothing.
    full_disk_at: int = 0
    backend_keeps: bool = False  # the backend's own removal fails: it may keep the object (asked, though)
