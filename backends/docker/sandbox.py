"""RunPodSandbox / StopPodSandbox / RemovePodSandbox: the pause container."""

from __future__ import annotations

import asyncio
import os

from backends.contract import SandboxNetwork, SandboxRecord
from backends.contract.errors import NotFoundError

from . import convert
from . import labels as lbl
from .context import ENGINE_ID, PID, RESOLV, Shared
from .warm import WARM_ID, WarmPauses

_STOP_PAUSE_TIMEOUT = 10  # s; pause exits at once on SIGTERM


class Sandboxes:
    def __init__(self, shared: Shared, warm: WarmPauses | None = None) -> None:
        self._shared = shared
        self._pause_present = False  # checked (pulled if needed) once, then trusted until a create fails
        self.warm = warm  # None: no pool

    async def run(self, sandbox: SandboxRecord) -> SandboxNetwork:
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
        image = shared.images.pause_image
        if not self._pause_present:
            await shared.images.ensure(image)
            self._pause_present = True
        cfg = convert.sandbox_config(
            sandbox.id,
            sandbox.handler,
            sandbox.created_at,
            config,
            image=image,
            network=shared.network,
            runtime=shared.runtime(sandbox.handler),
            cgroup_parent=shared.cgroup_parent,
            instance=shared.instance,
        )
        host_net = convert.sandbox_host_network(config)
        warm = await self.warm.claim(sandbox, cfg) if host_net and self.warm is not None else None
        if warm is not None:
            engine_id = sandbox.backend_data[ENGINE_ID] = str(warm["Id"])
        else:
            name = lbl.sandbox_name(sandbox.id, config)
            try:
                engine_id = await shared.create(name, cfg, sandbox.backend_data)
            except NotFoundError:
                # The pause image was removed since we last looked.
                await shared.images.ensure(image)
                engine_id = await shared.create(name, cfg, sandbox.backend_data)
        try:
            if warm is None:
                await shared.engine.start_container(engine_id)
            info = warm or await shared.engine.inspect_container(engine_id)
            if config.HasField("dns_config"):
                path = str(info.get("ResolvConfPath") or "")
                if path:
                    content = convert.resolv_conf(config.dns_config)
                    await shared.engine.run(lambda: _write_file(path, content))
                    sandbox.backend_data[RESOLV] = path
            sandbox.backend_data[PID] = int(info["State"].get("Pid") or 0)
            ip = "" if host_net else shared.ip_of(info)
        except BaseException:
            await asyncio.shield(shared.remove(engine_id))
            sandbox.backend_data.pop(ENGINE_ID, None)
            sandbox.backend_data.pop(WARM_ID, None)
            raise
        warm_id = str(sandbox.backend_data.get(WARM_ID) or "")
        shared.states.sandbox(sandbox.id, engine_id, warm_id).watched = True
        return SandboxNetwork(ip=ip)

    async def stop(self, sandbox: SandboxRecord) -> None:
        eid = sandbox.backend_data.get(ENGINE_ID)
        if not eid:
            return
        st = self._shared.states.sandboxes.get(sandbox.id)
        if st is not None:
            st.stopping, st.watched = True, False
        try:
            await self._shared.engine.stop_container(str(eid), _STOP_PAUSE_TIMEOUT)
        except NotFoundError:
            pass
        finally:
            if st is not None:
                st.stopping = False

    async def remove(self, sandbox: SandboxRecord) -> None:
        eid = sandbox.backend_data.get(ENGINE_ID) or await self._shared.engine_id_of(sandbox.id)
        self._shared.states.drop_sandbox(sandbox.id)
        if eid:
            await self._shared.remove(str(eid))


def _write_file(path: str, content: str) -> None:
    tmp = f"{path}.crishim"
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, path)
