"""Recovery after a restart: adopt the engine containers the records claim, remove the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any

import structlog

from backends.contract import ContainerRecord, Observed, SandboxRecord, SandboxStatus
from backends.contract.errors import NotFoundError

from . import convert
from . import labels as lbl
from .context import ENGINE_ID, PID, Shared, exit_info
from .engine_api import parse_time
from .warm import WARM_ID

log = structlog.get_logger(__name__)


async def recover(
    shared: Shared,
    sandboxes: Sequence[SandboxRecord],
    containers: Sequence[ContainerRecord],
    pool_items: Collection[str] = (),
) -> tuple[dict[str, Observed], dict[str, Observed]]:
    """``pool_items``: the IDs of the warm pause containers this shim's pool has made since it
    started (before recovery runs): not leftovers."""
    rows = await shared.ours()
    by_id = {(r.get("Labels") or {}).get(lbl.ID, ""): r for r in rows}
    for item in pool_items:
        by_id.pop(item, None)
    records: dict[str, SandboxRecord | ContainerRecord] = {r.id: r for r in sandboxes}
    records.update((r.id, r) for r in containers)
    # A pod that took a warm pause container: its labels name the pool item, the record the pod.
    for sb in sandboxes:
        warm_id = str(sb.backend_data.get(WARM_ID) or "")
        if warm_id in by_id and sb.committed:
            by_id[sb.id] = by_id.pop(warm_id)
    # Leftovers: engine objects no record claims, or whose record was never committed.
    for cri_id, row in by_id.items():
        rec = records.get(cri_id)
        if rec is None or not rec.committed:
            log.info("removing leftover engine container", cri_id=cri_id, engine_id=row["Id"][:12])
            await shared.remove(row["Id"])
    # Image volumes of containers no committed record claims (removed while the shim was down).
    shared.volumes.sweep(r.id for r in containers if r.committed)
    # The hosts and resolv.conf of pods no committed record claims (pod_files.py).
    shared.pod_files.sweep(r.id for r in sandboxes if r.committed)
    # CNI attachments of pods no committed record claims (a crash between the ADD and the record).
    if shared.cni is not None:
        await shared.cni.recover(r.id for r in sandboxes if r.committed)
    claimed = [r for r in records.values() if r.committed and r.id in by_id]
    found = await asyncio.gather(
        *(shared.engine.inspect_container(by_id[r.id]["Id"]) for r in claimed), return_exceptions=True
    )
    infos: dict[str, dict[str, Any]] = {}
    for rec, info in zip(claimed, found, strict=True):
        if isinstance(info, NotFoundError):
            continue  # removed between the list and the inspect
        if isinstance(info, BaseException):
            raise info
        rec.backend_data[ENGINE_ID] = info["Id"]
        infos[rec.id] = info
    sb_seen = {sb.id: _seen_sandbox(shared, sb, infos.get(sb.id)) for sb in sandboxes}
    ct_seen = {ct.id: _seen_container(shared, ct, infos.get(ct.id)) for ct in containers}
    return sb_seen, ct_seen


def _seen_sandbox(shared: Shared, sb: SandboxRecord, info: dict[str, Any] | None) -> Observed:
    """What the engine's inspection (``info``, None: no container) says of a pod's pause
    container; a running one is watched again."""
    if not info:
        return Observed(exists=False)
    running = bool(info["State"].get("Running"))
    sb_state = shared.states.sandbox(sb.id, info["Id"], str(sb.backend_data.get(WARM_ID) or ""))
    if running:
        sb.backend_data[PID] = int(info["State"].get("Pid") or 0)
        sb_state.watched = True
    return Observed(
        exists=True,
        running=running,
        started_at=parse_time(info["State"].get("StartedAt")),
        status=SandboxStatus(
            ready=running,
            ip=sb.status.ip or ("" if convert.sandbox_host_network(sb.config) else shared.ip_of(info)),
            additional_ips=sb.status.additional_ips,
        ),
    )


def _seen_container(shared: Shared, ct: ContainerRecord, info: dict[str, Any] | None) -> Observed:
    """What the engine's inspection (``info``, None: no container) says of a container."""
    if not info:
        return Observed(exists=False)
    state = info["State"]
    running = bool(state.get("Running"))
    started = parse_time(state.get("StartedAt"))
    exited = exit_info(state) if not running and started else None
    ct_state = shared.states.container(ct.id, info["Id"])
    if running:
        ct.backend_data[PID] = int(state.get("Pid") or 0)
        ct_state.watched = True  # the shim follows it next (reattach)
        ct_state.tty = bool(info["Config"].get("Tty"))
    return Observed(exists=True, running=running, exit=exited, started_at=started)
