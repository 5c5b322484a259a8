"""Fault injection as a wrapper: any backend can wear it, and the fake does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from backends.contract import (
    Backend,
    Checkpoint,
    ContainerCheckpoint,
    ContainerRecord,
    Metrics,
    PodCheckpoint,
    Resources,
    SandboxRecord,
)
from backends.contract.errors import NotFoundError, UnavailableError
from backends.contract.usage import PodMetrics
from backends.fake import FakeBackend, FakeRuntime, FaultInjector
from cri_api import api_pb2 as pb


def sandbox(sid: str = "a" * 64) -> SandboxRecord:
    return SandboxRecord(id=sid, handler="", backend="x", config=pb.PodSandboxConfig(), created_at=0)


class PodMetricsPart:
    async def sandbox_metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, PodMetrics]:
        return {s.id: PodMetrics(name=s.id[:12]) for s in sandboxes}


class MetricsRuntime(FakeRuntime):
    """A minimal backend with a part the fake lacks."""

    def __init__(self, name: str, options: dict[str, object]) -> None:
        super().__init__(name, options)
        self.metrics = PodMetricsPart()


class CheckpointPart:
    def __init__(self) -> None:
        self.checkpoints: list[str] = []

    async def checkpoint_container(self, container: ContainerRecord, location: str, timeout: int) -> None:
        self.checkpoints.append(location)

    async def checkpoint_pod(
        self, sandbox: SandboxRecord, containers: object, output_dir: str, options: object
    ) -> None:
        self.checkpoints.append(output_dir)

    async def open_pod_checkpoint(self, path: str, options: object, configs: object) -> PodCheckpoint:
        return PodCheckpoint(())

    async def restore_container(
        self, container: ContainerRecord, sandbox: SandboxRecord, checkpoint: object
    ) -> None:
        pass

    def checkpoint_image(self, image: str) -> bool:
        return False

    async def open_container_checkpoint(self, source: str) -> ContainerCheckpoint:
        return ContainerCheckpoint(pb.ContainerConfig())


class CheckpointRuntime(FakeRuntime):
    def __init__(self, name: str, options: dict[str, object]) -> None:
        super().__init__(name, options)
        self.checkpoint = CheckpointPart()  # type: ignore[assignment]


class NoCheckpointRuntime(FakeRuntime):
    def __init__(self, name: str, options: dict[str, object]) -> None:
        super().__init__(name, options)
        self.checkpoint = None


async def test_errors_are_fifo_per_method_and_never_reach_the_inner_backend() -> None:
    inner = FakeRuntime("inner", {})
    faults = FaultInjector(inner)
    faults.inject_error("run_sandbox", UnavailableError("first"))
    faults.inject_error("run_sandbox", UnavailableError("second"))
    for expected in ("first", "second"):
        with pytest.raises(UnavailableError, match=expected):
            await faults.lifecycle.run_sandbox(sandbox())
        assert inner.lifecycle.sandboxes == {}
    net = await faults.lifecycle.run_sandbox(sandbox())
    assert net.ip == "10.88.0.2" and list(inner.lifecycle.sandboxes) == ["a" * 64]
    # Other methods were never affected, and every call is recorded, failed or not.
    assert (await faults.lifecycle.health()).runtime_ready
    assert [(c.method, c.args) for c in faults.calls] == [("run_sandbox", ("a" * 64,))] * 3 + [("health", ())]


async def test_latency_delays_only_its_method() -> None:
    faults = FaultInjector(FakeRuntime("inner", {}))
    faults.set_latency("list_images", 0.2)
    t0 = time.monotonic()
    slow = asyncio.ensure_future(faults.images.list_images())
    await faults.lifecycle.health()
    assert time.monotonic() - t0 < 0.1  # the other method did not wait
    assert await slow == []
    assert time.monotonic() - t0 >= 0.2


async def test_configured_from_handler_options() -> None:
    clock = iter(range(100)).__next__
    faults = FaultInjector(
        FakeRuntime("inner", {}),
        {
            "latency": {"image_fs_info": 0.01},
            "errors": {"pull_image": ["NOT_FOUND: gone", "UNAVAILABLE"]},
            "max_calls": 2,
        },
        clock=clock,
    )
    spec = pb.ImageSpec(image="busybox:1")
    with pytest.raises(NotFoundError, match="gone"):
        await faults.images.pull_image(spec, None, None)
    with pytest.raises(UnavailableError, match="injected UNAVAILABLE"):
        await faults.images.pull_image(spec, None, None)
    assert (await faults.images.pull_image(spec, None, None)).startswith("sha256:")
    # The log is bounded, and stamped by the given clock.
    assert [(c.method, c.args, c.at) for c in faults.calls] == [
        ("pull_image", ("busybox:1",), 1),
        ("pull_image", ("busybox:1",), 2),
    ]
    with pytest.raises(ValueError, match="unknown error code"):
        FaultInjector(FakeRuntime("inner", {}), {"errors": {"health": ["BROKEN: x"]}})


async def test_is_a_backend_and_forwards_what_is_not_a_call() -> None:
    inner = FakeRuntime("inner", {"cgroup_driver": "systemd"})
    faults = FaultInjector(inner)
    assert isinstance(faults, Backend) and faults.wrapped is inner
    assert faults.name == "inner"
    assert faults.capabilities == inner.capabilities
    assert faults.lifecycle.runtime_config().linux.cgroup_driver == pb.SYSTEMD
    assert list(faults.calls) == []  # runtime_config is not a call to fail


@pytest.mark.parametrize(
    ("inner_cls", "present"),
    [
        # The fake records pod resources (UpdatePodSandboxResources) and checkpoints; metrics
        # are its subclass's here, and a subclass drops its checkpoints.
        (FakeRuntime, ("checkpoint", "resources")),
        (MetricsRuntime, ("checkpoint", "metrics", "resources")),
        (CheckpointRuntime, ("checkpoint", "resources")),
        (NoCheckpointRuntime, ("resources",)),
    ],
    ids=["fake", "metrics", "checkpoint", "no-checkpoint"],
)
def test_optional_parts_pass_through_only_when_the_inner_backend_has_them(
    inner_cls: type[FakeRuntime], present: tuple[str, ...]
) -> None:
    faults = FaultInjector(inner_cls("inner", {}))
    assert isinstance(faults, FaultInjector) and isinstance(faults, Backend)
    for part, proto in (("metrics", Metrics), ("checkpoint", Checkpoint), ("resources", Resources)):
        got = getattr(faults, part)
        assert (got is not None) == (part in present), part
        assert got is None or isinstance(got, proto), part


async def test_optional_calls_are_recorded_and_injectable() -> None:
    faults = FaultInjector(MetricsRuntime("inner", {}))
    assert faults.metrics is not None
    faults.inject_error("sandbox_metrics", UnavailableError("cadvisor down"))
    with pytest.raises(UnavailableError):
        await faults.metrics.sandbox_metrics([sandbox("b" * 64)], [])
    metrics = await faults.metrics.sandbox_metrics([sandbox("b" * 64)], [])
    assert {sid: m.name for sid, m in metrics.items()} == {"b" * 64: "b" * 12}
    assert [(c.method, c.args) for c in faults.calls] == [
        ("sandbox_metrics", (1,)),
        ("sandbox_metrics", (1,)),
    ]

    inner = CheckpointRuntime("inner", {})
    checkpointing = FaultInjector(inner)
    container = ContainerRecord(
        id="c" * 64, sandbox_id="b" * 64, backend="x", config=pb.ContainerConfig(), created_at=0, log_path=""
    )
    await checkpointing.checkpoint.checkpoint_container(container, "/tmp/x.tar", 5)
    assert checkpointing.calls_to("checkpoint_container")[0].args == ("c" * 64, "/tmp/x.tar", 5)
    assert inner.checkpoint.checkpoints == ["/tmp/x.tar"]


async def test_fake_backend_wears_the_injector_and_can_be_wrapped_again() -> None:
    fake = FakeBackend("fake", {"errors": {"run_sandbox": ["UNAVAILABLE: inner"]}})
    assert isinstance(fake, FaultInjector) and isinstance(fake.wrapped, FakeRuntime)
    outer = FaultInjector(fake)
    outer.inject_error("run_sandbox", UnavailableError("outer"))
    with pytest.raises(UnavailableError, match="outer"):
        await outer.lifecycle.run_sandbox(sandbox())
    assert fake.calls_to("run_sandbox") == []  # stopped in front of the fake
    with pytest.raises(UnavailableError, match="inner"):
        await outer.lifecycle.run_sandbox(sandbox())
    assert (await outer.lifecycle.run_sandbox(sandbox())).ip
    assert len(outer.calls_to("run_sandbox")) == 3 and len(fake.calls_to("run_sandbox")) == 2
    # The fake's own helpers reach its parts.
    fake.runtime_ready = False
    assert not (await outer.lifecycle.health()).runtime_ready
    assert fake.runtime.lifecycle.runtime_ready is False


async def test_images_are_answered_from_memory_unless_a_fault_waits_for_them() -> None:
    """The fake's store is memory: ListImages and ImageFsInfo answer at once (list_images_now,
    image_fs_info_now), each recorded as the call; a latency or an error set for one leaves only
    its coroutine, which delays or fails it. A wrapper around the fake passes that on."""
    fake = FakeBackend("fake", {"state_dir": ""})
    assert fake.images.list_images_now() == await fake.images.list_images()
    assert fake.images.image_fs_info_now() == await fake.images.image_fs_info()
    assert [c.method for c in fake.calls] == ["list_images", "list_images", "image_fs_info", "image_fs_info"]
    fake.set_latency("list_images", 0.01)
    fake.inject_error("image_fs_info", UnavailableError("disk gone"))
    assert fake.images.list_images_now() is None and fake.images.image_fs_info_now() is None
    with pytest.raises(UnavailableError, match="disk gone"):
        await fake.images.image_fs_info()
    assert fake.images.image_fs_info_now() is not None  # the error was used up
    outer = FaultInjector(fake)
    assert outer.images.list_images_now() is None  # the fake's own latency still holds
    fake.set_latency("list_images", 0)
    assert outer.images.list_images_now() == []
    assert [c.method for c in outer.calls] == ["list_images"]
