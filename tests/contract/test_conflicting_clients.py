"""Several clients on one node at once — a kubelet, crictl, a second controller — issuing
conflicting calls on the same pods, containers and images, on every backend.

Each client has its own connection. Whatever the interleaving, every answer is
success or a condition that names the conflict (NOT_FOUND, FAILED_PRECONDITION,
ALREADY_EXISTS, DEADLINE_EXCEEDED for an exec past its timeout); never UNKNOWN or
INTERNAL, never a hang; and once the last remove is through, nothing is left: no
pod, no container, no object in the runtime.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import grpc

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from tests.contract.conftest import Cri
from tests.contract.test_contract import create, run_pod, wait_state
from tests.criutil import container_config, sandbox_config

ROUNDS = 4
HANG = 60.0  # seconds: a round not over by then is a deadlock
CONFLICT = {
    grpc.StatusCode.OK,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
}


class Client:
    """One of the node's clients, on a connection of its own."""

    def __init__(self, cri: Cri, name: str) -> None:
        self.name = name
        self.channel = grpc.aio.insecure_channel(f"unix://{cri.root}/cri.sock")
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


async def outcome(call: Awaitable[Any]) -> tuple[grpc.StatusCode, Any, str]:
    try:
        return grpc.StatusCode.OK, await call, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), None, exc.details() or ""


async def race(*calls: Awaitable[Any]) -> list[tuple[grpc.StatusCode, Any, str]]:
    """Run every call at once; their outcomes, in order. A call still pending after HANG fails the test."""
    async with asyncio.timeout(HANG):
        return await asyncio.gather(*(outcome(c) for c in calls))


async def later(delay: float, call: Callable[[], Awaitable[Any]]) -> Any:
    await asyncio.sleep(delay)
    return await call()


def assert_conflicts_only(
    results: list[tuple[grpc.StatusCode, Any, str]], allowed: set[grpc.StatusCode]
) -> None:
    for code, _, details in results:
        assert code in allowed, f"{code.name}: {details}"
        if code != grpc.StatusCode.OK:
            assert details, f"{code.name} without a message"


async def runtime_objects(cri: Cri) -> list[str]:
    """What the runtime itself still holds for this shim, below the CRI: engine containers, VMs, fake pods."""
    b: Any = cri.backend
    if cri.kind == "fake":
        return list(b.runtime.lifecycle.sandboxes) + sorted(b.runtime.lifecycle.containers)
    if cri.kind == "docker":
        return [row["Names"][0] for row in await b._shared.ours()]
    return [f"VM of {sid}" for sid in b._shared.pods] + [f"container {cid}" for cid in b._shared.owner]


async def create_and_start(client: Client, req: pb.CreateContainerRequest) -> str:
    cid: str = (await client.rt.CreateContainer(req)).container_id
    await client.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    return cid


async def assert_node_empty(cri: Cri) -> None:
    assert not (await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
    assert not (await cri.rt.ListContainers(pb.ListContainersRequest())).containers
    assert await runtime_objects(cri) == []


async def test_stop_and_remove_while_creating_and_starting(cri: Cri) -> None:
    kubelet, crictl, controller = (Client(cri, n) for n in ("kubelet", "crictl", "controller"))
    try:
        for i in range(ROUNDS):
            pod, sc = await run_pod(cri, name=f"race-{i}")
            cc = container_config(name="c", image=cri.image, command=["sh", "-c", "sleep 3600"])
            create = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
            # The stop and the remove come a little later each round, so that they
            # land before, during and after the create.
            results = await race(
                create_and_start(kubelet, create),
                later(
                    0.02 * i, partial(crictl.rt.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id=pod))
                ),
                later(
                    0.03 * i,
                    partial(controller.rt.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=pod)),
                ),
            )
            assert_conflicts_only(results, CONFLICT)
            # The remove may have been refused (the pod was not yet stopped) or have
            # won; a second one, as a kubelet would retry, always ends it.
            await cri.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
            await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
            code, _, _ = await outcome(
                cri.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))
            )
            assert code == grpc.StatusCode.NOT_FOUND
        await assert_node_empty(cri)
    finally:
        for c in (kubelet, crictl, controller):
            await c.close()


