"""Reconcile persisted records with what each backend really has.

Runs once at start, before the socket opens:
- an uncommitted record is a creation the previous process did not finish:
  the backend's leftovers are removed and the record dropped;
- a sandbox the backend lost is NOTREADY; a container it lost is EXITED with
  reason ``ContainerLost``; one that ended while the shim was down gets its
  real exit;
- running containers stay RUNNING with the same IDs, and the shim follows
  their processes again (output into the log after what it holds, exits).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import structlog

from backends.contract import Backend, ContainerRecord, ExitInfo, Observed, SandboxRecord
from cri_api import api_pb2 as pb
from shim.cri.state import Shim

log = structlog.get_logger("recovery")

LOST_EXIT_CODE = 255


async def recover(shim: Shim) -> None:
    store = shim.store
    outcomes: collections.Counter[str] = collections.Counter()
    for name, backend in shim.registry.items():
        sandboxes = [s for s in store.sandboxes.values() if s.backend == name]
        containers = [c for c in store.containers.values() if c.backend == name]
        if not sandboxes and not containers:
            with contextlib.suppress(Exception):
                await backend.lifecycle.recover([], [])
            continue
        try:
            seen_sb, seen_ct = await backend.lifecycle.recover(sandboxes, containers)
        except Exception as exc:
            # The runtime is down: keep every record as it is; Status says why.
            log.error("recovery.backend_unavailable", handler=name, error=str(exc))
            continue
        for c in containers:
            outcomes[await _recover_container(shim, backend, c, seen_ct.get(c.id))] += 1
        for s in sandboxes:
            outcomes[await _recover_sandbox(shim, s, seen_sb.get(s.id))] += 1
    log.info(
        "recovery.done",
        adopted_running=outcomes["adopted"],
        lost=outcomes["lost"],
        cleaned=outcomes["cleaned"],
    )


async def _recover_container(shim: Shim, backend: Backend, c: ContainerRecord, obs: Observed | None) -> str:
    """Bring one container's record in line with what its backend observed of it (``obs``, None:
    nothing); what came of it: "cleaned", "lost", "adopted" or ""."""
    if not c.committed:
        await _drop_container(shim, c)
        return "cleaned"
    if obs is None or not obs.exists:
        if c.status.state in (pb.CONTAINER_RUNNING, pb.CONTAINER_CREATED):
            shim.record_exit(
                c,
                ExitInfo(
                    exit_code=LOST_EXIT_CODE,
                    finished_at=shim.clock(),
                    reason="ContainerLost",
                    message="the runtime no longer has this container",
                ),
            )
            return "lost"
        return ""
    if c.status.state == pb.CONTAINER_CREATED and obs.started_at and (obs.running or obs.exit):
        # The start reached the runtime but the shim died before recording it: the
        # container did start (a second StartContainer would fail on a running one).
        shim.store.record_effect(c, status=dataclasses.replace(c.status, started_at=obs.started_at))
        shim.publish(c, pb.CONTAINER_STARTED_EVENT)
    if c.status.state == pb.CONTAINER_RUNNING and not obs.running and obs.exit is not None:
        shim.record_exit(c, obs.exit)
    elif c.status.state == pb.CONTAINER_RUNNING:
        try:
            followed = await shim.reattach(backend, c)
        except Exception as exc:
            log.warning("recovery.reattach_failed", container_id=c.id, error=str(exc))
            followed = False
        if not followed:
            # Ended between the backend's look and ours: it says how, if it can.
            shim.record_exit(
                c,
                obs.exit or ExitInfo(LOST_EXIT_CODE, shim.clock(), "Error", "ended during recovery"),
            )
        return "adopted"
    return ""


async def _recover_sandbox(shim: Shim, s: SandboxRecord, obs: Observed | None) -> str:
    """Bring one sandbox's record in line with what its backend observed of it; "cleaned",
    "lost" or ""."""
    if not s.committed:
        await _drop_sandbox(shim, s)
        return "cleaned"
    if (obs is None or not obs.exists) and s.status.ready:
        shim.store.record_effect(s, status=dataclasses.replace(s.status, ready=False))
        return "lost"
    if obs is not None and obs.status is not None and obs.status != s.status:
        shim.store.record_effect(s, status=obs.status)
    return ""


async def _drop_container(shim: Shim, c: ContainerRecord) -> None:
    try:
        await shim.backend(c.backend).lifecycle.remove_container(c)
    except Exception as exc:
        log.warning("recovery.leftover_remove_failed", container_id=c.id, error=str(exc))
    shim.store.remove(c)


async def _drop_sandbox(shim: Shim, s: SandboxRecord) -> None:
    backend = shim.backend(s.backend)
    try:
        await backend.lifecycle.stop_sandbox(s)
        await backend.lifecycle.remove_sandbox(s)
    except Exception as exc:
        log.warning("recovery.leftover_remove_failed", sandbox_id=s.id, error=str(exc))
    for c in shim.store.containers_of(s.id):
        await _drop_container(shim, c)
    shim.store.remove(s)
