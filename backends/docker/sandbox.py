"""RunPodSandbox / StopPodSandbox / RemovePodSandbox: the pause container (and, for a pod on CNI,
its network: network.py)."""

from __future__ import annotations

import asyncio
import os

from backends.contract import SandboxNetwork, SandboxRecord
from backends.contract.errors import CriError, NotFoundError

from . import convert
from . import labels as lbl
from .context import ENGINE_ID, PID, RESOLV, Shared
from .network import NETNS, CniPods
from .pod_files import POD_FILES
from .warm import WARM_ID, WarmPauses

_STOP_PAUSE_TIMEOUT = 10  # s; pause exits at once on SIGTERM


class Sandboxes:
    def __init__(self, shared: Shared, warm: WarmPauses | None = None) -> None:
        self._shared = shared
        self._pause_present = False  # checked (pulled if needed) once, then trusted until a create fails
        self.warm = warm  # None: no pool

    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        if self.warm is None:
            return await self._run(sandbox)
        self.warm.starting += 1
        try:
            return await self._run(sandbox)
        finally:
            self.warm.starting -= 1

    async def _run(self, sandbox: SandboxRecord) -> SandboxNetwork:
        shared = self._shared
        config = sandbox.config
        image = shared.engine_images.pause_image
        if not self._pause_present:
            await shared.engine_images.ensure(image)
            self._pause_present = True
        host_net = convert.sandbox_host_network(config)
        cni = shared.cni if shared.cni is not None and shared.cni.adds and not host_net else None
        cfg = convert.sandbox_config(
            sandbox.id,
            sandbox.handler,
            sandbox.created_at,
            config,
            image=image,
            network="none" if cni is not None else shared.network,
            runtime=shared.runtime(sandbox.handler),
            cgroup_parent=shared.cgroup_parent,
            instance=shared.instance,
        )
        if cni is not None:
            # The plugins wire the pod: the engine makes no network of its own (pod_files.py).
            cfg["NetworkDisabled"] = True
        warm = await self.warm.claim(sandbox, cfg) if host_net and self.warm is not None else None
        if warm is not None:
            engine_id = sandbox.backend_data[ENGINE_ID] = str(warm["Id"])
        else:
            name = lbl.sandbox_name(sandbox.id, config)
            try:
                engine_id = await shared.create(name, cfg, sandbox.backend_data)
            except NotFoundError:
                # The pause image was removed since we last looked.
                await shared.engine_images.ensure(image)
                engine_id = await shared.create(name, cfg, sandbox.backend_data)
        try:
            if warm is None:
                await shared.engine.start_container(engine_id)
            info = warm or await shared.engine.inspect_container(engine_id)
            dns = config.dns_config if config.HasField("dns_config") else None
            if cni is not None:
                sandbox.backend_data[POD_FILES] = await shared.engine.run(
                    lambda: shared.pod_files.write(sandbox.id, dns)
                )
            elif dns is not None:
                path = str(info.get("ResolvConfPath") or "")
                if path:
                    content = convert.resolv_conf(config.dns_config)
                    await shared.engine.run(lambda: _write_file(path, content))
                    sandbox.backend_data[RESOLV] = path
            pid = sandbox.backend_data[PID] = int(info["State"].get("Pid") or 0)
            if cni is not None:
                net = await cni.attach(sandbox, pid)
            else:
                net = SandboxNetwork(ip="" if host_net else shared.ip_of(info))
        except BaseException:
            await asyncio.shield(self._undo(sandbox, engine_id, cni))
            raise
        warm_id = str(sandbox.backend_data.get(WARM_ID) or "")
        shared.states.sandbox(sandbox.id, engine_id, warm_id).watched = True
        return net

    async def _undo(self, sandbox: SandboxRecord, engine_id: str, cni: CniPods | None) -> None:
        if cni is not None:
            await cni.release(sandbox)  # before the pause container goes, as a stop does
        await self._shared.remove(engine_id)
        if cni is not None:  # also a directory whose files were not all written
            sandbox.backend_data.pop(POD_FILES, None)
            await self._shared.engine.run(lambda: self._shared.pod_files.remove(sandbox.id))
        sandbox.backend_data.pop(ENGINE_ID, None)
        sandbox.backend_data.pop(WARM_ID, None)

    async def stop_sandbox(self, sandbox: SandboxRecord) -> None:
        shared = self._shared
        unreleased: CriError | None = None
        if NETNS in sandbox.backend_data and shared.cni is not None:
            try:
                await shared.cni.detach(sandbox)
            except CriError as exc:
                unreleased = exc
        eid = sandbox.backend_data.get(ENGINE_ID)
        if eid:
            await self._stop_pause(sandbox.id, str(eid))
        if unreleased is not None:
            # The pod is stopped and its network not released: the caller hears why (and stops
            # again, which DELs again), and the record says NOTREADY, so that a remove needs
            # no stop first; the remove releases what it can whatever the plugins say.
            if shared.events is not None:
                shared.events.sandbox_not_ready(sandbox.id, "CNI DEL failed")
            raise unreleased

    async def _stop_pause(self, sandbox_id: str, engine_id: str) -> None:
        st = self._shared.states.sandboxes.get(sandbox_id)
        if st is not None:
            st.stopping, st.watched = True, False
        try:
            await self._shared.engine.stop_container(engine_id, _STOP_PAUSE_TIMEOUT)
        except NotFoundError:
            pass
        finally:
            if st is not None:
                st.stopping = False

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        shared = self._shared
        if NETNS in sandbox.backend_data and shared.cni is not None:
            await shared.cni.release(sandbox)
        eid = sandbox.backend_data.get(ENGINE_ID) or await shared.engine_id_of(sandbox.id)
        shared.states.drop_sandbox(sandbox.id)
        if eid:
            await shared.remove(str(eid))
        if POD_FILES in sandbox.backend_data:
            await shared.engine.run(lambda: shared.pod_files.remove(sandbox.id))


def _write_file(path: str, content: str) -> None:
    tmp = f"{path}.crishim"
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, path)
