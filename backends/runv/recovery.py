"""Recovery after a restart: the shim's records against the VMs and agents that are really
there."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from backends import contract
from backends.cni.pinned import NETNS
from backends.contract import errors
from backends.runv.agent import messages as m
from backends.runv.hypervisor import VM

from . import plumbing
from .context import Shared
from .state import Pod


async def recover(
    shared: Shared,
    sandboxes: Sequence[contract.SandboxRecord],
    containers: Sequence[contract.ContainerRecord],
) -> tuple[dict[str, contract.Observed], dict[str, contract.Observed]]:
    """Adopt the VMs of committed sandboxes and reconnect to their agents; report what each
    pod and container really is; destroy the rest (half-made pods, leftover VMs) and release
    the network they held."""
    sb_obs: dict[str, contract.Observed] = {}
    ct_obs: dict[str, contract.Observed] = {}
    agent_states: dict[str, m.ContainerState] = {}
    known: set[str] = set()
    for sb in sandboxes:
        data = sb.backend_data.get("vm")
        if not data:
            sb_obs[sb.id] = contract.Observed(exists=False)
            continue
        vm = VM.from_dict(data)
        known.add(vm.id)
        if not sb.committed or not await shared.hv.adopt(vm):
            if NETNS in sb.backend_data and shared.cni is not None:
                await shared.cni.release(sb)
            await shared.hv.destroy(vm)
            await plumbing.unplumb(shared, sb)
            await shared.net.delete_veth(shared.net.veth_names(vm.id)[0])
            sb_obs[sb.id] = contract.Observed(exists=False)
            continue
        net = sb.backend_data.get("net")
        if net:
            shared.net.reserve(sb.id, str(net["ip"]))
        pod = Pod(sb.id, vm)
        shared.pods[sb.id] = pod
        try:
            await shared.connect(pod)
            assert pod.agent is not None
            listing = await pod.agent.call(m.ListRequest())
        except errors.CriError:
            sb_obs[sb.id] = contract.Observed(
                exists=True, running=False, status=contract.SandboxStatus(ready=False)
            )
            shared.watch(pod)
            continue
        for c in listing.containers:
            agent_states[c.id] = c
        shared.watch(pod)
        sb_obs[sb.id] = contract.Observed(exists=True, running=True, status=sb.status)
    for ct in containers:
        state = agent_states.get(ct.id)
        owner = shared.pods.get(ct.sandbox_id)
        if state is None or owner is None:
            ct_obs[ct.id] = contract.Observed(exists=False)
            continue
        shared.owner[ct.id] = ct.sandbox_id
        owner.containers.add(ct.id)
        if state.status == "exited":
            info = contract.ExitInfo(state.exit_code, state.finished_at, state.reason)
            ct_obs[ct.id] = contract.Observed(True, False, info, state.started_at)
        else:
            running = state.status == "running"
            ct_obs[ct.id] = contract.Observed(True, running, None, state.started_at)
    for vm in shared.hv.leftovers(known):
        await shared.hv.destroy(vm)
        # A RunPodSandbox killed between making the VM's veth and recording it.
        await shared.net.delete_veth(shared.net.veth_names(vm.id)[0])
    with_net = {sb.id for sb in sandboxes if sb.backend_data.get("net")}
    for sb in sandboxes:
        if sb.id in with_net and not sb_obs.get(sb.id, contract.Observed(exists=False)).exists:
            with_net.discard(sb.id)
    shared.net.release_unknown(with_net)
    with contextlib.suppress(errors.CriError):
        await shared.net.remove_unknown_host_ports(with_net)
    if shared.cni is not None:
        # CNI attachments and pins of pods with no VM left or no record (a SIGKILL between
        # the ADD and the record).
        await shared.cni.recover(sid for sid, seen in sb_obs.items() if seen.exists)
    return sb_obs, ct_obs
