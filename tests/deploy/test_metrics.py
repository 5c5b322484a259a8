"""The /metrics endpoint of a real server, scraped after real RPCs over its socket."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import shutil
import tempfile
import types
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.contract import Backend
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim import prometheus
from shim.config import Config, HandlerConfig
from shim.cri.errors import UnavailableError
from shim.server import Server

IMAGE = "registry.example/busybox:1.36"
IMAGE_SIZE = 5 * 1024 * 1024
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclasses.dataclass
class Running:
    server: Server
    endpoint: prometheus.MetricsEndpoint
    runtime: api_pb2_grpc.RuntimeServiceStub
    images: api_pb2_grpc.ImageServiceStub

    @property
    def fake(self) -> Backend:
        assert self.server.shim is not None
        return self.server.shim.registry.get("fake")


@pytest.fixture
def tmpdir_short() -> Iterator[str]:
    # A unix socket path is limited to 107 bytes: pytest's tmp_path is too long.
    d = tempfile.mkdtemp(prefix="crim", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def running(tmpdir_short: str) -> AsyncIterator[Running]:
    base = Config()
    cfg = dataclasses.replace(
        base,
        server=dataclasses.replace(
            base.server, listen=f"unix://{tmpdir_short}/s.sock", state_dir=f"{tmpdir_short}/state"
        ),
        handlers={"fake": HandlerConfig("fake", "fake", {"images": {IMAGE: {"size": IMAGE_SIZE}}})},
    )
    server = Server(cfg)
    endpoint = prometheus.start("127.0.0.1:0", server)
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{tmpdir_short}/s.sock")
    try:
        yield Running(
            server,
            endpoint,
            api_pb2_grpc.RuntimeServiceStub(channel),
            api_pb2_grpc.ImageServiceStub(channel),
        )
    finally:
        await channel.close()
        await server.stop(grace=1)
        await endpoint.wait_closed()


async def http_get(host: str, port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


async def scrape(r: Running) -> Samples:
    status, headers, body = await http_get(r.endpoint.host, r.endpoint.port, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def sandbox_config(name: str) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="default")
    )


async def test_rpc_series_by_method_and_code(running: Running) -> None:
    await running.runtime.Version(pb.VersionRequest())
    run = await running.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config("web")))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id="nonexistent"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    s = await scrape(running)
    assert sample(s, "cri_shim_grpc_requests_total", method="RunPodSandbox", code="OK") == 1
    assert sample(s, "cri_shim_grpc_requests_total", method="Version", code="OK") == 1
    assert sample(s, "cri_shim_grpc_requests_total", method="PodSandboxStatus", code="NOT_FOUND") == 1
    assert sample(s, "cri_shim_grpc_requests_total", method="PodSandboxStatus", code="OK") is None
    assert sample(s, "cri_shim_grpc_request_duration_seconds_count", method="RunPodSandbox", code="OK") == 1
    assert (
        sample(
            s, "cri_shim_grpc_request_duration_seconds_bucket", method="RunPodSandbox", code="OK", le="+Inf"
        )
        == 1
    )
    assert (
        sample(s, "cri_shim_backend_call_duration_seconds_count", handler="fake", method="run_sandbox") == 1
    )
    assert sample(s, "cri_shim_pod_sandboxes", handler="fake", state="SANDBOX_READY") == 1
    assert sample(s, "cri_shim_pod_sandboxes", handler="fake", state="SANDBOX_NOTREADY") == 0

    await running.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=run.pod_sandbox_id))
    s = await scrape(running)
    assert sample(s, "cri_shim_pod_sandboxes", handler="fake", state="SANDBOX_READY") == 0
    assert sample(s, "cri_shim_pod_sandboxes", handler="fake", state="SANDBOX_NOTREADY") == 1
    assert sample(s, "cri_shim_grpc_requests_total", method="RunPodSandbox", code="OK") == 1


async def test_containers_by_state_and_handler(running: Running) -> None:
    sb_cfg = sandbox_config("db")
    run = await running.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=sb_cfg))
    await running.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=IMAGE)))
    ids = []
    for name in ("a", "b"):
        created = await running.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=run.pod_sandbox_id,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=IMAGE)
                ),
                sandbox_config=sb_cfg,
            )
        )
        ids.append(created.container_id)
    await running.runtime.StartContainer(pb.StartContainerRequest(container_id=ids[0]))

    s = await scrape(running)
    assert sample(s, "cri_shim_containers", handler="fake", state="CONTAINER_RUNNING") == 1
    assert sample(s, "cri_shim_containers", handler="fake", state="CONTAINER_CREATED") == 1
    assert sample(s, "cri_shim_containers", handler="fake", state="CONTAINER_EXITED") == 0
    assert (
        sample(s, "cri_shim_backend_call_duration_seconds_count", handler="fake", method="create_container")
        == 2
    )


async def test_image_pull_duration_and_bytes(running: Running) -> None:
    await running.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=IMAGE)))
    await running.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=IMAGE)))
    await running.endpoint.metrics.wait_size_lookups()

    s = await scrape(running)
    assert sample(s, "cri_shim_grpc_requests_total", method="PullImage", code="OK") == 2
    assert sample(s, "cri_shim_image_pulls_total", handler="fake", result="success") == 2
    assert sample(s, "cri_shim_image_pull_duration_seconds_count", handler="fake") == 2
    assert sample(s, "cri_shim_image_pull_bytes_total", handler="fake") == 2 * IMAGE_SIZE
    # The size lookup is not one of the shim's backend calls.
    assert (
        sample(s, "cri_shim_backend_call_duration_seconds_count", handler="fake", method="image_status")
        is None
    )


async def test_backend_errors_and_failed_pulls(running: Running) -> None:
    fake = running.fake
    fake.inject_error("run_sandbox", UnavailableError("engine down"))  # type: ignore[attr-defined]
    fake.inject_error("pull_image", UnavailableError("registry down"))  # type: ignore[attr-defined]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config("x")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError):
        await running.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=IMAGE)))

    s = await scrape(running)
    assert sample(s, "cri_shim_grpc_requests_total", method="RunPodSandbox", code="UNAVAILABLE") == 1
    assert (
        sample(
            s, "cri_shim_backend_errors_total", handler="fake", method="run_sandbox", error="UnavailableError"
        )
        == 1
    )
    assert sample(s, "cri_shim_image_pulls_total", handler="fake", result="error") == 1
    assert sample(s, "cri_shim_image_pull_bytes_total", handler="fake") is None
    assert sample(s, "cri_shim_pod_sandboxes", handler="fake", state="SANDBOX_READY") == 0


async def test_streaming_sessions_build_info_and_process(running: Running) -> None:
    s = await scrape(running)
    assert running.server.streaming is not None
    assert sample(s, "cri_shim_streaming_sessions") == 0
    assert sample(s, "cri_shim_log_bytes_dropped_total") == 0  # no full disk here
    real = running.server.streaming
    running.server.streaming = types.SimpleNamespace(open_sessions=3)
    try:
        s = await scrape(running)
    finally:
        running.server.streaming = real
    assert sample(s, "cri_shim_streaming_sessions") == 3
    assert sample(s, "cri_shim_build_info", version=__import__("shim").__version__) == 1
    resident = sample(s, "cri_shim_process_resident_memory_bytes")
    assert resident is not None and resident > 0


async def test_warm_pools_by_handler(running: Running) -> None:
    from backends.contract.pool import PoolFigures

    s = await scrape(running)
    assert sample(s, "cri_shim_warm_sandboxes_ready", handler="fake") is None  # no pool: no series
    inner = running.fake.wrapped  # type: ignore[attr-defined]
    inner.warm_figures = lambda: PoolFigures(size=4, ready=3, handed_out=7)
    try:
        s = await scrape(running)
    finally:
        del inner.warm_figures
    assert sample(s, "cri_shim_warm_sandboxes_ready", handler="fake") == 3
    assert sample(s, "cri_shim_warm_sandboxes_wanted", handler="fake") == 4
    assert sample(s, "cri_shim_warm_sandboxes_taken_total", handler="fake") == 7


async def test_backend_proxy_forwards_attributes_and_coroutines(running: Running) -> None:
    proxy = running.fake
    assert isinstance(proxy, prometheus.TimedBackend)
    inner = proxy.wrapped
    assert proxy.name == inner.name == "fake"
    assert proxy.capabilities == inner.capabilities
    assert isinstance(proxy, Backend)
    for part, method in (
        ("lifecycle", "run_sandbox"),
        ("images", "pull_image"),
        ("lifecycle", "health"),
        ("exec", "exec"),
        ("lifecycle", "start"),
        ("lifecycle", "close"),
        ("checkpoint", "checkpoint_pod"),
    ):
        assert inspect.iscoroutinefunction(getattr(getattr(proxy, part), method)), method
    assert proxy.metrics is inner.metrics is None  # absent parts stay absent
    assert not inspect.iscoroutinefunction(proxy.lifecycle.runtime_config)
    assert proxy.lifecycle.runtime_config() == inner.lifecycle.runtime_config()
    # Writes reach the wrapped backend (tests flip a fake's readiness this way).
    proxy.runtime_ready = False
    assert inner.runtime_ready is False  # type: ignore[attr-defined]


async def test_http_endpoint_paths_and_shutdown(running: Running) -> None:
    host, port = running.endpoint.host, running.endpoint.port
    status, _, _ = await http_get(host, port, "/nope")
    assert status == 404
    status, _, _ = await http_get(host, port, "/metrics", method="POST")
    assert status == 405
    status, headers, body = await http_get(host, port, "/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0

    await running.server.stop(grace=1)
    await running.endpoint.wait_closed()
    with pytest.raises(OSError):
        await http_get(host, port, "/metrics")


async def test_two_servers_keep_separate_registries(running: Running, tmpdir_short: str) -> None:
    other = Server(Config())
    other_metrics = prometheus.ShimMetrics(other)
    other_metrics.observe_rpc("Version", "OK", 0.001)
    await running.runtime.Version(pb.VersionRequest())
    s = await scrape(running)
    assert sample(s, "cri_shim_grpc_requests_total", method="Version", code="OK") == 1
    assert (
        other_metrics.registry.get_sample_value(
            "cri_shim_grpc_requests_total", {"method": "Version", "code": "OK"}
        )
        == 1
    )


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:9090", ("127.0.0.1", 9090)),
        (":9090", ("", 9090)),
        ("[::1]:9090", ("::1", 9090)),
    ],
    ids=["ipv4", "any", "ipv6"],
)
def test_parse_listen(listen: str, expected: tuple[str, int]) -> None:
    assert prometheus.parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["9090", "host:", "host:http", "host:70000"], ids=str)
def test_parse_listen_rejects(listen: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        prometheus.parse_listen(listen)


async def test_taken_port_fails_at_start(tmpdir_short: str) -> None:
    from shim.server import ServerError

    first = prometheus.start("127.0.0.1:0", Server(Config()))
    try:
        with pytest.raises(ServerError, match="metrics-listen"):
            prometheus.start(f"127.0.0.1:{first.port}", Server(Config()))
    finally:
        first.close()
        await first.wait_closed()


async def test_bad_listen_is_a_server_error() -> None:
    from shim.server import ServerError

    with pytest.raises(ServerError, match="HOST:PORT"):
        prometheus.start("localhost", Server(Config()))
