"""Bad input: each gets a clear gRPC error, and nothing changes."""

from __future__ import annotations

import grpc
import pytest

from cri_api import api_pb2 as pb
from tests.conftest import Running
from tests.criutil import container_config, sandbox_config

IA = grpc.StatusCode.INVALID_ARGUMENT


async def error_of(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


async def assert_nothing_created(r: Running) -> None:
    assert len((await r.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items) == 0
    assert len((await r.rt.ListContainers(pb.ListContainersRequest())).containers) == 0
    assert r.server.shim is not None
    assert not r.server.shim.store.sandbox_names._names and not r.server.shim.store.container_names._names


BAD_SANDBOXES = [
    ("no config", pb.RunPodSandboxRequest(), "config is required"),
    ("no metadata", pb.RunPodSandboxRequest(config=pb.PodSandboxConfig(hostname="x")), "config.metadata"),
    (
        "empty name",
        pb.RunPodSandboxRequest(config=sandbox_config(name="")),
        "config.metadata.name",
    ),
    ("empty namespace", pb.RunPodSandboxRequest(config=sandbox_config(namespace="")), "namespace"),
    ("empty uid", pb.RunPodSandboxRequest(config=sandbox_config(uid="")), "uid"),
    ("huge name", pb.RunPodSandboxRequest(config=sandbox_config(name="n" * 10_000)), "at most 253"),
    ("relative log dir", pb.RunPodSandboxRequest(config=sandbox_config(log_directory="logs")), "absolute"),
    (
        "bad port",
        pb.RunPodSandboxRequest(
            config=sandbox_config(port_mappings=[pb.PortMapping(container_port=70000, host_port=80)])
        ),
        "container_port",
    ),
    (
        "unknown handler",
        pb.RunPodSandboxRequest(config=sandbox_config(), runtime_handler="nonesuch"),
        "runtime_handler",
    ),
    (
        "too many labels",
        pb.RunPodSandboxRequest(config=sandbox_config(labels={f"k{i}": "v" for i in range(5000)})),
        "config.labels",
    ),
]


@pytest.mark.parametrize(
    ("req", "needle"), [(r, n) for _, r, n in BAD_SANDBOXES], ids=[i for i, _, _ in BAD_SANDBOXES]
)
async def test_bad_sandbox_requests(running: Running, req: pb.RunPodSandboxRequest, needle: str) -> None:
    err = await error_of(running.rt.RunPodSandbox(req))
    assert err.code() == IA
    assert needle in (err.details() or "")
    await assert_nothing_created(running)


async def test_bad_container_requests(running: Running, short_tmp: str) -> None:
    r = running
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    sc = sandbox_config(log_directory=f"{short_tmp}/logs")
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cases = [
        (pb.CreateContainerRequest(pod_sandbox_id=pod), "config is required"),
        (pb.CreateContainerRequest(pod_sandbox_id=pod, config=pb.ContainerConfig()), "config.metadata"),
        (
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=container_config(image="")),
            "config.image.image",
        ),
        (
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=container_config(log_path="/abs.log")),
            "relative",
        ),
        (
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=container_config(log_path="a/../../x")),
            "escapes",
        ),
        (pb.CreateContainerRequest(config=container_config()), "pod_sandbox_id"),
        (
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=container_config(stop_signal=9999)),
            "config.stop_signal 9999",
        ),
    ]
    for req, needle in cases:
        err = await error_of(r.rt.CreateContainer(req))
        assert err.code() == IA, (needle, err)
        assert needle in (err.details() or ""), (needle, err.details())
    assert len((await r.rt.ListContainers(pb.ListContainersRequest())).containers) == 0


