"""A container's command is PID 1 of its PID namespace: the kernel gives it only the signals it
handles, so a stop signal it has no handler for is ignored and the stop timeout's KILL ends it
(137), as the node e2e "Deleted pods handling" specs expect; sharing the pod's PID namespace (the
pause process is PID 1 there), the default action applies (143 for TERM)."""

from __future__ import annotations

import time

import pytest

from cri_api import api_pb2 as pb
from tests.contract.conftest import Cri
from tests.contract.test_contract import create, run_pod, wait_state


async def _pod(cri: Cri, mode: int) -> tuple[str, pb.PodSandboxConfig, pb.LinuxContainerConfig]:
    """A pod whose containers have PID namespace ``mode`` (CONTAINER: one of their own, as the
    kubelet asks by default; POD, the CRI's zero value: the pod's, as for shareProcessNamespace),
    and the Linux config of such a container."""
    ns = pb.NamespaceOption(pid=mode)  # type: ignore[arg-type]
    sandbox_linux = pb.LinuxPodSandboxConfig(
        security_context=pb.LinuxSandboxSecurityContext(namespace_options=ns)
    )
    pod, sc = await run_pod(cri, linux=sandbox_linux)
    linux = pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(namespace_options=ns))
    return pod, sc, linux


async def _stopped(cri: Cri, cid: str, timeout: int) -> tuple[pb.ContainerStatus, float]:
    """Stops a running container: its status once exited, and how long StopContainer took."""
    assert (await wait_state(cri, cid, pb.CONTAINER_RUNNING)).state == pb.CONTAINER_RUNNING
    t0 = time.monotonic()
    await cri.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=timeout))
    took = time.monotonic() - t0
    return await wait_state(cri, cid, pb.CONTAINER_EXITED), took


async def test_sleep_as_pid_one_ignores_term_and_is_killed_after_the_timeout(cri: Cri) -> None:
    pod, sc, linux = await _pod(cri, pb.CONTAINER)
    cid = await create(cri, pod, sc, ["sleep", "1800"], linux=linux)
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st, took = await _stopped(cri, cid, 1)
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 137, "Error")
    assert took >= 0.9, f"killed after {took:.2f} s, before the 1 s timeout: TERM was not ignored"


async def test_a_trapped_stop_signal_runs_the_trap(cri: Cri) -> None:
    if cri.backend.exec is None:
        pytest.skip(f"{cri.kind} declares no ExecSync")
    pod, sc, linux = await _pod(cri, pb.CONTAINER)
    script = 'trap "exit 0" TERM; touch /tmp/ready; sleep 100 & wait'
    cid = await create(cri, pod, sc, ["sh", "-c", script], linux=linux)
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    ready = ["sh", "-c", "until [ -e /tmp/ready ]; do sleep 0.05; done"]
    await cri.rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=ready, timeout=20))
    st, _ = await _stopped(cri, cid, 60)
    # Killed after the timeout, it would say 137.
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 0, "Completed")


async def test_sharing_the_pods_pid_namespace_term_ends_it(cri: Cri) -> None:
    pod, sc, linux = await _pod(cri, pb.POD)
    cid = await create(cri, pod, sc, ["sleep", "1800"], linux=linux)
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    st, _ = await _stopped(cri, cid, 60)
    # Killed after the timeout, it would say 137.
    assert (st.state, st.exit_code, st.reason) == (pb.CONTAINER_EXITED, 143, "Error")