async def test_remove_while_exec(cri: Cri) -> None:
    kubelet, crictl = Client(cri, "kubelet"), Client(cri, "crictl")
    try:
        pod, sc = await run_pod(cri, name="exec-race")
        for i in range(ROUNDS):
            cid = await create(cri, pod, sc, ["sh", "-c", "sleep 3600"], name=f"c{i}")
            await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            assert (await wait_state(cri, cid, pb.CONTAINER_RUNNING)).state == pb.CONTAINER_RUNNING

            exec_req = pb.ExecSyncRequest(
                container_id=cid, cmd=["sh", "-c", "sleep 2; echo done"], timeout=10
            )
            remove = pb.RemoveContainerRequest(container_id=cid)
            results = await race(
                kubelet.rt.ExecSync(exec_req),
                later(0.3 + 0.1 * i, partial(crictl.rt.RemoveContainer, remove)),
            )
            assert_conflicts_only(results, CONFLICT | {grpc.StatusCode.DEADLINE_EXCEEDED})
            assert results[1][0] == grpc.StatusCode.OK  # a remove is never refused for an exec in progress
            code, reply, _ = results[0]
            if code == grpc.StatusCode.OK:
                # The exec ended with its container: a non-zero code, or, if it was
                # quick enough, its output.
                assert reply.exit_code != 0 or reply.stdout == b"done\n", reply
            code, _, _ = await outcome(cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid)))
            assert code == grpc.StatusCode.NOT_FOUND
        await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
        await assert_node_empty(cri)
    finally:
        await kubelet.close()
        await crictl.close()


async def test_two_clients_create_the_same_pod_and_container(cri: Cri) -> None:
    a, b = Client(cri, "kubelet"), Client(cri, "controller")
    try:
        await cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=cri.image)))
        sc = sandbox_config(name="twin", uid="twin-uid", log_directory=os.path.join(cri.root, "logs"))
        results = await race(
            a.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc)),
            b.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc)),
        )
        assert_conflicts_only(results, CONFLICT)
        winners = [r for c, r, _ in results if c == grpc.StatusCode.OK]
        assert len(winners) == 1, results
        assert [c for c, _, _ in results if c != grpc.StatusCode.OK] == [grpc.StatusCode.ALREADY_EXISTS]
        pod = winners[0].pod_sandbox_id
        assert [p.id for p in (await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items] == [pod]

        cc = container_config(name="same", image=cri.image, command=["sh", "-c", "sleep 3600"])
        req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        results = await race(a.rt.CreateContainer(req), b.rt.CreateContainer(req))
        assert_conflicts_only(results, CONFLICT)
        assert sorted(c.name for c, _, _ in results) == ["ALREADY_EXISTS", "OK"], results
        ctrs = (await cri.rt.ListContainers(pb.ListContainersRequest())).containers
        assert len(ctrs) == 1

        await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
        await assert_node_empty(cri)
    finally:
        await a.close()
        await b.close()


async def test_concurrent_pulls_and_a_remove_of_one_image(cri: Cri) -> None:
    clients = [Client(cri, f"puller-{i}") for i in range(3)]
    try:
        spec = pb.ImageSpec(image=cri.image)
        results = await race(*(c.im.PullImage(pb.PullImageRequest(image=spec)) for c in clients))
        assert_conflicts_only(results, {grpc.StatusCode.OK})
        assert len({r.image_ref for _, r, _ in results}) == 1  # one image, whoever pulled it
        ref = results[0][1].image_ref
        listed = [i for i in (await cri.im.ListImages(pb.ListImagesRequest())).images if i.id == ref]
        assert len(listed) == 1

        # A pull and a remove at once: either order is fine, and afterwards the
        # image is either there whole or gone, and a pull brings it back.
        results = await race(
            clients[0].im.PullImage(pb.PullImageRequest(image=spec)),
            clients[1].im.RemoveImage(pb.RemoveImageRequest(image=spec)),
        )
        assert_conflicts_only(results, CONFLICT)
        status = (await cri.im.ImageStatus(pb.ImageStatusRequest(image=spec))).image
        if status.id:
            assert status.id == ref
        await cri.im.PullImage(pb.PullImageRequest(image=spec))
        assert (await cri.im.ImageStatus(pb.ImageStatusRequest(image=spec))).image.id == ref
    finally:
        for c in clients:
            await c.close()


async def test_stop_container_while_it_starts_and_a_second_stop(cri: Cri) -> None:
    kubelet, crictl = Client(cri, "kubelet"), Client(cri, "crictl")
    try:
        pod, sc = await run_pod(cri, name="stop-race")
        for i in range(ROUNDS):
            cid = await create(cri, pod, sc, ["sh", "-c", "sleep 3600"], name=f"c{i}")
            results = await race(
                kubelet.rt.StartContainer(pb.StartContainerRequest(container_id=cid)),
                crictl.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1)),
                kubelet.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1)),
            )
            assert_conflicts_only(results, CONFLICT)
            # Whatever won, a stop now leaves it exited, and it can be removed.
            await cri.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1))
            st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
            assert st.state in (pb.CONTAINER_EXITED, pb.CONTAINER_CREATED), st
            await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))
        await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))
        await assert_node_empty(cri)
    finally:
        await kubelet.close()
        await crictl.close()