async def test_ambiguous_prefix(running: Running) -> None:
    r = running
    ids = []
    for i in range(40):
        resp = await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name=f"p{i}")))
        ids.append(resp.pod_sandbox_id)
    # With 40 IDs, some one-character prefix is shared.
    first = {i[0] for i in ids}
    shared = next(c for c in first if sum(1 for i in ids if i.startswith(c)) > 1)
    err = await error_of(r.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=shared)))
    assert err.code() == IA and "ambiguous" in (err.details() or "")
    err = await error_of(r.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id="")))
    assert err.code() == IA


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xff\xff",  # not protobuf at all
        b"\x0a\x05\x0a\x03\xff\xfe\xfd",  # config.metadata.name as invalid UTF-8
        b"\x0a\xff\xff\xff\xff\x0f",  # a length far past the end
    ],
    ids=["garbage", "non-utf8-name", "truncated"],
)
async def test_malformed_bytes(running: Running, raw: bytes) -> None:
    call = running.channel.unary_unary(
        "/runtime.v1.RuntimeService/RunPodSandbox",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    err = await error_of(call(raw))
    assert err.code() == IA and "malformed RunPodSandbox request" in (err.details() or "")
    await assert_nothing_created(running)


async def test_malformed_bytes_on_a_streaming_rpc(running: Running) -> None:
    call = running.channel.unary_stream(
        "/runtime.v1.RuntimeService/StreamContainers",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call(b"\xff\xff\xff"):
            pass
    err = info.value
    assert err.code() == IA and "malformed StreamContainers request" in (err.details() or "")


async def test_unknown_method_is_unimplemented(running: Running) -> None:
    call = running.channel.unary_unary("/runtime.v1.RuntimeService/NoSuchThing")
    err = await error_of(call(b""))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_injected_backend_failure_rolls_back(running: Running) -> None:
    from shim.cri.errors import UnavailableError

    r = running
    r.fake.inject_error("run_sandbox", UnavailableError("engine went away"))
    sc = sandbox_config()
    err = await error_of(r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "engine went away" in (err.details() or "")
    await assert_nothing_created(r)
    # The name was released: the kubelet's retry succeeds.
    await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))


async def test_backend_bug_is_unknown_without_traceback(running: Running) -> None:
    r = running
    r.fake.inject_error("create_container", RuntimeError("kaboom"))
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    sc = sandbox_config()
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    err = await error_of(
        r.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=container_config()))
    )
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert "kaboom" in (err.details() or "") and "Traceback" not in (err.details() or "")
    assert len((await r.rt.ListContainers(pb.ListContainersRequest())).containers) == 0


UNSUPPORTED_MOUNTS = [
    (
        "image volume",
        pb.Mount(image=pb.ImageSpec(image="busybox")),
        grpc.StatusCode.UNIMPLEMENTED,
        "image volumes",
    ),
    ("no source", pb.Mount(), IA, "neither a host_path nor an image"),
    ("sub path without image", pb.Mount(host_path="/tmp", image_sub_path="x"), IA, "image_sub_path"),
    (
        "idmapped",
        pb.Mount(host_path="/tmp", uidMappings=[pb.IDMapping(host_id=1000, container_id=0, length=1)]),
        IA,
        "idmapped mounts need user namespaces",
    ),
    (
        "recursive read-only",
        pb.Mount(host_path="/tmp", readonly=True, recursive_read_only=True),
        IA,
        "recursive read-only",
    ),
]


@pytest.mark.parametrize(
    ("mount", "code", "needle"),
    [(m, c, n) for _, m, c, n in UNSUPPORTED_MOUNTS],
    ids=[i for i, _, _, _ in UNSUPPORTED_MOUNTS],
)
async def test_mounts_a_handler_cannot_honour_are_refused(
    running: Running, mount: pb.Mount, code: grpc.StatusCode, needle: str
) -> None:
    r = running
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config()))).pod_sandbox_id
    mount.container_path = "/data"
    cfg = container_config()
    cfg.mounts.append(mount)
    err = await error_of(r.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=cfg)))
    assert err.code() == code, err
    assert needle in (err.details() or "") and "config.mounts[0] (/data)" in (err.details() or "")
    assert len((await r.rt.ListContainers(pb.ListContainersRequest())).containers) == 0


RESOURCES_THE_KERNEL_REFUSES = [
    ("quota too big", pb.LinuxContainerResources(cpu_quota=9223372036854775807), "cpu_quota"),
    ("quota too small", pb.LinuxContainerResources(cpu_quota=500), "cpu_quota"),
    ("period too long", pb.LinuxContainerResources(cpu_period=2_000_000), "cpu_period"),
    ("shares too many", pb.LinuxContainerResources(cpu_shares=1 << 20), "cpu_shares"),
    ("oom score", pb.LinuxContainerResources(oom_score_adj=5000), "oom_score_adj"),
    ("cpuset", pb.LinuxContainerResources(cpuset_cpus="0-3;rm -rf"), "cpuset_cpus"),
    (
        "page size",
        pb.LinuxContainerResources(hugepage_limits=[pb.HugepageLimit(page_size="huge")]),
        "page_size",
    ),
    ("unified key", pb.LinuxContainerResources(unified={"../../etc/passwd": "x"}), "unified"),
]


@pytest.mark.parametrize(
    ("res", "needle"),
    [(r, n) for _, r, n in RESOURCES_THE_KERNEL_REFUSES],
    ids=[i for i, _, _ in RESOURCES_THE_KERNEL_REFUSES],
)
async def test_resources_the_kernel_cannot_take_are_invalid(
    running: Running, res: pb.LinuxContainerResources, needle: str
) -> None:
    r = running
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config()))).pod_sandbox_id
    cid = (
        await r.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=container_config()))
    ).container_id
    err = await error_of(
        r.rt.UpdateContainerResources(pb.UpdateContainerResourcesRequest(container_id=cid, linux=res))
    )
    assert err.code() == IA and needle in (err.details() or ""), err
    cfg = container_config(name="other")
    cfg.linux.resources.CopyFrom(res)
    err = await error_of(r.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=cfg)))
    assert err.code() == IA and needle in (err.details() or ""), err
    kubelet_like = pb.LinuxContainerResources(
        cpu_period=100000,
        cpu_quota=50000,
        cpu_shares=2,
        oom_score_adj=-997,
        memory_limit_in_bytes=64 << 20,
        hugepage_limits=[pb.HugepageLimit(page_size="2MB"), pb.HugepageLimit(page_size="1GB")],
    )
    await r.rt.UpdateContainerResources(
        pb.UpdateContainerResourcesRequest(container_id=cid, linux=kubelet_like)
    )


async def test_a_backend_option_it_does_not_know_stops_the_start_with_a_clear_error(short_tmp: str) -> None:
    import dataclasses

    from shim.config import HandlerConfig
    from shim.server import Server, ServerError
    from tests.conftest import server_config

    cfg = server_config(short_tmp)
    cfg = dataclasses.replace(
        cfg, handlers={**cfg.handlers, "vm": HandlerConfig(name="vm", type="runv", options={"bogus": 1})}
    )
    with pytest.raises(ServerError, match=r"\[handlers\.vm\].*unknown key 'bogus'"):
        await Server(cfg).start()


async def test_strict_supplemental_groups_on_a_handler_that_merges_is_refused(running: Running) -> None:
    r = running
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config()))).pod_sandbox_id
    cfg = container_config()
    cfg.linux.security_context.supplemental_groups_policy = pb.Strict
    err = await error_of(r.rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=pod, config=cfg)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "supplemental_groups_policy" in (err.details() or "") and "'fake'" in (err.details() or "")
    assert len((await r.rt.ListContainers(pb.ListContainersRequest())).containers) == 0


def _userns(
    mode: int, uids: list[tuple[int, int, int]], gids: list[tuple[int, int, int]]
) -> pb.PodSandboxConfig:
    cfg = sandbox_config()
    opts = cfg.linux.security_context.namespace_options.userns_options
    opts.mode = mode  # type: ignore[assignment]
    for c, h, n in uids:
        opts.uids.add(container_id=c, host_id=h, length=n)
    for c, h, n in gids:
        opts.gids.add(container_id=c, host_id=h, length=n)
    return cfg


USERNS = [
    (
        "two mappings",
        _userns(pb.POD, [(0, 1000, 10), (10, 5000, 10)], [(0, 1000, 10)]),
        "exactly one mapping",
    ),
    ("root unmapped", _userns(pb.POD, [(1, 1000, 10)], [(1, 1000, 10)]), "container ID 0 must be mapped"),
    ("container mode", _userns(pb.CONTAINER, [], []), "only NODE and POD"),
    ("target mode", _userns(pb.TARGET, [], []), "only NODE and POD"),
    ("node with mappings", _userns(pb.NODE, [(0, 1000, 10)], []), "only for mode POD"),
]


@pytest.mark.parametrize(("cfg", "needle"), [(c, n) for _, c, n in USERNS], ids=[i for i, _, _ in USERNS])
def test_user_namespace_options_are_checked(cfg: pb.PodSandboxConfig, needle: str) -> None:
    from backends.contract import Capability
    from shim.cri import validate
    from shim.cri.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=needle):
        validate.userns_for(cfg, Capability.USER_NAMESPACES, "runv")


async def test_a_user_namespace_on_a_handler_without_them_is_refused(running: Running) -> None:
    cfg = _userns(pb.POD, [(0, 1000, 65536)], [(0, 1000, 65536)])
    err = await error_of(running.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=cfg)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not support user namespaces" in (err.details() or "")
    assert not (await running.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
